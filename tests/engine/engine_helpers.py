"""Helpers for engine tests: run a coroutine, draw distinct images, encode them as data URIs."""

import asyncio
import base64
import io

from PIL import Image, ImageDraw


def run(coro):
    return asyncio.run(coro)


def diagram(seed: int, size=(96, 80)) -> Image.Image:
    """A small distinct image per seed (a triangle on a coloured background)."""
    image = Image.new("RGB", size, ((37 * seed) % 256, (91 * seed) % 256, (53 * seed) % 256))
    draw = ImageDraw.Draw(image)
    draw.polygon([(5, size[1] - 5), (size[0] - 5, size[1] - 5), (size[0] // 2, 5 + seed % 20)], outline=(255, 255, 255))
    return image


def data_uri(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
