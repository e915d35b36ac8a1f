"""Issue 75 item 1: ``qwen_vl_utils`` under ``--slime-compat`` (slime's geo3k VLM rollout imports
``process_vision_info``) behaves as the published package 0.0.14 does. The published module is loaded from
its wheel with ``torchvision`` stood in for (it imports torchvision at import time, which cannot load beside
the CPU torch; the image paths compared here never call it). Unit tier, about 1 s."""

import base64
import importlib.machinery
import importlib.util
import io
import sys
import types
from pathlib import Path

import pytest
import torch
from PIL import Image

from slime_mt.compat import install
from slime_mt.compat import qwen_vl_utils as ours


@pytest.fixture(scope="module")
def published():
    """The published ``qwen_vl_utils/vision_process.py``, torchvision stood in for."""
    package = importlib.machinery.PathFinder.find_spec("qwen_vl_utils")  # the installed one, not compat's name
    assert package is not None, "qwen-vl-utils==0.0.14 (scripts/_venv.sh)"
    origin = Path(package.submodule_search_locations[0]) / "vision_process.py"
    fake = types.ModuleType("torchvision")
    fake.__version__ = "0.24.0"
    fake.io = types.ModuleType("torchvision.io")
    fake.transforms = types.ModuleType("torchvision.transforms")
    fake.transforms.InterpolationMode = types.SimpleNamespace(BICUBIC="bicubic")
    saved = {k: sys.modules.get(k) for k in ("torchvision", "torchvision.io", "torchvision.transforms")}
    sys.modules.update({"torchvision": fake, "torchvision.io": fake.io, "torchvision.transforms": fake.transforms})
    try:
        module = importlib.util.module_from_spec(importlib.util.spec_from_file_location("published_vp", origin))
        module.__spec__.loader.exec_module(module)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    return module


def images(tmp_path):
    rgba = Image.new("RGBA", (301, 77), (200, 10, 10, 90))
    rgba.putpixel((5, 5), (0, 255, 0, 255))
    gray = Image.linear_gradient("L").resize((640, 480))
    path = tmp_path / "p.png"
    Image.new("RGB", (20, 20), (1, 2, 3)).save(path)
    buffer = io.BytesIO()
    Image.new("RGB", (1000, 30), (9, 9, 9)).save(buffer, format="PNG")
    data = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    return [
        {"type": "image", "image": rgba},
        {"type": "image", "image": gray, "max_pixels": 50_000},
        {"type": "image", "image": str(path)},
        {"type": "image", "image": f"file://{path}", "min_pixels": 100_000},
        {"image_url": data},
        {"type": "image", "image": gray, "resized_height": 100, "resized_width": 333},
    ]


def test_smart_resize_is_the_published_one(published):
    for h in (1, 7, 28, 29, 100, 333, 1080, 4000):
        for w in (3, 28, 57, 640, 1920, 9000):
            for bounds in ({}, {"min_pixels": 20_000, "max_pixels": 300_000}):
                try:
                    expected = published.smart_resize(h, w, 28, **bounds)
                except ValueError as e:
                    with pytest.raises(ValueError, match="aspect ratio"):
                        ours.smart_resize(h, w, 28, **bounds)
                    assert "aspect ratio" in str(e)
                    continue
                assert ours.smart_resize(h, w, 28, **bounds) == expected, (h, w, bounds)


def test_process_vision_info_gives_the_published_images(published, tmp_path):
    """Images of every source the published package opens: the same sizes and pixels; text-only messages
    give (None, None), as slime's rollout receives for an env's text feedback."""
    message = {"role": "user", "content": [*images(tmp_path), {"type": "text", "text": "score: 0.0"}]}
    for patch in (14, 16):
        mine, theirs = (
            ours.process_vision_info([message], image_patch_size=patch),
            published.process_vision_info([message], image_patch_size=patch),
        )
        assert theirs[1] is None and mine[1] is None and len(mine[0]) == len(theirs[0]) == 6
        for a, b in zip(mine[0], theirs[0]):
            assert (a.mode, a.size) == (b.mode, b.size) and a.tobytes() == b.tobytes()
    text = [{"role": "user", "content": [{"type": "text", "text": "calc_score result: 1.0"}]}]
    assert ours.process_vision_info(text) == published.process_vision_info(text) == (None, None)
    conversations = [[message], text]  # several conversations at once
    assert len(ours.process_vision_info(conversations)[0]) == len(published.process_vision_info(conversations)[0])
    bad = [{"role": "user", "content": [{"type": "image"}]}]
    for module in (ours, published):
        with pytest.raises(ValueError, match="image, image_url or video should in content"):
            module.process_vision_info(bad)


def test_a_video_of_frames_and_a_video_file(tmp_path):
    frames = [Image.new("RGB", (64, 48), (i * 40, 0, 0)) for i in range(3)]
    images_, videos, kwargs = ours.process_vision_info(
        [{"role": "user", "content": [{"type": "video", "video": frames}]}], return_video_kwargs=True
    )
    assert images_ is None and kwargs == {"do_sample_frames": False, "fps": [2.0]}
    video = videos[0]
    assert video.dtype == torch.float32 and video.shape[:2] == (4, 3)  # padded to an even count, [T, C, H, W]
    assert video.shape[2] % 56 == 0 and video.shape[3] % 56 == 0
    assert torch.equal(video[2], video[3])  # the last frame repeated
    with pytest.raises(NotImplementedError, match="needs the published qwen_vl_utils and torchvision"):
        ours.process_vision_info([{"role": "user", "content": [{"type": "video", "video": "clip.mp4"}]}])


def test_under_compat_the_name_resolves_to_the_stand_in_where_torchvision_is_missing():
    install()
    import qwen_vl_utils

    assert importlib.util.find_spec("torchvision") is None  # this machine: the published one cannot load
    assert qwen_vl_utils.process_vision_info is ours.process_vision_info
