"""slime.utils.processing_utils: tokenizer and processor loading, processor kwargs, images for the
engine."""

from __future__ import annotations

from slime_mt.engine.images import encode_image
from slime_mt.processing import QwenVLProcessor, load_tokenizer_or_processor, tokenizer_of


class HFStyleProcessor:
    """A ``QwenVLProcessor`` called as slime calls a Hugging Face processor: ``return_tensors`` None
    by default (ids as lists), slime's per-modality kwargs accepted."""

    def __init__(self, processor: QwenVLProcessor):
        self.processor = processor

    def __call__(self, text=None, images=None, videos=None, return_tensors=None, **kwargs):
        if videos:
            raise NotImplementedError("slime_mt.compat: video inputs are not supported")
        for key in ("text_kwargs", "images_kwargs", "videos_kwargs", "audio_kwargs", "return_mm_token_type_ids"):
            kwargs.pop(key, None)
        out = self.processor(text=text, images=images, return_tensors=return_tensors, **kwargs)
        out.pop("mm_token_type_ids", None)  # not asked for (slime passes return_mm_token_type_ids=False)
        return out

    def __getattr__(self, name):
        return getattr(self.processor, name)


def load_tokenizer(name_or_path: str, **kwargs):
    return tokenizer_of(load_tokenizer_or_processor(name_or_path))


def hf_style(tokenizer_or_processor) -> HFStyleProcessor | None:
    """A model's processor as slime holds it: None for a text-only model."""
    if isinstance(tokenizer_or_processor, QwenVLProcessor):
        return HFStyleProcessor(tokenizer_or_processor)
    return None


def load_processor(name_or_path: str, **kwargs):
    return hf_style(load_tokenizer_or_processor(name_or_path))


def build_processor_kwargs(multimodal_inputs: dict | None = None) -> dict:
    """A sample's ``multimodal_inputs`` as processor keyword arguments (modalities that are None left out)."""
    return {k: v for k, v in (multimodal_inputs or {}).items() if v is not None}


def encode_image_for_rollout_engine(image) -> str:
    """An image as the PNG data URI the engine's ``image_data`` takes."""
    return encode_image(image)
