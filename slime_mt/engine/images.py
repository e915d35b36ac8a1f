"""Decode ``image_data`` entries as SGLang accepts them: data URI, raw base64, file path, ``file://``."""

from __future__ import annotations

import base64
import binascii
import io
import os
from pathlib import Path
from typing import Any

from PIL import Image

from slime_mt.engine.protocol import ProtocolError


def load_image(item: Any, where: str = "image") -> Image.Image:
    """-> an RGB PIL image; ProtocolError naming ``where`` when it cannot be read."""
    if isinstance(item, Image.Image):
        return item.convert("RGB")
    if not isinstance(item, str) or not item:
        raise ProtocolError(f"{where}: expected a data URI, base64 string or file path")
    try:
        if item.startswith("data:"):
            _, _, payload = item.partition(",")
            raw = base64.b64decode(payload, validate=True)
        elif item.startswith("file://"):
            raw = Path(item[len("file://"):]).read_bytes()
        elif os.path.isfile(item):
            raw = Path(item).read_bytes()
        else:
            raw = base64.b64decode(item, validate=True)
        image = Image.open(io.BytesIO(raw))
        image.load()
        return image.convert("RGB")
    except (binascii.Error, ValueError, OSError) as e:
        shown = item if len(item) < 80 else item[:77] + "..."
        raise ProtocolError(f"{where}: cannot read image {shown!r}: {type(e).__name__}: {e}") from None


def encode_image(image: Image.Image | str | Path, fmt: str = "PNG") -> str:
    """PIL image or file -> ``data:image/...;base64,...`` URI for ``image_data``."""
    if isinstance(image, (str, Path)):
        if isinstance(image, str) and (image.startswith("data:") or not os.path.isfile(image)):
            return image
        image = Image.open(image)
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()
