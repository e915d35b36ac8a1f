"""Decode ``image_data`` entries as SGLang accepts them: data URI, raw base64, file path, ``file://``.

Client images are untrusted: files must be regular files no larger than ``MAX_IMAGE_FILE_BYTES``
(a device, a FIFO or a folder is refused without blocking), an image may hold at most
``MAX_IMAGE_PIXELS`` pixels (checked from the header, before decoding, so a decompression bomb costs
nothing), and any failure to decode is a ``ProtocolError`` naming the entry. The server calls
``load_image`` off its event loop.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import stat
from pathlib import Path
from typing import Any

from PIL import Image

from slime_mt.engine.protocol import show
from slime_mt.errors import ProtocolError

MAX_IMAGE_FILE_BYTES = 64 * 1024 * 1024
MAX_IMAGE_PIXELS = 32 * 1024 * 1024  # e.g. 5792 x 5792; the Qwen-VL processors resize far below this


def load_image(
    item: Any, where: str = "image", max_pixels: int = MAX_IMAGE_PIXELS, max_file_bytes: int = MAX_IMAGE_FILE_BYTES
) -> Image.Image:
    """-> an RGB PIL image; ProtocolError naming ``where`` when it cannot (or may not) be read."""
    if isinstance(item, Image.Image):
        return item.convert("RGB")
    if not isinstance(item, str) or not item:
        raise ProtocolError(f"{where}: expected a data URI, base64 string or file path")
    raw = _image_bytes(item, where, max_file_bytes)
    try:
        image = Image.open(io.BytesIO(raw))
        width, height = image.size
        if width * height > max_pixels:
            raise ProtocolError(
                f"{where}: image of {width}x{height} = {width * height} pixels is larger than "
                f"the {max_pixels} pixels allowed"
            )
        image.load()
        return image.convert("RGB")
    except ProtocolError:
        raise
    except Exception as e:  # PIL raises ValueError, OSError, SyntaxError, DecompressionBombError, ...
        raise ProtocolError(f"{where}: cannot read image {show(item)}: {type(e).__name__}: {e}") from None


def _image_bytes(item: str, where: str, max_file_bytes: int) -> bytes:
    try:
        if item.startswith("data:"):
            _, _, payload = item.partition(",")
            return base64.b64decode(payload, validate=True)
        path = item[len("file://") :] if item.startswith("file://") else item
        if item.startswith("file://") or _exists(path):
            return _read_image_file(path, max_file_bytes)
        return base64.b64decode(item, validate=True)
    except ProtocolError as e:
        raise ProtocolError(f"{where}: {e}") from None
    except (binascii.Error, ValueError, OSError) as e:
        raise ProtocolError(f"{where}: cannot read image {show(item)}: {type(e).__name__}: {e}") from None


def _exists(path: str) -> bool:
    try:
        return os.path.lexists(path)
    except (OSError, ValueError):  # a name too long, a NUL byte: base64 payloads, not paths
        return False


def _read_image_file(path: str, limit: int) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes. Opened non-blocking, so a FIFO with no
    writer cannot stall the caller; devices, folders and sockets are refused."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ProtocolError(f"{path!r} is not a regular file")
        if info.st_size > limit:
            raise ProtocolError(f"{path!r} is {info.st_size} bytes, larger than the {limit} bytes allowed")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:  # the file grew after fstat
        raise ProtocolError(f"{path!r} is larger than the {limit} bytes allowed")
    return data


def encode_image(image: Image.Image | str | Path, fmt: str = "PNG") -> str:
    """PIL image or file -> ``data:image/...;base64,...`` URI for ``image_data``."""
    if isinstance(image, (str, Path)):
        if isinstance(image, str) and (image.startswith("data:") or not os.path.isfile(image)):
            return image
        image = Image.open(image)
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()
