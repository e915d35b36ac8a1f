"""Per-trajectory multimodal state: processor tensors per turn and the images the engine must see.

Tensors (``pixel_values [P_k, D]``, ``image_grid_thw [N_k, 3]``, ...) are appended per turn to a list
and concatenated ONCE per key at ``finalize()`` (one allocation and one copy per key, however many
turns). The images sent to the engine accumulate across turns, so every request carries every image
of its context (later turns see earlier images: slime #1847, verl #2643).
"""

from __future__ import annotations

from typing import Any

import torch

from slime_mt.engine.images import encode_image


class MultimodalBuffer:
    def __init__(self):
        self._tensors: dict[str, list[torch.Tensor]] = {}
        self._images: list[Any] = []
        self._encoded: list[str] = []

    def append(self, tensors: dict[str, torch.Tensor], images: list[Any] = ()) -> None:
        """Record one turn's processor tensors and the images they came from (in context order)."""
        for key, value in tensors.items():
            self._tensors.setdefault(key, []).append(value)
        for image in images:
            self._images.append(image)
            self._encoded.append(encode_image(image))

    @property
    def image_data(self) -> list[str]:
        """Every image of the context so far, encoded once, for the engine's ``image_data``."""
        return list(self._encoded)

    @property
    def num_images(self) -> int:
        return len(self._images)

    @property
    def images(self) -> list[Any]:
        return list(self._images)

    @property
    def image_grid_thw(self) -> torch.Tensor | None:
        """``[N, 3]`` grids of every image so far (one small concatenation; pixels untouched)."""
        parts = self._tensors.get("image_grid_thw")
        return torch.cat(parts) if parts else None

    def finalize(self) -> dict[str, torch.Tensor] | None:
        """One ``torch.cat`` per key over all turns -> ``multimodal_train_inputs`` (None if no images)."""
        if not self._tensors:
            return None
        return {key: parts[0] if len(parts) == 1 else torch.cat(parts, dim=0) for key, parts in self._tensors.items()}
