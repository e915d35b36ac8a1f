"""Hugging Face <-> Megatron weights for the decoder (Llama, Qwen2/2.5, Qwen3; the text part of VLMs).

HF -> Megatron, per TP rank, reading only this rank's slices from disk (``CheckpointReader`` of
``slime_mt/safetensors_files.py``):
fused ``linear_qkv`` in Megatron's grouped layout (for each key/value group: its query heads, then k,
then v; groups split across ranks), fused ``linear_fc1`` = [gate; up] of this rank's shard,
row-parallel ``linear_proj``/``linear_fc2`` split on the input dim, vocabulary rows padded to a TP
multiple and split. With the Transformer Engine spec the two pre-norms are fused into the
following linear (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``); which names a
rank uses is data (``decoder_names``), so the TE mapping is tested without TE.

Megatron -> HF (``iter_megatron_to_hf``) gathers each tensor's shards to one rank of the TP group
and undoes its layout, tensor by tensor: the destination holds one full tensor at a time, the other
ranks none. Checkpoint names keep the source's prefix (``model.`` or ``model.language_model.``).

Experts (MoE layers): the router ``mlp.gate.weight`` is replicated; expert ``e`` lives on expert-parallel
rank ``e // (E / ep)`` as its local expert ``e % (E / ep)``, its ``linear_fc1`` = [gate; up] and
``linear_fc2`` split over the expert-tensor-parallel ranks like a dense MLP's (``ExpertLayout``). HF
holds experts in one of three layouts, all read: per-expert keys (``mlp.experts.{e}.gate_proj.weight``,
Qwen3-MoE's checkpoints), the fused layout Qwen3-VL-MoE publishes (``mlp.experts.gate_up_proj``
``[E, H, 2I]``, gate columns first, and ``mlp.experts.down_proj`` ``[E, I, H]``), and transformers'
in-memory fused layout (``[E, 2I, H]`` and ``[E, H, I]``, which its ``save_pretrained`` writes), told
apart by shape, one layout per layer (``fused_layout``: gate_up's shape cannot tell when H == 2I).
Export writes each family's published layout, gathering experts over the expert-tensor-parallel group
and then the expert-parallel group to global rank 0 (``ExpertGather``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from slime_mt.backends.megatron.families import DecoderSpec, padded_vocab
from slime_mt.backends.megatron.parallel import Stage
from slime_mt.safetensors_files import CheckpointReader

TEXT_PREFIXES = ("model.language_model.", "model.")


def text_prefix(names) -> str:
    for prefix in TEXT_PREFIXES:
        if f"{prefix}embed_tokens.weight" in names:
            return prefix
    raise KeyError("no decoder embedding (model.embed_tokens.weight or model.language_model.embed_tokens.weight)")


FUSED_EXPERT_FAMILIES = ("qwen3-vl-moe",)  # checkpoints published with fused expert tensors


@dataclass(frozen=True)
class ExpertLayout:
    """Where this rank's experts sit: its expert-parallel rank of ``ep`` (a block of ``E / ep``
    experts) and its expert-tensor-parallel rank of ``etp`` (a slice of each one's intermediate size)."""

    ep_rank: int = 0
    ep: int = 1
    etp_rank: int = 0
    etp: int = 1

    def local_experts(self, num_experts: int) -> range:
        per = num_experts // self.ep
        return range(self.ep_rank * per, (self.ep_rank + 1) * per)


def decoder_names(layer: int, te: bool, sparse: bool = False) -> dict[str, str]:
    """Megatron parameter names of one decoder layer: local spec, or TE's fused pre-norms (an MoE
    layer keeps its own pre-MLP norm under TE too)."""
    d = f"decoder.layers.{layer}."
    fused_mlp_norm = te and not sparse
    return {
        "input_norm": d + ("self_attention.linear_qkv.layer_norm_weight" if te else "input_layernorm.weight"),
        "mlp_norm": d + ("mlp.linear_fc1.layer_norm_weight" if fused_mlp_norm else "pre_mlp_layernorm.weight"),
        "qkv": d + "self_attention.linear_qkv.weight",
        "qkv_bias": d + "self_attention.linear_qkv.bias",
        "q_norm": d + "self_attention.q_layernorm.weight",
        "k_norm": d + "self_attention.k_layernorm.weight",
        "proj": d + "self_attention.linear_proj.weight",
        "fc1": d + "mlp.linear_fc1.weight",
        "fc2": d + "mlp.linear_fc2.weight",
        "router": d + "mlp.router.weight",
    }


def expert_names(layer: int, local: int, te: bool) -> tuple[str, str]:
    """(fc1, fc2) Megatron names of local expert ``local`` of one MoE layer: sequential experts, or
    Transformer Engine's grouped GEMM (one weight per expert on a shared module)."""
    d = f"decoder.layers.{layer}.mlp.experts."
    if te:
        return f"{d}linear_fc1.weight{local}", f"{d}linear_fc2.weight{local}"
    return f"{d}local_experts.{local}.linear_fc1.weight", f"{d}local_experts.{local}.linear_fc2.weight"


def fused_layout(mlp: str, gate_up: list[int], down: list[int], hidden: int, inter: int) -> bool:
    """Whether one MoE layer's fused experts are in the published layout (``[E, H, 2I]`` / ``[E, I, H]``,
    True) or transformers' in-memory one (``[E, 2I, H]`` / ``[E, H, I]``, what its ``save_pretrained``
    writes). One layout for the layer, told by the tensor whose shape tells it: gate_up's cannot when
    H == 2I (Qwen3-MoE-style configs often have it), down's cannot when H == I. A layer that fits neither
    layout, or both, is refused naming its tensors."""
    fits = {
        True: gate_up[1:] == [hidden, 2 * inter] and down[1:] == [inter, hidden],
        False: gate_up[1:] == [2 * inter, hidden] and down[1:] == [hidden, inter],
    }
    if fits[True] != fits[False]:
        return fits[True]
    shapes = f"{mlp}experts.gate_up_proj {gate_up} and {mlp}experts.down_proj {down}"
    why = "fit both fused layouts: which one is written cannot be told" if fits[True] else "fit no fused layout"
    raise ValueError(
        f"{shapes} {why} (published [E, H, 2I] / [E, I, H], transformers' [E, 2I, H] / [E, H, I]; "
        f"hidden size {hidden}, moe_intermediate_size {inter})"
    )


class HFExperts:
    """One MoE layer's experts in an HF checkpoint, in whichever of the three layouts it holds them;
    ``gate_up``/``down`` read one expert's slice of the intermediate size."""

    def __init__(self, reader: CheckpointReader, mlp: str, spec: DecoderSpec):
        self.reader, self.mlp = reader, mlp
        hidden, inter = spec.hidden_size, spec.moe.ffn_hidden_size
        self.inter = inter
        self.fused = f"{mlp}experts.gate_up_proj" in reader
        if self.fused:
            gate_up, down = reader.shape(f"{mlp}experts.gate_up_proj"), reader.shape(f"{mlp}experts.down_proj")
            self.published_gate_up = self.published_down = fused_layout(mlp, gate_up, down, hidden, inter)

    def gate_up(self, e: int, f0: int, f1: int) -> torch.Tensor:
        """Expert ``e``'s gate rows ``f0:f1`` then its up rows ``f0:f1``: ``[2 (f1 - f0), H]``."""
        if not self.fused:
            m = f"{self.mlp}experts.{e}."
            return torch.cat(
                [self.reader.rows(m + "gate_proj.weight", f0, f1), self.reader.rows(m + "up_proj.weight", f0, f1)]
            )
        both = self.reader.rows(f"{self.mlp}experts.gate_up_proj", e, e + 1)[0]
        if self.published_gate_up:
            both = both.t()  # [2I, H]
        return torch.cat([both[f0:f1], both[self.inter + f0 : self.inter + f1]]).contiguous()

    def down(self, e: int, f0: int, f1: int) -> torch.Tensor:
        """Expert ``e``'s down projection for intermediate columns ``f0:f1``: ``[H, f1 - f0]``."""
        if not self.fused:
            return self.reader.cols(f"{self.mlp}experts.{e}.down_proj.weight", f0, f1)
        down = self.reader.rows(f"{self.mlp}experts.down_proj", e, e + 1)[0]
        if self.published_down:
            down = down.t()  # [H, I]
        return down[:, f0:f1].contiguous()


def span(size: int, rank: int, tp: int) -> tuple[int, int]:
    per = size // tp
    return rank * per, (rank + 1) * per


def _vocab_shard(reader: CheckpointReader, name: str, spec: DecoderSpec, rank: int, tp: int) -> torch.Tensor:
    """This rank's rows of the padded vocabulary (rows past the real vocabulary are zeros)."""
    start, stop = span(padded_vocab(spec.vocab_size, tp), rank, tp)
    real = reader.rows(name, start, min(stop, spec.vocab_size)) if start < spec.vocab_size else None
    width = reader.shape(name)[1]
    if real is not None and real.shape[0] == stop - start:
        return real
    pad = torch.zeros(
        stop - start - (0 if real is None else real.shape[0]),
        width,
        dtype=real.dtype if real is not None else torch.float32,
        device="cpu",
    )
    return pad if real is None else torch.cat([real, pad])


def qkv_shard(reader: CheckpointReader, a: str, kind: str, spec: DecoderSpec, rank: int, tp: int) -> torch.Tensor:
    """This rank's groups of q/k/v rows, fused as [q_g, k_g, v_g for each local group g]."""
    hd, groups = spec.head_dim, spec.num_kv_heads
    per_group = spec.num_heads // groups
    g0, g1 = span(groups, rank, tp)
    q = reader.rows(f"{a}q_proj.{kind}", g0 * per_group * hd, g1 * per_group * hd)
    k = reader.rows(f"{a}k_proj.{kind}", g0 * hd, g1 * hd)
    v = reader.rows(f"{a}v_proj.{kind}", g0 * hd, g1 * hd)
    local = g1 - g0
    fused = torch.cat(
        [
            q.reshape(local, per_group * hd, *q.shape[1:]),
            k.reshape(local, hd, *k.shape[1:]),
            v.reshape(local, hd, *v.shape[1:]),
        ],
        dim=1,
    )
    return fused.reshape(-1, *q.shape[1:]).contiguous()


def iter_hf_to_megatron(
    reader: CheckpointReader,
    spec: DecoderSpec,
    rank: int,
    tp: int,
    te: bool = False,
    experts: ExpertLayout | None = None,
    stage: Stage | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's Megatron decoder tensors, one at a time, reading only its slices of the HF tensors
    (``experts``: this rank's experts in an MoE decoder; by default all of them, split like the TP;
    ``stage``: this rank's pipeline stage, its layers named from 0, the embedding on the first stage,
    the final norm and output layer on the last: with tied embeddings the last stage's output layer
    is its own copy of the embedding)."""
    p = text_prefix(reader.names())
    experts = experts or ExpertLayout(etp_rank=rank, etp=tp)
    stage = stage or Stage.whole(spec.num_layers)
    if stage.first:
        yield "embedding.word_embeddings.weight", _vocab_shard(reader, f"{p}embed_tokens.weight", spec, rank, tp)
    if stage.last:
        yield "decoder.final_layernorm.weight", reader.get(f"{p}norm.weight")
    if stage.last and (not spec.tie_embeddings or not stage.first):
        output = "lm_head.weight" if not spec.tie_embeddings else f"{p}embed_tokens.weight"
        yield "output_layer.weight", _vocab_shard(reader, output, spec, rank, tp)
    for i in stage.layers:
        sparse = spec.moe is not None and spec.moe.sparse_layers[i]
        src, names = f"{p}layers.{i}.", decoder_names(i - stage.layers.start, te, sparse)
        a, m = src + "self_attn.", src + "mlp."
        yield names["input_norm"], reader.get(src + "input_layernorm.weight")
        yield names["mlp_norm"], reader.get(src + "post_attention_layernorm.weight")
        yield names["qkv"], qkv_shard(reader, a, "weight", spec, rank, tp)
        if spec.qkv_bias:
            yield names["qkv_bias"], qkv_shard(reader, a, "bias", spec, rank, tp)
        if spec.qk_norm:
            yield names["q_norm"], reader.get(a + "q_norm.weight")
            yield names["k_norm"], reader.get(a + "k_norm.weight")
        yield names["proj"], reader.cols(a + "o_proj.weight", *span(spec.num_heads * spec.head_dim, rank, tp))
        if sparse:
            yield names["router"], reader.get(m + "gate.weight")
            hf = HFExperts(reader, m, spec)
            f0, f1 = span(spec.moe.ffn_hidden_size, experts.etp_rank, experts.etp)
            for local, e in enumerate(experts.local_experts(spec.moe.num_experts)):
                fc1, fc2 = expert_names(i - stage.layers.start, local, te)
                yield fc1, hf.gate_up(e, f0, f1)
                yield fc2, hf.down(e, f0, f1)
            continue
        f0, f1 = span(spec.ffn_hidden_size, rank, tp)
        yield (
            names["fc1"],
            torch.cat([reader.rows(m + "gate_proj.weight", f0, f1), reader.rows(m + "up_proj.weight", f0, f1)]),
        )
        yield names["fc2"], reader.cols(m + "down_proj.weight", f0, f1)


def load_into(module: torch.nn.Module, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Copy (name, tensor) pairs into ``module``'s parameters, one at a time (cast to their dtype, on
    their device); every parameter must be covered."""
    params = dict(module.named_parameters())
    seen: set[str] = set()
    unknown: list[str] = []
    with torch.no_grad():
        for name, tensor in tensors:
            if name not in params:
                unknown.append(name)
                continue
            if params[name].shape != tensor.shape:
                raise ValueError(f"{name}: converted shape {tuple(tensor.shape)} != model {tuple(params[name].shape)}")
            params[name].copy_(tensor)
            seen.add(name)
    missing = sorted(set(params) - seen)
    if missing or unknown:
        raise KeyError(f"weight conversion mismatch: missing {missing[:5]}, unexpected {unknown[:5]}")


class TPGather:
    """Gathers TP shards to one rank of the group (``dst``, a global rank), tensor by tensor."""

    def __init__(self, tp: int, group=None, dst: int = 0, here: bool | None = None):
        self.tp, self.group, self.dst = tp, group, dst
        self.here = (tp == 1 or torch.distributed.get_rank() == dst) if here is None else here

    def _gather(self, t: torch.Tensor) -> torch.Tensor | None:
        """``[tp, *t.shape]``: every rank's shard, gathered into one buffer on ``dst`` (None elsewhere)."""
        t = t.detach()
        if self.tp == 1:
            return t[None]
        buffer = torch.empty(self.tp, *t.shape, dtype=t.dtype, device=t.device) if self.here else None
        torch.distributed.gather(
            t.contiguous(), list(buffer.unbind(0)) if self.here else None, dst=self.dst, group=self.group
        )
        return buffer

    def parts(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's shard of ``t`` in TP order on ``dst`` (None elsewhere); views, do not keep."""
        buffer = self._gather(t)
        return None if buffer is None else list(buffer.unbind(0))

    def cat(self, t: torch.Tensor, dim: int) -> torch.Tensor | None:
        """The full tensor, the shards joined along ``dim`` (a new tensor: one copy at most)."""
        buffer = self._gather(t)
        if buffer is None:
            return None
        if dim == 0:
            whole = buffer.reshape(-1, *t.shape[1:])
            return whole.clone() if self.tp == 1 else whole
        return torch.cat(buffer.unbind(0), dim=dim)

    def replicated(self, t: torch.Tensor) -> torch.Tensor | None:
        return t.detach().clone() if self.here else None


class ExpertGather:
    """Gathers experts to global rank 0: each expert's shards over the expert-tensor-parallel group
    (``etp``, to its first rank), then the whole local experts over the expert-parallel group.
    Replicas other than the first (expert-data-parallel ranks above 0) take no part (``active``)."""

    def __init__(self, layout: ExpertLayout, etp: TPGather, ep_group=None, active: bool = True):
        self.layout, self.etp, self.active = layout, etp, active
        self.ep_group = ep_group
        self.ep_dst = torch.distributed.get_process_group_ranks(ep_group)[0] if ep_group is not None else 0
        at_ep_dst = layout.ep == 1 or torch.distributed.get_rank() == self.ep_dst
        self.here = active and etp.here and at_ep_dst

    def _over_ep(self, t: torch.Tensor | None) -> list[torch.Tensor] | None:
        """Every expert-parallel rank's ``t`` (the ETP-gathered expert) on the EP destination."""
        if self.layout.ep == 1:
            return [t]
        if self.layout.etp_rank != 0:
            return None
        shape = (self.layout.ep, *t.shape)
        buffer = torch.empty(shape, dtype=t.dtype, device=t.device) if self.here else None
        torch.distributed.gather(
            t.contiguous(), list(buffer.unbind(0)) if self.here else None, dst=self.ep_dst, group=self.ep_group
        )
        return list(buffer.unbind(0)) if self.here else None

    def expert(
        self, fc1: torch.Tensor, fc2: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None:
        """This local expert on every EP rank -> [(gate [I, H], up [I, H], down [H, I])] in EP-rank
        order on global rank 0, None elsewhere. Collective over the ETP and EP groups."""
        parts = self.etp.parts(fc1)
        gate_up = None if parts is None else torch.cat(split_gate_up(parts))
        down = self.etp.cat(fc2, 1)
        gate_ups, downs = self._over_ep(gate_up), self._over_ep(down)
        if not self.here:
            return None
        return [(*(half.contiguous() for half in gu.chunk(2, dim=0)), d.contiguous()) for gu, d in zip(gate_ups, downs)]


def split_gate_up(fc1_parts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The full gate and up projections from every TP shard of a fused ``linear_fc1`` ([gate; up] each)."""
    gates, ups = zip(*(part.chunk(2, dim=0) for part in fc1_parts))
    return torch.cat(gates).contiguous(), torch.cat(ups).contiguous()


EXPERT_PROJECTIONS = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")  # per-expert HF keys, in order


def unpack_qkv(fused_parts: list[torch.Tensor], spec: DecoderSpec) -> tuple[torch.Tensor, ...]:
    """The full q, k and v rows from every TP shard of a fused ``linear_qkv`` tensor (Megatron's grouped
    layout: per key/value group its query heads, then k, then v); the columns as they are."""
    hd, groups = spec.head_dim, spec.num_kv_heads
    per_group = spec.num_heads // groups
    fused = torch.cat([p.reshape(-1, (per_group + 2) * hd, *p.shape[1:]) for p in fused_parts], dim=0)
    q, k, v = fused.split([per_group * hd, hd, hd], dim=1)
    return tuple(x.reshape(-1, *x.shape[2:]).contiguous() for x in (q, k, v))


def _iter_experts(
    state: Mapping[str, torch.Tensor], spec: DecoderSpec, layer: int, mlp: str, gather: ExpertGather, te: bool
) -> Iterator[tuple[str, torch.Tensor | None]]:
    """One MoE layer's experts in the family's published HF layout (collective over the expert groups)."""
    per = spec.moe.num_experts // gather.layout.ep
    fused = spec.family in FUSED_EXPERT_FAMILIES
    everyone: dict[int, tuple] = {}
    for local in range(per):
        fc1, fc2 = expert_names(layer, local, te)
        got = gather.expert(state[fc1], state[fc2])
        for ep_rank, tensors in enumerate(got or []):
            e = ep_rank * per + local
            if fused:
                everyone[e] = tensors
            else:
                yield from ((f"{mlp}experts.{e}.{n}", t) for n, t in zip(EXPERT_PROJECTIONS, tensors))
        if got is None and not fused:
            yield from ((f"{mlp}experts.{local}.{n}", None) for n in EXPERT_PROJECTIONS)
    if fused:
        experts = range(spec.moe.num_experts)
        gate_up = torch.stack([torch.cat(everyone[e][:2]).t() for e in experts]).contiguous() if gather.here else None
        down = torch.stack([everyone[e][2].t() for e in experts]).contiguous() if gather.here else None
        yield f"{mlp}experts.gate_up_proj", gate_up
        yield f"{mlp}experts.down_proj", down


def iter_megatron_to_hf(
    state: Mapping[str, torch.Tensor],
    spec: DecoderSpec,
    gather: TPGather,
    prefix: str = "model.",
    te: bool = False,
    experts: ExpertGather | None = None,
    dense: bool = True,
    stage: Stage | None = None,
) -> Iterator[tuple[str, torch.Tensor | None]]:
    """(HF name, full tensor) from this rank's Megatron decoder state, one tensor at a time; the
    tensor is None on ranks other than the gather's destination. Collective over the TP group (and
    the expert groups): every rank of the group must iterate to the end. ``dense=False``: a rank that
    only lends its experts (a data-parallel replica other than the first) skips everything else.
    ``stage``: the pipeline stage ``state`` holds (its layers named from 0): only its tensors, the
    tied output layer's copy on the last stage left out (the checkpoint has the embedding once)."""
    stage = stage or Stage.whole(spec.num_layers)
    if not dense:
        if experts is not None and experts.active and spec.moe is not None:
            for i in stage.layers:
                if spec.moe.sparse_layers[i]:
                    local = i - stage.layers.start
                    yield from _iter_experts(state, spec, local, f"{prefix}layers.{i}.mlp.", experts, te)
        return
    experts = experts or ExpertGather(ExpertLayout(etp_rank=0 if gather.here else 1, etp=gather.tp), gather)
    p = prefix
    if stage.first:
        embed = gather.cat(state["embedding.word_embeddings.weight"], 0)
        yield f"{p}embed_tokens.weight", None if embed is None else embed[: spec.vocab_size]
    if stage.last:
        yield f"{p}norm.weight", gather.replicated(state["decoder.final_layernorm.weight"])
    if stage.last and not spec.tie_embeddings:  # tied checkpoints store no lm_head
        head = gather.cat(state["output_layer.weight"], 0)
        yield "lm_head.weight", None if head is None else head[: spec.vocab_size]
    for i in stage.layers:
        sparse = spec.moe is not None and spec.moe.sparse_layers[i]
        names, dst = decoder_names(i - stage.layers.start, te, sparse), f"{p}layers.{i}."
        a = dst + "self_attn."
        yield dst + "input_layernorm.weight", gather.replicated(state[names["input_norm"]])
        yield dst + "post_attention_layernorm.weight", gather.replicated(state[names["mlp_norm"]])
        parts = gather.parts(state[names["qkv"]])
        q, k, v = unpack_qkv(parts, spec) if parts is not None else (None,) * 3
        yield from ((a + "q_proj.weight", q), (a + "k_proj.weight", k), (a + "v_proj.weight", v))
        if spec.qkv_bias:
            parts = gather.parts(state[names["qkv_bias"]])
            qb, kb, vb = unpack_qkv(parts, spec) if parts is not None else (None,) * 3
            yield from ((a + "q_proj.bias", qb), (a + "k_proj.bias", kb), (a + "v_proj.bias", vb))
        if spec.qk_norm:
            yield a + "q_norm.weight", gather.replicated(state[names["q_norm"]])
            yield a + "k_norm.weight", gather.replicated(state[names["k_norm"]])
        yield a + "o_proj.weight", gather.cat(state[names["proj"]], 1)
        if sparse:
            yield dst + "mlp.gate.weight", gather.replicated(state[names["router"]])
            yield from _iter_experts(state, spec, i - stage.layers.start, dst + "mlp.", experts, te)
            continue
        parts = gather.parts(state[names["fc1"]])
        gate, up = (None, None) if parts is None else split_gate_up(parts)
        yield dst + "mlp.gate_proj.weight", gate
        yield dst + "mlp.up_proj.weight", up
        yield dst + "mlp.down_proj.weight", gather.cat(state[names["fc2"]], 1)
