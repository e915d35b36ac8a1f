"""``qwen_vl_utils`` for slime's examples under ``--slime-compat`` where the published package cannot load.

slime's geo3k VLM rollout calls ``from qwen_vl_utils import process_vision_info`` on every observation it
encodes. The published package (0.0.14) imports torchvision at import time without declaring it, and
torchvision does not load beside a CPU build of torch; ``slime_mt.compat.install`` maps the name here only
when the package or torchvision is not installed (with both, the published package is used). This module
behaves as the published one does for what slime's examples use: the vision entries of chat messages
(``{"type": "image", "image": ...}``, ``image_url``, ``video``), each image opened (a PIL image, a path,
``file://``, ``data:image/...;base64,``, an http(s) URL), made RGB (RGBA on white) and resized to
multiples of ``image_patch_size`` x 2 within its pixel bounds; a video given as a list of frames becomes
a float tensor ``[T, C, H, W]``; a video file needs the published package's decoders and is refused by
name."""

from __future__ import annotations

import base64
import io
import math
from typing import Any

import httpx
import numpy as np
import torch
from PIL import Image

MAX_RATIO = 200
SPATIAL_MERGE_SIZE = 2
IMAGE_MIN_TOKEN_NUM = 4
IMAGE_MAX_TOKEN_NUM = 16384
VIDEO_MIN_TOKEN_NUM = 128
VIDEO_MAX_TOKEN_NUM = 768
FRAME_FACTOR = 2
MODEL_SEQ_LEN = 128000


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int | None = None, max_pixels: int | None = None
) -> tuple[int, int]:
    """(height, width) both multiples of ``factor``, the pixels within [min_pixels, max_pixels], the
    aspect ratio kept as closely as may be."""
    max_pixels = IMAGE_MAX_TOKEN_NUM * factor**2 if max_pixels is None else max_pixels
    min_pixels = IMAGE_MIN_TOKEN_NUM * factor**2 if min_pixels is None else min_pixels
    if max_pixels < min_pixels:
        raise ValueError("The max_pixels of image must be greater than or equal to min_pixels.")
    if max(height, width) / min(height, width) > MAX_RATIO:
        raise ValueError(
            f"absolute aspect ratio must be smaller than {MAX_RATIO}, got {max(height, width) / min(height, width)}"
        )
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        scale = math.sqrt(height * width / max_pixels)
        h, w = math.floor(height / scale / factor) * factor, math.floor(width / scale / factor) * factor
    elif h * w < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * scale / factor) * factor, math.ceil(width * scale / factor) * factor
    return h, w


def _open(source: Any) -> Image.Image:
    if isinstance(source, Image.Image):
        return source
    if not isinstance(source, str):
        raise ValueError(f"Unrecognized image input, support local path, http url, base64 and PIL.Image, got {source}")
    if source.startswith(("http://", "https://")):
        response = httpx.get(source, follow_redirects=True, timeout=60)
        response.raise_for_status()
        return Image.open(io.BytesIO(response.content))
    if source.startswith("file://"):
        return Image.open(source[len("file://") :])
    if source.startswith("data:image"):
        if "base64," not in source:
            raise ValueError(
                f"Unrecognized image input, support local path, http url, base64 and PIL.Image, got {source}"
            )
        return Image.open(io.BytesIO(base64.b64decode(source.split("base64,", 1)[1])))
    return Image.open(source)


def _rgb(image: Image.Image) -> Image.Image:
    if image.mode == "RGBA":
        white = Image.new("RGB", image.size, (255, 255, 255))
        white.paste(image, mask=image.split()[3])
        return white
    return image.convert("RGB")


def fetch_image(ele: dict[str, Any], image_patch_size: int = 14) -> Image.Image:
    """The entry's image (``image`` or ``image_url``), RGB, resized as the model's processor expects."""
    image = _rgb(_open(ele["image"] if "image" in ele else ele["image_url"]))
    factor = image_patch_size * SPATIAL_MERGE_SIZE
    if "resized_height" in ele and "resized_width" in ele:
        height, width = smart_resize(ele["resized_height"], ele["resized_width"], factor=factor)
    else:
        height, width = smart_resize(
            image.height,
            image.width,
            factor=factor,
            min_pixels=ele.get("min_pixels", IMAGE_MIN_TOKEN_NUM * factor**2),
            max_pixels=ele.get("max_pixels", IMAGE_MAX_TOKEN_NUM * factor**2),
        )
    return image.resize((width, height))


def fetch_video(
    ele: dict[str, Any],
    image_patch_size: int = 14,
    return_video_sample_fps: bool = False,
    return_video_metadata: bool = False,
):
    """A video given as a list of frames -> ``[T, C, H, W]`` float frames (T padded to even with the
    last frame), resized within the video's pixel bounds."""
    if isinstance(ele["video"], str):
        raise NotImplementedError(
            f"qwen_vl_utils (slime_mt's stand-in): reading the video file {ele['video']!r} needs the published "
            "qwen_vl_utils and torchvision (pip install qwen-vl-utils torchvision); a list of frames works here"
        )
    factor = image_patch_size * SPATIAL_MERGE_SIZE
    settings = {k: v for k, v in ele.items() if k not in ("type", "video")}
    frames = [fetch_image({"image": frame, **settings}, factor) for frame in ele["video"]]
    even = math.ceil(len(frames) / FRAME_FACTOR) * FRAME_FACTOR
    frames += [frames[-1]] * (even - len(frames))
    sample_fps = ele.get("sample_fps", 2.0)
    video = torch.stack([torch.from_numpy(np.array(frame)).permute(2, 0, 1) for frame in frames])
    raw_fps = settings.get("raw_fps", sample_fps)
    metadata = {
        "fps": raw_fps,
        "frames_indices": list(range(len(video))),
        "total_num_frames": even / sample_fps * raw_fps,
    }
    count, _, height, width = video.shape
    min_pixels = ele.get("min_pixels", VIDEO_MIN_TOKEN_NUM * factor**2)
    total_pixels = ele.get("total_pixels", MODEL_SEQ_LEN * factor**2 * 0.9)
    max_pixels = max(min(VIDEO_MAX_TOKEN_NUM * factor**2, total_pixels / count * FRAME_FACTOR), int(min_pixels * 1.05))
    max_pixels = min(ele.get("max_pixels", max_pixels), max_pixels)
    if "resized_height" in ele and "resized_width" in ele:
        height, width = smart_resize(ele["resized_height"], ele["resized_width"], factor=factor)
    else:
        height, width = smart_resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
    video = torch.nn.functional.interpolate(
        video.float(), size=(height, width), mode="bicubic", antialias=True, align_corners=False
    )
    out = (video, metadata) if return_video_metadata else video
    return (out, sample_fps) if return_video_sample_fps else out


def extract_vision_info(conversations: list) -> list[dict[str, Any]]:
    """Every vision entry of one conversation's or several conversations' message contents, in order."""
    if isinstance(conversations[0], dict):
        conversations = [conversations]
    kinds = ("image", "image_url", "video")
    return [
        ele
        for conversation in conversations
        for message in conversation
        if isinstance(message["content"], list)
        for ele in message["content"]
        if any(k in ele for k in kinds) or ele.get("type", "text") in kinds
    ]


def process_vision_info(
    conversations: list,
    return_video_kwargs: bool = False,
    return_video_metadata: bool = False,
    image_patch_size: int = 14,
):
    """(the images or None, the videos or None[, the processor's video kwargs]) of the conversations."""
    images, videos, fps = [], [], []
    for ele in extract_vision_info(conversations):
        if "image" in ele or "image_url" in ele:
            images.append(fetch_image(ele, image_patch_size=image_patch_size))
        elif "video" in ele:
            video, sample_fps = fetch_video(
                ele,
                image_patch_size=image_patch_size,
                return_video_sample_fps=True,
                return_video_metadata=return_video_metadata,
            )
            videos.append(video)
            fps.append(sample_fps)
        else:
            raise ValueError("image, image_url or video should in content.")
    video_kwargs: dict[str, Any] = {"do_sample_frames": False}
    if not return_video_metadata:
        video_kwargs["fps"] = fps
    result = (images or None, videos or None)
    return (*result, video_kwargs) if return_video_kwargs else result
