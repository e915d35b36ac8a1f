"""Qwen2.5-VL / Qwen3-VL policies: the transformers vision tower (replicated on every TP rank) under
a Megatron ``GPTModel`` decoder with multimodal rotary positions.

Image embeddings replace the image-pad token embeddings and enter the decoder through
``decoder_input``. Positions are the HF model's 3-D M-RoPE positions (``get_rope_index``).
Qwen2.5-VL uses megatron's sectioned M-RoPE; Qwen3-VL interleaves the t/h/w frequencies
(``InterleavedMRoPE``) and adds its deepstack features to the hidden states after the first decoder
layers at image positions (forward hooks), as the HF model does.
"""

from __future__ import annotations

import torch

from slime_mt.backends.megatron.convert import hf_to_megatron, load_into
from slime_mt.backends.megatron.models import DecoderSpec, build_gpt
from slime_mt.types import TrainingSample


class InterleavedMRoPE(torch.nn.Module):
    """Qwen3-VL's rotary embedding: frequency j uses the t axis, except j = 1, 4, 7, ... (< 3 * h
    section) the h axis and j = 2, 5, 8, ... (< 3 * w section) the w axis."""

    def __init__(self, head_dim: int, base: float, mrope_section: list[int]):
        super().__init__()
        self.inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.mrope_section = list(mrope_section)

    def forward(self, position_ids: torch.Tensor, mrope_section=None, cp_group=None) -> torch.Tensor:
        """``position_ids [3, B, S]`` -> rotary angles ``[S, B, 1, head_dim]`` as megatron expects."""
        freqs = position_ids.float()[..., None] * self.inv_freq  # [3, B, S, D/2]
        out = freqs[0].clone()
        for axis, offset in ((1, 1), (2, 2)):
            idx = slice(offset, self.mrope_section[axis] * 3, 3)
            out[..., idx] = freqs[axis, ..., idx]
        emb = torch.cat((out, out), dim=-1)  # [B, S, D]
        return emb[..., None, :].transpose(0, 1).contiguous()


class VLMPolicy(torch.nn.Module):
    def __init__(self, hf_model, gpt, spec: DecoderSpec, image_token_id: int, vision_prefix: str):
        super().__init__()
        self.visual = hf_model.model.visual
        self.gpt = gpt
        self.spec = spec
        self.image_token_id = image_token_id
        self.vision_prefix = vision_prefix
        self._rope_index = hf_model.model.get_rope_index  # the HF model keeps only this role
        self._deepstack: tuple[torch.Tensor, list[torch.Tensor]] | None = None
        if spec.mrope_interleaved:
            gpt.rotary_pos_emb = InterleavedMRoPE(spec.head_dim, spec.rope_theta, spec.mrope_section)
            for k, layer in enumerate(gpt.decoder.layers):
                layer.register_forward_hook(self._deepstack_hook(k))

    @property
    def config(self):
        return self.gpt.config

    def _deepstack_hook(self, k: int):
        def hook(module, args, output):
            if self._deepstack is None or k >= len(self._deepstack[1]):
                return output
            mask, features = self._deepstack
            hidden = output[0] if isinstance(output, tuple) else output  # [S, B, H]
            hidden = hidden.clone()
            hidden[mask] = hidden[mask] + features[k].to(hidden.dtype)
            return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

        return hook

    def mrope_positions(self, sample: TrainingSample) -> torch.Tensor:
        """3-D positions ``[3, len]`` of a sequence, computed like the HF model does."""
        ids = torch.tensor([sample.prompt_ids + sample.response_ids])
        grid = (sample.multimodal_train_inputs or {}).get("image_grid_thw")
        if grid is None:
            return torch.arange(ids.shape[1]).expand(3, -1)
        positions, _ = self._rope_index(ids, (ids == self.image_token_id).long(), image_grid_thw=grid,
                                        attention_mask=torch.ones_like(ids))
        return positions[:, 0]

    def forward(self, tokens, position_ids, attention_mask, pixel_values=None, image_grid_thw=None):
        embeds = self.gpt.embedding(input_ids=tokens, position_ids=None)  # [S, B, H]
        self._deepstack = None
        if pixel_values is not None:
            out = self.visual(pixel_values.to(next(self.visual.parameters()).dtype), grid_thw=image_grid_thw)
            image_embeds = out.pooler_output  # [N_pads, H]
            mask = (tokens == self.image_token_id).transpose(0, 1)  # [S, B]
            if int(mask.sum()) != image_embeds.shape[0]:
                raise ValueError(f"{int(mask.sum())} image pad tokens but {image_embeds.shape[0]} image embeddings")
            embeds = embeds.clone()
            embeds[mask] = image_embeds.to(embeds.dtype)
            features = getattr(out, "deepstack_features", None)
            if features:
                self._deepstack = (mask, list(features))
        try:
            return self.gpt(tokens, position_ids, attention_mask, decoder_input=embeds)
        finally:
            self._deepstack = None

    def decoder_state_dict(self) -> dict[str, torch.Tensor]:
        return self.gpt.state_dict()

    def vision_state_dict(self) -> dict[str, torch.Tensor]:
        return {self.vision_prefix + k: v.detach().clone() for k, v in self.visual.state_dict().items()}


def build_vlm(hf_config: dict, spec: DecoderSpec, hf_state: dict, tp: int, rank: int,
              freeze_vision: bool = True) -> VLMPolicy:
    """The VLM policy on this rank: HF vision tower (loaded from the checkpoint) + Megatron decoder."""
    import transformers

    config = transformers.AutoConfig.for_model(**hf_config)
    hf_model = transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    vision_prefix = "model.visual." if any(k.startswith("model.visual.") for k in hf_state) else "visual."
    vision_state = {k[len(vision_prefix):]: v for k, v in hf_state.items() if k.startswith(vision_prefix)}
    missing, unexpected = hf_model.model.visual.load_state_dict(vision_state, strict=False)
    if missing or unexpected:
        raise KeyError(f"vision tower weights: missing {missing[:5]}, unexpected {unexpected[:5]}")
    hf_model.lm_head = None  # only the vision tower and the rope index are kept
    hf_model.model.language_model = torch.nn.Module()
    gpt = build_gpt(spec, tp)
    load_into(gpt, hf_to_megatron(hf_state, spec, rank, tp))
    policy = VLMPolicy(hf_model, gpt, spec, int(hf_config["image_token_id"]), vision_prefix)
    if freeze_vision:
        for p in policy.visual.parameters():
            p.requires_grad_(False)
    return policy
