"""Process setup: torch.distributed (gloo on CPU, NCCL on GPU), Megatron's TP/DP groups, seeds,
and the one device policy (``current_device``).

Launched by ``torchrun`` (RANK/WORLD_SIZE/MASTER_ADDR in the environment) or as a single process
(world size 1, a local TCP store on 127.0.0.1). DP = world / (TP x CP); ranks r and r+1 share a TP
group, then the TP groups of one DP rank form its CP group (Megatron's order).
Experts (MoE) are placed by Megatron's expert groups, carved from the same world: expert-tensor
parallel (ETP, the TP size unless given), expert parallel (EP, within DP), and the expert
data-parallel replicas left over (world / (ETP x EP)).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from slime_mt.backends.megatron import import_megatron_core
from slime_mt.backends.megatron.cpu_patches import apply_cpu_patches


def layout_name(tp: int, cp: int, ep: int, dp: int, sequence_parallel: bool = False, pp: int = 1) -> str:
    """A train rank's parallel layout as the dry run and the trace name it: ``TP=2 (sequence parallel)
    CP=1 EP=1 DP=2`` (sequence parallelism under TP only; ``PP=2`` before DP under pipeline
    parallelism)."""
    sp = " (sequence parallel)" if sequence_parallel and tp > 1 else ""
    stages = f" PP={pp}" if pp > 1 else ""
    return f"TP={tp}{sp} CP={cp} EP={ep}{stages} DP={dp}"


@dataclass(frozen=True)
class Stage:
    """A pipeline stage's part of the decoder: its layers (global indices), whether it holds the
    embedding (the first stage) and the final norm and output layer (the last). Without pipeline
    parallelism one stage holds everything."""

    layers: range
    first: bool = True
    last: bool = True

    @classmethod
    def whole(cls, num_layers: int) -> Stage:
        return cls(range(num_layers))


@dataclass(frozen=True)
class PipelineSplit:
    """How the decoder's layers split over ``size`` pipeline stages, by Megatron's rule: evenly, or with
    ``first`` layers on the first stage and ``last`` on the last (``--decoder-first-pipeline-num-layers``,
    ``--decoder-last-pipeline-num-layers``: a stage that also holds the embedding or the output layer
    given fewer layers) and the rest evenly over the stages between."""

    size: int = 1
    first: int | None = None
    last: int | None = None

    @classmethod
    def of(cls, train) -> PipelineSplit:
        """The split a ``TrainConfig`` asks for."""
        return cls(
            train.pipeline_model_parallel_size,
            train.decoder_first_pipeline_num_layers,
            train.decoder_last_pipeline_num_layers,
        )

    def layer_counts(self, num_layers: int) -> list[int]:
        """Layers per stage, in stage order; ValueError, naming the flags, where ``num_layers`` does not
        split so (Megatron builds a missing or a doubled layer there without a word)."""
        given = {0: self.first} if self.first is not None else {}
        if self.last is not None:
            given[self.size - 1] = self.last
        flags = f"--pipeline-model-parallel-size {self.size}"
        for end, n in (("first", self.first), ("last", self.last)):
            flags += f" --decoder-{end}-pipeline-num-layers {n}" if n is not None else ""
        if self.size == 1 and given:
            raise ValueError(f"{flags}: an uneven split needs two or more pipeline stages")
        if any(n < 1 for n in given.values()):
            raise ValueError(f"{flags}: every pipeline stage holds at least one layer")
        rest, left = num_layers - sum(given.values()), self.size - len(given)
        stages = f"{left} stage{'s' if left != 1 else ''}"
        where = f"the other {stages}" if given else stages
        if not left and rest:
            raise ValueError(f"{flags}: {num_layers} layers leave {rest} for no stage")
        if rest < left:
            raise ValueError(f"{flags}: {num_layers} layers leave {rest} for {where}, at least one each")
        if left and rest % left:
            raise ValueError(f"{flags}: {num_layers} layers leave {rest} for {where}, which do not split evenly")
        return [given.get(s, rest // left if left else 0) for s in range(self.size)]

    def stages(self, num_layers: int) -> list[Stage]:
        """Each stage's layers (global indices), embedding on the first, output layer on the last."""
        out, start = [], 0
        for s, n in enumerate(self.layer_counts(num_layers)):
            out.append(Stage(range(start, start + n), first=s == 0, last=s == self.size - 1))
            start += n
        return out

    def config_kwargs(self) -> dict:
        """Megatron's TransformerConfig fields for the split."""
        return dict(
            pipeline_model_parallel_size=self.size,
            num_layers_in_first_pipeline_stage=self.first,
            num_layers_in_last_pipeline_stage=self.last,
        )


@dataclass
class ParallelInfo:
    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    dp_rank: int
    dp_size: int
    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1
    edp_rank: int = 0  # expert data-parallel rank: which replica of this rank's experts
    cp_rank: int = 0  # context parallel: which share of every packed row this rank holds
    cp_size: int = 1
    pp_rank: int = 0  # pipeline parallel: which stage of the decoder's layers this rank holds
    pp_size: int = 1

    @property
    def first_replica(self) -> bool:
        """Whether this rank's model shard is the one exports and checkpoints read (DP rank 0, CP rank 0):
        every DP and CP rank holds the same dense weights."""
        return self.dp_rank == 0 and self.cp_rank == 0


def current_device() -> torch.device:
    """Where every tensor of the trainer lives: this process's CUDA device when there is one (set
    from LOCAL_RANK by ``init_parallel``), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_parallel(
    tp_size: int, seed: int, ep_size: int = 1, etp_size: int | None = None, cp_size: int = 1, pp_size: int = 1
) -> ParallelInfo:
    """Initialise (once) the process group and Megatron's model-parallel state; seed the RNGs.
    ``ep_size``/``etp_size``: the expert-parallel and expert-tensor-parallel sizes (MoE); ``cp_size``:
    the context-parallel size (each packed row split over that many ranks); ``pp_size``: the pipeline
    stages (the decoder's layers split over that many ranks, Megatron's order: TP, CP, DP, PP)."""
    import_megatron_core()
    from megatron.core import parallel_state, tensor_parallel

    gpu = torch.cuda.is_available()
    apply_cpu_patches()
    if not dist.is_initialized():
        if "RANK" in os.environ:
            world = int(os.environ["WORLD_SIZE"])
            if gpu:
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            dist.init_process_group("nccl" if gpu else "gloo")
        else:  # one process: an in-memory store, no port to race another process for
            world = 1
            dist.init_process_group("nccl" if gpu else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    world = dist.get_world_size()
    if world % (tp_size * cp_size * pp_size):
        raise ValueError(
            f"--tensor-model-parallel-size {tp_size} x --context-parallel-size {cp_size} x "
            f"--pipeline-model-parallel-size {pp_size} must divide the {world} launched processes"
        )
    etp_size = tp_size if etp_size is None else etp_size
    if world % (ep_size * etp_size):  # Megatron's MoE parallel folding: EP x ETP over all the ranks
        raise ValueError(
            f"--expert-model-parallel-size {ep_size} x --expert-tensor-parallel-size {etp_size} must divide the "
            f"{world} launched processes"
        )
    if not gpu and "OMP_NUM_THREADS" not in os.environ:
        # the cores shared by the processes (oversubscription is slower); a user's OMP_NUM_THREADS wins
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp_size,
            context_parallel_size=cp_size,
            pipeline_model_parallel_size=pp_size,
            expert_model_parallel_size=ep_size,
            expert_tensor_parallel_size=etp_size,
        )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return ParallelInfo(
        dist.get_rank(),
        world,
        parallel_state.get_tensor_model_parallel_rank(),
        tp_size,
        parallel_state.get_data_parallel_rank(),
        parallel_state.get_data_parallel_world_size(),
        parallel_state.get_expert_model_parallel_rank(),
        parallel_state.get_expert_model_parallel_world_size(),
        parallel_state.get_expert_tensor_parallel_rank(),
        parallel_state.get_expert_tensor_parallel_world_size(),
        parallel_state.get_expert_data_parallel_rank(),
        parallel_state.get_context_parallel_rank(),
        cp_size,
        parallel_state.get_pipeline_model_parallel_rank(),
        pp_size,
    )


def destroy_parallel() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
