"""Qwen2.5-VL / Qwen3-VL / Qwen3-VL-MoE policies: the transformers vision tower (replicated on every TP rank) under
a Megatron decoder with multimodal rotary positions.

Only the vision tower is built from transformers (not the whole VLM): its weights are read from the
checkpoint, on the trainer's device. Image embeddings replace the image-pad token embeddings and
enter the decoder as its input. Positions are transformers' own 3-D M-RoPE positions
(``get_rope_index``, called on a config-only stand-in so the language model is never built).
Qwen2.5-VL uses contiguous t/h/w frequency sections; Qwen3-VL interleaves them (``rope.py``) and adds
its deepstack features to the hidden states after the first decoder layers at image positions
(forward hooks), as the HF model does.

Under pipeline parallelism the vision tower and the embedding are on the first stage, which hands the
merged hidden states on; later stages have no vision tower. Deepstack features enter the first
``deepstack_layers`` decoder layers, which must all be on the first stage (``check_deepstack_stage``).
"""

from __future__ import annotations

import types

import torch

from slime_mt.backends.megatron.context_parallel import ContextParallelSegments
from slime_mt.backends.megatron.convert import ExpertLayout, iter_hf_to_megatron, load_into
from slime_mt.backends.megatron.families import DecoderSpec, MoeOptions, Recompute, TextPolicy, build_gpt, stage_of
from slime_mt.backends.megatron.parallel import PipelineSplit
from slime_mt.backends.megatron.sequence_parallel import sequence_slice
from slime_mt.errors import ModelConfigError
from slime_mt.safetensors_files import CheckpointReader
from slime_mt.types import TrainingSample


def _classes(model_type: str):
    """(the HF VLM model class that owns get_rope_index, the vision tower class)."""
    if model_type == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as m

        return m.Qwen2_5_VLModel, m.Qwen2_5_VisionTransformerPretrainedModel
    if model_type == "qwen3_vl_moe":
        from transformers.models.qwen3_vl_moe import modeling_qwen3_vl_moe as m

        return m.Qwen3VLMoeModel, m.Qwen3VLMoeVisionModel
    from transformers.models.qwen3_vl import modeling_qwen3_vl as m

    return m.Qwen3VLModel, m.Qwen3VLVisionModel


def rope_index_function(hf_config, model_type: str):
    """transformers' ``get_rope_index`` bound to an object holding only the config."""
    model_cls, _ = _classes(model_type)
    stand_in = types.SimpleNamespace(config=hf_config)
    stand_in.get_vision_position_ids = types.MethodType(model_cls.get_vision_position_ids, stand_in)
    return types.MethodType(model_cls.get_rope_index, stand_in)


def deepstack_layers(hf_config: dict) -> int:
    """Decoder layers the vision tower's deepstack features enter (Qwen3-VL: one per
    ``deepstack_visual_indexes``, the first layers); 0 without deepstack."""
    return len((hf_config.get("vision_config") or {}).get("deepstack_visual_indexes") or [])


def check_deepstack_stage(hf_config: dict, num_layers: int, split: PipelineSplit) -> str | None:
    """Why ``split`` cannot run the model (its deepstack layers beyond the first stage), or None."""
    needed = deepstack_layers(hf_config)
    if split.size == 1 or not needed:
        return None
    held = split.layer_counts(num_layers)[0]
    if held >= needed:
        return None
    return (
        f"the vision tower's deepstack features enter the first {needed} decoder layers, which must be on the "
        f"first pipeline stage: it holds {held}; give it more (--decoder-first-pipeline-num-layers {needed})"
    )


class VLMPolicy(TextPolicy):
    """A vision tower (None on pipeline stages after the first) under the Megatron decoder."""

    def __init__(self, visual, gpt, spec: DecoderSpec, image_token_id: int, vision_prefix: str, rope_index):
        super().__init__(gpt, spec.pad_token_id)
        self.visual = visual
        self.spec = spec
        self.image_token_id = image_token_id
        self.vision_prefix = vision_prefix
        self._rope_index = rope_index
        self._deepstack: tuple[torch.Tensor, list[torch.Tensor]] | None = None
        if spec.mrope_interleaved:
            for k, layer in enumerate(gpt.decoder.layers):
                layer.register_forward_hook(self._deepstack_hook(k))

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
        """3-D positions ``[3, len]`` of a sequence, computed like the HF model does (on the CPU)."""
        ids = torch.tensor([sample.prompt_ids + sample.response_ids], device="cpu")
        grid = (sample.multimodal_train_inputs or {}).get("image_grid_thw")
        if grid is None:
            return torch.arange(ids.shape[1], device="cpu").expand(3, -1)
        positions, _ = self._rope_index(
            ids, (ids == self.image_token_id).long(), image_grid_thw=grid, attention_mask=torch.ones_like(ids)
        )
        return positions[:, 0]

    def hidden(
        self,
        tokens,
        position_ids,
        attention_mask,
        packed_seq_params=None,
        decoder_input=None,
        pixel_values=None,
        image_grid_thw=None,
        image_order=None,
    ):
        """``image_order`` (prefix-tree rows): the images are the row's distinct ones, each run once
        through the vision tower; pad run r of the row takes image ``image_order[r]``'s embeddings. A
        pipeline stage after the first runs its layers on the previous stage's output."""
        if not self.gpt.pre_process:
            return super().hidden(tokens, position_ids, attention_mask, packed_seq_params)
        embeds = self.embed(tokens)  # [S, B, H]
        self._deepstack = None
        if pixel_values is not None:
            out = self.visual(pixel_values.to(next(self.visual.parameters()).dtype), grid_thw=image_grid_thw)
            image_embeds = out.pooler_output  # [N_pads, H]
            features = getattr(out, "deepstack_features", None)
            if image_order is not None:
                patches = image_grid_thw.prod(-1)
                sizes = (patches * image_embeds.shape[0] // patches.sum()).tolist()  # pad tokens per image

                def in_row_order(t: torch.Tensor) -> torch.Tensor:
                    per_image = t.split(sizes)
                    return torch.cat([per_image[j] for j in image_order])

                image_embeds = in_row_order(image_embeds)
                features = [in_row_order(f) for f in features] if features else features
            mask = (tokens == self.image_token_id).transpose(0, 1)  # [S, B]
            if int(mask.sum()) != image_embeds.shape[0]:
                raise ValueError(f"{int(mask.sum())} image pad tokens but {image_embeds.shape[0]} image embeddings")
            embeds = embeds.clone()
            embeds[mask] = image_embeds.to(embeds.dtype)
            if features and isinstance(attention_mask, ContextParallelSegments):  # this rank's pads only
                mine = attention_mask.query_position
                pad_number = mask[:, 0].long().cumsum(0) - 1
                local = mask.index_select(0, mine)
                features = [f[pad_number[mine][local[:, 0]]] for f in features]
                mask = local
            if features and self.config.sequence_parallel:  # the layers' outputs are this TP rank's slice
                start, count = sequence_slice(mask.shape[0])
                before, held = int(mask[:start].sum()), int(mask[start : start + count].sum())
                features = [f[before : before + held] for f in features]
                mask = mask[start : start + count]
            if features:
                self._deepstack = (mask, list(features))
        try:
            return super().hidden(tokens, position_ids, attention_mask, packed_seq_params, decoder_input=embeds)
        finally:
            self._deepstack = None

    def forward(
        self, tokens, position_ids, attention_mask, packed_seq_params=None, pixel_values=None, image_grid_thw=None
    ):
        hidden = self.hidden(
            tokens,
            position_ids,
            attention_mask,
            packed_seq_params,
            pixel_values=pixel_values,
            image_grid_thw=image_grid_thw,
        )
        return self.output_logits(hidden[:, 0])[None]

    def vision_state_dict(self) -> dict[str, torch.Tensor]:
        """HF-named vision tower tensors (replicated: every rank of the first pipeline stage holds them;
        {} on later stages)."""
        if self.visual is None:
            return {}
        return {self.vision_prefix + k: v.detach() for k, v in self.visual.state_dict().items()}


def checkpoint_vision_prefix(names) -> str:
    """Where a VLM checkpoint keeps its vision tower's tensors: ``model.visual.`` (transformers 4.5x) or
    ``visual.``."""
    return "model.visual." if any(k.startswith("model.visual.") for k in names) else "visual."


def build_vlm(
    hf_config: dict,
    spec: DecoderSpec,
    reader: CheckpointReader,
    tp: int,
    rank: int,
    dtype: torch.dtype,
    device: torch.device,
    te: bool,
    freeze_vision: bool = True,
    attention: str = "fused",
    moe: MoeOptions | None = None,
    experts: ExpertLayout | None = None,
    recompute: Recompute | None = None,
    sequence_parallel: bool = False,
    pp: PipelineSplit | None = None,
) -> VLMPolicy:
    """The VLM policy on this rank: the HF vision tower alone (weights from the checkpoint; on the first
    pipeline stage only) + this rank's Megatron decoder (its stage's layers, ``pp``)."""
    import transformers
    from megatron.core import parallel_state

    pp = pp or PipelineSplit()
    reason = check_deepstack_stage(hf_config, spec.num_layers, pp)
    if reason:
        raise ModelConfigError(f"--pipeline-model-parallel-size {pp.size}: {reason}")
    config = transformers.AutoConfig.for_model(**hf_config)
    _, vision_cls = _classes(hf_config["model_type"])
    names = reader.names()
    vision_prefix = checkpoint_vision_prefix(names)
    visual = None
    if pp.size == 1 or parallel_state.is_pipeline_first_stage(ignore_virtual=True):
        with torch.device(device):
            visual = vision_cls._from_config(config.vision_config, dtype=dtype)
        vision_state = {k[len(vision_prefix) :]: reader.get(k) for k in names if k.startswith(vision_prefix)}
        missing, unexpected = visual.load_state_dict(vision_state, strict=False)
        if missing or unexpected:
            raise KeyError(f"vision tower weights: missing {missing[:5]}, unexpected {unexpected[:5]}")
        visual.to(device=device)
    gpt = build_gpt(spec, tp, dtype, device, te, attention, moe, recompute, sequence_parallel, pp)
    load_into(gpt, iter_hf_to_megatron(reader, spec, rank, tp, te, experts, stage_of(gpt)))
    policy = VLMPolicy(
        visual,
        gpt,
        spec,
        int(hf_config["image_token_id"]),
        vision_prefix,
        rope_index_function(config, hf_config["model_type"]),
    )
    if freeze_vision and visual is not None:
        for p in policy.visual.parameters():
            p.requires_grad_(False)
    return policy
