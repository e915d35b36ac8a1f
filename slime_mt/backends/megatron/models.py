"""Megatron-core models built from a Hugging Face checkpoint folder's config.

Text families: Llama (SmolLM2), Qwen2/Qwen2.5 (qkv bias), Qwen3 (q/k RMSNorm) -> ``GPTModel`` with the
local layer spec on CPU (the Transformer Engine spec when ``transformer_engine`` imports), RMSNorm,
SwiGLU, rotary embeddings with the checkpoint's base. VLMs wrap such a decoder (``vlm.py``).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*not installed.*")
warnings.filterwarnings("ignore", message=".*full scope is deprecated.*")

TEXT_FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
VLM_FAMILIES = {"qwen2_5_vl": "qwen2.5-vl", "qwen3_vl": "qwen3-vl"}


class ModelConfigError(ValueError):
    """A checkpoint this backend cannot build; names the folder and the field."""


@dataclass
class DecoderSpec:
    """What the Megatron decoder needs from an HF config (text part of a VLM included)."""

    family: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    rope_theta: float
    qkv_bias: bool
    qk_norm: bool
    tie_embeddings: bool
    max_positions: int
    mrope_section: list[int] | None = None
    mrope_interleaved: bool = False


def read_hf_config(path: str | Path) -> dict:
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ModelConfigError(f"model folder {path} has no config.json (--hf-checkpoint must be a Hugging Face "
                               "model folder)")
    return json.loads(file.read_text())


def _rope(config: dict) -> dict:
    return config.get("rope_parameters") or config.get("rope_scaling") or {}


def decoder_spec(config: dict, where: str = "config.json") -> DecoderSpec:
    model_type = config.get("model_type")
    text = config.get("text_config", config) if model_type in VLM_FAMILIES else config
    family = VLM_FAMILIES.get(model_type) or TEXT_FAMILIES.get(model_type)
    if family is None:
        supported = sorted(TEXT_FAMILIES) + sorted(VLM_FAMILIES)
        raise ModelConfigError(f"{where}: model_type {model_type!r} is not supported; supported: {supported}")
    heads = text["num_attention_heads"]
    rope = _rope(text)
    tie = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    return DecoderSpec(
        family=family, vocab_size=text["vocab_size"], hidden_size=text["hidden_size"],
        ffn_hidden_size=text["intermediate_size"], num_layers=text["num_hidden_layers"], num_heads=heads,
        num_kv_heads=text.get("num_key_value_heads", heads),
        head_dim=text.get("head_dim") or text["hidden_size"] // heads,
        rms_eps=text.get("rms_norm_eps", 1e-6), rope_theta=rope.get("rope_theta", text.get("rope_theta", 10000.0)),
        qkv_bias=model_type in ("qwen2", "qwen2_5_vl") or bool(text.get("attention_bias", False)),
        qk_norm=model_type in ("qwen3", "qwen3_vl"), tie_embeddings=bool(tie),
        max_positions=text.get("max_position_embeddings", 4096),
        mrope_section=rope.get("mrope_section"), mrope_interleaved=bool(rope.get("mrope_interleaved", False)),
    )


def have_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def transformer_config(spec: DecoderSpec, tp: int, dtype: torch.dtype = torch.float32):
    """Megatron TransformerConfig for the decoder; fusions off on CPU (they need CUDA kernels)."""
    from megatron.core.transformer import TransformerConfig

    if spec.num_heads % tp or spec.num_kv_heads % tp:
        raise ModelConfigError(f"--tensor-model-parallel-size {tp} must divide the {spec.num_heads} attention heads "
                               f"and {spec.num_kv_heads} key/value heads of this {spec.family} model")
    gpu = torch.cuda.is_available()
    return TransformerConfig(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_heads, num_query_groups=spec.num_kv_heads, kv_channels=spec.head_dim,
        normalization="RMSNorm", layernorm_epsilon=spec.rms_eps, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=spec.qkv_bias, qk_layernorm=spec.qk_norm,
        hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp, sequence_parallel=False,
        use_cpu_initialization=not gpu, perform_initialization=False, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True, mrope_section=list(spec.mrope_section) if spec.mrope_section else None,
    )


def padded_vocab(vocab_size: int, tp: int) -> int:
    """Vocabulary rows padded to a multiple of the TP size (padded logits are masked out)."""
    return -(-vocab_size // tp) * tp


def build_gpt(spec: DecoderSpec, tp: int, dtype: torch.dtype = torch.float32, pre_process: bool = True):
    """The Megatron decoder (``GPTModel``) for ``spec`` on this rank."""
    from megatron.core.models.gpt import GPTModel

    config = transformer_config(spec, tp, dtype)
    if have_transformer_engine():
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        layer_spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=spec.qk_norm)
    else:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        layer_spec = get_gpt_layer_local_spec(qk_layernorm=spec.qk_norm, normalization="RMSNorm")
    return GPTModel(config, layer_spec, vocab_size=padded_vocab(spec.vocab_size, tp),
                    max_sequence_length=spec.max_positions, pre_process=pre_process, post_process=True,
                    share_embeddings_and_output_weights=spec.tie_embeddings, rotary_base=int(spec.rope_theta),
                    position_embedding_type="mrope" if spec.mrope_section else "rope")
