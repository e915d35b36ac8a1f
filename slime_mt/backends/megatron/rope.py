"""Rotary position embeddings from the Hugging Face config, with explicit per-token positions.

``rope_frequencies(text_config)`` gives the inverse frequencies and the attention factor of every
``rope_type`` transformers defines for the supported families, computed by transformers' own
``ROPE_INIT_FUNCTIONS`` so the trainer and the engine use the same numbers:

- ``default`` (also the legacy ``mrope``), ``linear``, ``llama3``, ``yarn``: supported. YaRN's
  attention factor scales cos and sin of q and k, i.e. the attention logits by factor**2; the
  decoder applies it as its softmax scale (``models.transformer_config``).
- ``dynamic`` (NTK): refused. transformers recomputes the frequencies from the longest sequence the
  module has seen so far, so an engine's log-probs depend on its request history and cannot match a
  training forward.
- ``longrope``: refused. It switches frequencies when a sequence crosses the original context,
  which changes the rotation of tokens already in the KV cache.
- anything else: refused, naming the config key.

``PositionRotary`` turns explicit positions into Megatron's rotary tensor ``[S, B, 1, head_dim]``:
``[B, S]`` positions for text models (each packed sequence restarts at 0, as in the engine),
``[3, B, S]`` for M-RoPE (Qwen2.5-VL's contiguous t/h/w sections, or Qwen3-VL's interleaved ones).
Megatron hands ``position_ids`` to the rotary module only for ``position_embedding_type='mrope'``,
so every decoder is built with that type and this module installed (``models.build_gpt``).
"""

from __future__ import annotations

import torch

from slime_mt.errors import RopeConfigError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
REFUSED_ROPE_TYPES = {
    "dynamic": "dynamic NTK scaling recomputes the frequencies from the longest sequence the engine has "
    "seen, so rollout and training log-probs cannot agree",
    "longrope": "LongRoPE switches frequencies when a sequence crosses the original context length, "
    "which changes tokens already in the KV cache",
}


def rope_parameters(text_config: dict) -> dict:
    """The rope dict of an HF text config (``rope_parameters``, or the older ``rope_scaling``)."""
    return dict(text_config.get("rope_parameters") or text_config.get("rope_scaling") or {})


def rope_type(text_config: dict, where: str = "config.json") -> str:
    params = rope_parameters(text_config)
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind == "mrope":  # Qwen2-VL's legacy spelling of default rope with M-RoPE sections
        kind = "default"
    key = "rope_parameters" if "rope_parameters" in text_config else "rope_scaling"
    if kind in REFUSED_ROPE_TYPES:
        raise RopeConfigError(f"{where}: {key}.rope_type={kind!r} is not supported: {REFUSED_ROPE_TYPES[kind]}")
    if kind not in SUPPORTED_ROPE_TYPES:
        raise RopeConfigError(
            f"{where}: {key}.rope_type={kind!r} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}"
        )
    if float(params.get("partial_rotary_factor", text_config.get("partial_rotary_factor", 1.0))) != 1.0:
        raise RopeConfigError(f"{where}: partial_rotary_factor != 1 is not supported")
    return kind


def rope_frequencies(text_config: dict, model_type: str, where: str = "config.json") -> tuple[torch.Tensor, float]:
    """-> (inverse frequencies ``[head_dim / 2]`` float32, attention factor) exactly as transformers
    computes them for this config."""
    kind = rope_type(text_config, where)
    head_dim = text_config.get("head_dim") or text_config["hidden_size"] // text_config["num_attention_heads"]
    theta = float(rope_parameters(text_config).get("rope_theta", text_config.get("rope_theta", 10000.0)))
    if kind == "default":
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / head_dim
        return 1.0 / (theta**exponent), 1.0
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    fields = {k: v for k, v in text_config.items() if k != "model_type"}
    config = AutoConfig.for_model(text_config.get("model_type", model_type), **fields)
    inv_freq, factor = ROPE_INIT_FUNCTIONS[kind](config, torch.device("cpu"))
    return inv_freq.to(torch.float32), float(factor)


class PositionRotary(torch.nn.Module):
    """Rotary angles from explicit positions. ``mrope_section`` None: text positions ``[B, S]``;
    else M-RoPE positions ``[3, B, S]``, frequencies split into t/h/w sections (``interleaved``:
    Qwen3-VL's layout, frequency j uses h for j = 1, 4, 7, ... < 3 * h_section and w for
    j = 2, 5, 8, ... < 3 * w_section, t otherwise)."""

    def __init__(
        self,
        inv_freq: torch.Tensor,
        mrope_section: list[int] | None = None,
        interleaved: bool = False,
        device: torch.device | None = None,
    ):
        super().__init__()
        self.register_buffer("inv_freq", inv_freq.to(device=device, dtype=torch.float32), persistent=False)
        self.mrope_section = list(mrope_section) if mrope_section else None
        self.interleaved = interleaved

    def forward(self, position_ids: torch.Tensor, mrope_section=None, cp_group=None) -> torch.Tensor:
        """-> ``[S, B, 1, head_dim]`` angles (megatron's rotary layout)."""
        freqs = position_ids.to(self.inv_freq.device, torch.float32)[..., None] * self.inv_freq  # [(3,) B, S, D/2]
        if self.mrope_section is None:
            angles = freqs
        elif self.interleaved:
            angles = freqs[0].clone()
            for axis in (1, 2):
                index = slice(axis, self.mrope_section[axis] * 3, 3)
                angles[..., index] = freqs[axis, ..., index]
        else:
            chunks = freqs.split(self.mrope_section, dim=-1)
            angles = torch.cat([chunk[axis % 3] for axis, chunk in enumerate(chunks)], dim=-1)
        emb = torch.cat((angles, angles), dim=-1)  # [B, S, D]
        return emb[..., None, :].transpose(0, 1).contiguous()
