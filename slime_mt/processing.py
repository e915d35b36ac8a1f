"""Tokenizer/processor loading, and an image-only processor for Qwen-VL models.

The stock ``Qwen2_5_VLProcessor``/``Qwen3VLProcessor`` constructors also build a video processor that
needs torchvision; ``QwenVLProcessor`` pairs the tokenizer with the PIL ``Qwen2VLImageProcessor``
and does what the stock processor does for images: each ``<|image_pad|>`` in the text becomes
``prod(image_grid_thw) / merge_size**2`` pads, images matched to pads in order.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, BatchFeature, PreTrainedTokenizerBase

from slime_mt.errors import ProcessorError

IMAGE_PAD = "<|image_pad|>"
PROCESSOR_MARKER = "slime_mt_processor.json"


def image_processor_class():
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        return Qwen2VLImageProcessorPil
    except ImportError:  # transformers 4.x: the slow processor is the PIL one
        from transformers import Qwen2VLImageProcessor

        return Qwen2VLImageProcessor


class QwenVLProcessor:
    """Tokenizer + Qwen2-VL image processor; ``__call__`` expands one image pad per image."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, image_processor: Any):
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.image_token = IMAGE_PAD
        self.image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        self.merge_size = int(image_processor.merge_size)
        self.chat_template = tokenizer.chat_template

    def num_image_tokens(self, image_grid_thw: torch.Tensor) -> list[int]:
        """Pads per image: ``prod(t, h, w) / merge_size**2`` for each row of ``image_grid_thw [N, 3]``."""
        return (image_grid_thw.prod(dim=-1) // (self.merge_size**2)).tolist()

    def __call__(
        self,
        text: str | list[str] | None = None,
        images: list | None = None,
        return_tensors: str | None = "pt",
        **kwargs: Any,
    ) -> BatchFeature:
        texts = [text] if isinstance(text, str) else list(text or [])
        images = list(images or [])
        out: dict[str, Any] = {}
        counts: list[int] = []
        if images:
            vision = self.image_processor(images=images, return_tensors="pt")
            out["pixel_values"] = vision["pixel_values"]
            out["image_grid_thw"] = vision["image_grid_thw"]
            counts = self.num_image_tokens(vision["image_grid_thw"])
        pads = sum(t.count(IMAGE_PAD) for t in texts)
        if pads != len(images):
            raise ProcessorError(f"text has {pads} {IMAGE_PAD} placeholders but {len(images)} images were given")
        expanded = []
        k = 0
        for t in texts:
            pieces = t.split(IMAGE_PAD)
            rebuilt = pieces[0]
            for piece in pieces[1:]:
                rebuilt += IMAGE_PAD * counts[k] + piece
                k += 1
            expanded.append(rebuilt)
        if texts:
            enc = self.tokenizer(expanded, return_tensors=return_tensors, padding=len(texts) > 1, **kwargs)
            out.update(enc)
            # transformers >= 5 computes M-RoPE positions from this: 1 marks image tokens, 0 text.
            ids = enc["input_ids"]
            out["mm_token_type_ids"] = (
                (ids == self.image_token_id).long()
                if isinstance(ids, torch.Tensor)
                else [[int(t == self.image_token_id) for t in row] for row in ids]
            )
        return BatchFeature(out)

    def apply_chat_template(self, messages: list[dict], **kwargs: Any) -> Any:
        kwargs.setdefault("tokenize", False)
        return self.tokenizer.apply_chat_template(messages, **kwargs)

    def decode(self, *args: Any, **kwargs: Any) -> str:
        return self.tokenizer.decode(*args, **kwargs)

    def batch_decode(self, *args: Any, **kwargs: Any) -> list[str]:
        return self.tokenizer.batch_decode(*args, **kwargs)

    def save_pretrained(self, path: str | Path) -> None:
        path = Path(path)
        self.tokenizer.save_pretrained(path)
        self.image_processor.save_pretrained(path)
        (path / PROCESSOR_MARKER).write_text(json.dumps({"class": "QwenVLProcessor"}))

    @classmethod
    def from_pretrained(cls, path: str | Path) -> QwenVLProcessor:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        config = json.loads((Path(path) / "preprocessor_config.json").read_text())
        keep = ("patch_size", "merge_size", "temporal_patch_size", "image_mean", "image_std", "size")
        image_processor = image_processor_class()(**{k: config[k] for k in keep if k in config})
        return cls(tokenizer, image_processor)


def load_tokenizer_or_processor(path: str | Path) -> PreTrainedTokenizerBase | QwenVLProcessor:
    """A VLM folder (with ``preprocessor_config.json``) gives a QwenVLProcessor, else the tokenizer."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model folder not found: {path}")
    if (path / "preprocessor_config.json").is_file():
        return QwenVLProcessor.from_pretrained(path)
    return AutoTokenizer.from_pretrained(str(path))


# where transformers finds a folder's chat template (transformers.utils.hub and tokenization_utils_base)
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "additional_chat_templates")


def has_chat_template(path: str | Path) -> bool:
    """Whether the model folder carries a chat template, read from its files without loading it."""
    path = Path(path)
    if any((path / name).exists() for name in CHAT_TEMPLATE_FILES):
        return True
    for name in ("tokenizer_config.json", "processor_config.json"):
        try:
            if json.loads((path / name).read_text()).get("chat_template"):
                return True
        except (OSError, ValueError, AttributeError):
            continue
    return False


def use_chat_template(tok_or_processor: Any, path: str | Path) -> None:
    """Render with the Jinja template in ``path`` (``--chat-template``) instead of the folder's."""
    template = Path(path).read_text()
    tokenizer_of(tok_or_processor).chat_template = template
    if hasattr(tok_or_processor, "chat_template"):
        tok_or_processor.chat_template = template


def tokenizer_of(tok_or_processor: Any) -> PreTrainedTokenizerBase:
    return getattr(tok_or_processor, "tokenizer", tok_or_processor)
