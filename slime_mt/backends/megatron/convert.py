"""Hugging Face <-> Megatron weights for the decoder (Llama, Qwen2/2.5, Qwen3; the text part of VLMs).

HF -> Megatron, per TP rank: fused ``linear_qkv`` in Megatron's grouped layout (for each key/value
group: its query heads, then k, then v; groups split across ranks), fused ``linear_fc1`` = [gate; up]
of this rank's shard, row-parallel ``linear_proj``/``linear_fc2`` split on the input dim, vocabulary
rows padded to a TP multiple and split. Megatron -> HF gathers the shards over the TP group and
undoes each layout; rank 0 gets the full tensors. Checkpoint names keep the source's prefix
(``model.`` or ``model.language_model.``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from slime_mt.backends.megatron.models import DecoderSpec, padded_vocab

TEXT_PREFIXES = ("model.language_model.", "model.")


def load_hf_state(path: str | Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    for f in files:
        with safe_open(str(f), "pt") as handle:
            for key in handle.keys():
                tensors[key] = handle.get_tensor(key)
    return tensors


def text_prefix(names) -> str:
    for prefix in TEXT_PREFIXES:
        if f"{prefix}embed_tokens.weight" in names:
            return prefix
    raise KeyError("no decoder embedding (model.embed_tokens.weight or model.language_model.embed_tokens.weight)")


def _shard(t: torch.Tensor, dim: int, rank: int, tp: int) -> torch.Tensor:
    return t.chunk(tp, dim=dim)[rank].contiguous()


def _pad_vocab(t: torch.Tensor, spec: DecoderSpec, tp: int) -> torch.Tensor:
    rows = padded_vocab(spec.vocab_size, tp)
    if t.shape[0] == rows:
        return t
    return torch.cat([t, torch.zeros(rows - t.shape[0], *t.shape[1:], dtype=t.dtype)])


def _qkv_layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: DecoderSpec, rank: int, tp: int) -> torch.Tensor:
    """[q; k; v] (HF) -> this rank's grouped [q_g, k_g, v_g for each local group g] (rows first)."""
    hd, groups = spec.head_dim, spec.num_kv_heads
    per_group = spec.num_heads // groups
    q = q.reshape(groups, per_group * hd, *q.shape[1:])
    k = k.reshape(groups, hd, *k.shape[1:])
    v = v.reshape(groups, hd, *v.shape[1:])
    fused = torch.cat([q, k, v], dim=1)  # [groups, (per_group + 2) * hd, ...]
    local = fused.chunk(tp, dim=0)[rank]
    return local.reshape(-1, *q.shape[2:]).contiguous()


def hf_to_megatron(hf: dict[str, torch.Tensor], spec: DecoderSpec, rank: int, tp: int) -> dict[str, torch.Tensor]:
    """This rank's Megatron decoder state dict from HF tensors."""
    p = text_prefix(hf)
    out = {"embedding.word_embeddings.weight": _shard(_pad_vocab(hf[f"{p}embed_tokens.weight"], spec, tp), 0, rank, tp),
           "decoder.final_layernorm.weight": hf[f"{p}norm.weight"]}
    if not spec.tie_embeddings:
        out["output_layer.weight"] = _shard(_pad_vocab(hf["lm_head.weight"], spec, tp), 0, rank, tp)
    for i in range(spec.num_layers):
        src, dst = f"{p}layers.{i}.", f"decoder.layers.{i}."
        a = src + "self_attn."
        out[dst + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"]
        out[dst + "pre_mlp_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"]
        out[dst + "self_attention.linear_qkv.weight"] = _qkv_layout(
            hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"], spec, rank, tp)
        if spec.qkv_bias:
            out[dst + "self_attention.linear_qkv.bias"] = _qkv_layout(
                hf[a + "q_proj.bias"], hf[a + "k_proj.bias"], hf[a + "v_proj.bias"], spec, rank, tp)
        if spec.qk_norm:
            out[dst + "self_attention.q_layernorm.weight"] = hf[a + "q_norm.weight"]
            out[dst + "self_attention.k_layernorm.weight"] = hf[a + "k_norm.weight"]
        out[dst + "self_attention.linear_proj.weight"] = _shard(hf[a + "o_proj.weight"], 1, rank, tp)
        m = src + "mlp."
        out[dst + "mlp.linear_fc1.weight"] = torch.cat(
            [_shard(hf[m + "gate_proj.weight"], 0, rank, tp), _shard(hf[m + "up_proj.weight"], 0, rank, tp)])
        out[dst + "mlp.linear_fc2.weight"] = _shard(hf[m + "down_proj.weight"], 1, rank, tp)
    return out


def load_into(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state`` into ``module``'s parameters; every decoder parameter must be covered."""
    params = dict(module.named_parameters())
    missing = sorted(set(params) - set(state))
    unknown = sorted(set(state) - set(params))
    if missing or unknown:
        raise KeyError(f"weight conversion mismatch: missing {missing[:5]}, unexpected {unknown[:5]}")
    with torch.no_grad():
        for name, tensor in state.items():
            if params[name].shape != tensor.shape:
                raise ValueError(f"{name}: converted shape {tuple(tensor.shape)} != model {tuple(params[name].shape)}")
            params[name].copy_(tensor)


def _gather_parts(t: torch.Tensor, tp: int, group) -> list[torch.Tensor]:
    """Every TP rank's shard of ``t``, in rank order."""
    if tp == 1:
        return [t.detach().clone()]
    parts = [torch.empty_like(t) for _ in range(tp)]
    torch.distributed.all_gather(parts, t.detach().contiguous(), group=group)
    return parts


def _gather(t: torch.Tensor, dim: int, tp: int, group) -> torch.Tensor:
    return torch.cat(_gather_parts(t, tp, group), dim=dim)


def _unqkv(fused_parts: list[torch.Tensor], spec: DecoderSpec) -> tuple[torch.Tensor, ...]:
    hd, groups = spec.head_dim, spec.num_kv_heads
    per_group = spec.num_heads // groups
    fused = torch.cat([p.reshape(-1, (per_group + 2) * hd, *p.shape[1:]) for p in fused_parts], dim=0)
    q, k, v = fused.split([per_group * hd, hd, hd], dim=1)
    return tuple(x.reshape(-1, *x.shape[2:]).contiguous() for x in (q, k, v))


def megatron_to_hf(state: dict[str, torch.Tensor], spec: DecoderSpec, tp: int, group=None,
                   prefix: str = "model.") -> dict[str, torch.Tensor]:
    """Full HF tensors from this rank's Megatron decoder state (collective over the TP group)."""
    p = prefix
    out = {f"{p}embed_tokens.weight": _gather(state["embedding.word_embeddings.weight"], 0, tp, group)[: spec.vocab_size],
           f"{p}norm.weight": state["decoder.final_layernorm.weight"].detach().clone()}
    if not spec.tie_embeddings:  # tied checkpoints store no lm_head
        out["lm_head.weight"] = _gather(state["output_layer.weight"], 0, tp, group)[: spec.vocab_size]
    for i in range(spec.num_layers):
        src, dst = f"decoder.layers.{i}.", f"{p}layers.{i}."
        a = dst + "self_attn."
        out[dst + "input_layernorm.weight"] = state[src + "input_layernorm.weight"].detach().clone()
        out[dst + "post_attention_layernorm.weight"] = state[src + "pre_mlp_layernorm.weight"].detach().clone()
        q, k, v = _unqkv(_gather_parts(state[src + "self_attention.linear_qkv.weight"], tp, group), spec)
        out[a + "q_proj.weight"], out[a + "k_proj.weight"], out[a + "v_proj.weight"] = q, k, v
        if spec.qkv_bias:
            qb, kb, vb = _unqkv(_gather_parts(state[src + "self_attention.linear_qkv.bias"], tp, group), spec)
            out[a + "q_proj.bias"], out[a + "k_proj.bias"], out[a + "v_proj.bias"] = qb, kb, vb
        if spec.qk_norm:
            out[a + "q_norm.weight"] = state[src + "self_attention.q_layernorm.weight"].detach().clone()
            out[a + "k_norm.weight"] = state[src + "self_attention.k_layernorm.weight"].detach().clone()
        out[a + "o_proj.weight"] = _gather(state[src + "self_attention.linear_proj.weight"], 1, tp, group)
        fc1 = _gather_parts(state[src + "mlp.linear_fc1.weight"], tp, group)
        gates, ups = zip(*(part.chunk(2, dim=0) for part in fc1))
        out[dst + "mlp.gate_proj.weight"] = torch.cat(gates).contiguous()
        out[dst + "mlp.up_proj.weight"] = torch.cat(ups).contiguous()
        out[dst + "mlp.down_proj.weight"] = _gather(state[src + "mlp.linear_fc2.weight"], 1, tp, group)
    return out
