"""A ``MegatronModel``'s weights in the Hugging Face layout, gathered from every rank that holds a piece.

``iter_hf_weights(model)`` streams (HF name, full tensor on global rank 0 / None elsewhere), one tensor at
a time, so no rank ever holds more than one full tensor: each tensor's shards gathered over its TP group
and its layout undone (``convert.iter_megatron_to_hf``), experts gathered over the expert-tensor-parallel
then the expert-parallel ranks, and under pipeline parallelism every later stage's tensors sent to global
rank 0, stage by stage. It is collective: every rank iterates it to the end. Every weight transport to the
engines (in-process, disk, broadcast, tensor handles) and the FP8 copy they may serve
(``engine/weights/fp8.py``) read this one stream; checkpoints read it too, with the optimizer's tensors in
place of the weights (``tensors``).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from slime_mt.backends.megatron.convert import ExpertGather, TPGather, iter_megatron_to_hf
from slime_mt.backends.megatron.lora import merged_state


def tp_gather(model) -> TPGather:
    """Gathers to the TP group's first rank (global rank 0's group is the one that pushes weights); DP
    replicas other than the first take no part."""
    from megatron.core import parallel_state

    return TPGather(model.info.tp_size, model.tp_group(), parallel_state.get_tensor_model_parallel_src_rank())


def expert_gather(model) -> ExpertGather | None:
    """Gathers experts over ETP then EP to global rank 0 (None for dense models); expert data-parallel
    replicas other than the first take no part."""
    if model.spec.moe is None:
        return None
    from megatron.core import parallel_state

    info = model.info
    etp_group = parallel_state.get_expert_tensor_parallel_group()
    etp_dst = dist.get_process_group_ranks(etp_group)[0] if info.etp_size > 1 else info.rank
    etp = TPGather(info.etp_size, etp_group, etp_dst)
    ep_group = parallel_state.get_expert_model_parallel_group() if info.ep_size > 1 else None
    return ExpertGather(model.experts, etp, ep_group, active=info.edp_rank == 0)


def iter_hf_weights(model, tensors: dict[str, torch.Tensor] | None = None) -> Iterator[tuple[str, torch.Tensor | None]]:
    """(HF name, full tensor on global rank 0 / None elsewhere), one tensor at a time. Collective over
    the TP group of DP rank 0 (and, for MoE, over the expert groups: other DP ranks lend their experts
    and yield None for them); other DP ranks yield nothing else. ``tensors``: Megatron-named decoder
    tensors to export instead of the weights (gradients, optimizer states)."""
    experts = expert_gather(model)
    first = model.info.first_replica
    if not first and experts is None:
        return
    state = tensors if tensors is not None else model.module.decoder_state_dict()
    if tensors is None and model.adapters:  # LoRA: the weights with the adapters folded in
        state = merged_state(state, model.adapters)
    mine = iter_megatron_to_hf(
        state, model.spec, tp_gather(model), model.prefix, model.te, experts, dense=first, stage=model.stage
    )
    if model.info.pp_size > 1:  # each stage's gathered tensors to global rank 0, stage by stage
        yield from stages_to_rank0(model, mine)
    else:
        yield from mine
    if not first:
        return
    if tensors is None and hasattr(model.module, "vision_state_dict"):
        here = model.info.rank == 0
        for name, t in model.module.vision_state_dict().items():
            yield name, t.clone() if here else None


def stages_to_rank0(model, mine: Iterator[tuple[str, torch.Tensor | None]]):
    """Global rank 0 yields its own stage's tensors, then every later stage's, each sent by the rank its
    TP group gathered it to, one tensor at a time; the other ranks yield their stage's names (None),
    sending what they gathered."""
    from megatron.core import parallel_state

    info = model.info
    if info.rank == 0:
        yield from mine
        for src in dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())[1:]:
            while True:
                head: list = [None]
                dist.recv_object_list(head, src=src)
                if head[0] is None:  # the stage is done
                    break
                name, shape, dtype = head[0]
                tensor = torch.empty(shape, dtype=dtype, device=model.device)
                dist.recv(tensor, src=src)
                yield name, tensor
        return
    # the stage's first replica's TP rank 0 (other DP ranks lend their experts to it under EP)
    sender = info.tp_rank == 0 and info.pp_rank > 0 and info.first_replica
    for name, tensor in mine:
        if sender:
            dist.send_object_list([(name, tuple(tensor.shape), tensor.dtype)], dst=0)
            dist.send(tensor.contiguous(), dst=0)
        yield name, None
    if sender:
        dist.send_object_list([None], dst=0)


def export_hf(model) -> dict[str, torch.Tensor]:
    """Every HF-named tensor of the model on global rank 0 ({} on other ranks); collective."""
    named = {name: t for name, t in iter_hf_weights(model)}
    return named if model.info.rank == 0 else {}
