"""Safetensors checkpoint folders as an engine loads them: the folder's files (through its index when
it has one), and every tensor's name, shape and dtype read from the file headers alone.

The embedded engine loads through ``checkpoint_files``; the vLLM client checks a folder, or a bucket
of a distributed update, against the checkpoint its engines serve (``check_compatible``,
``check_tensor``) before it asks them to load it, because vLLM's in-place loading stops the engine on
a tensor it cannot load.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open

from slime_mt.errors import WeightUpdateError


def checkpoint_files(model_path: str | Path) -> list[Path]:
    """The ``*.safetensors`` files of an HF folder (those its index names, when it has one); a missing
    folder, a bad index or no file is a WeightUpdateError naming it."""
    folder = Path(model_path)
    if not folder.is_dir():
        raise WeightUpdateError(f"update_weights_from_disk: model_path {str(model_path)!r} is not a folder")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise WeightUpdateError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
        files = [folder / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise WeightUpdateError(f"{index} names files that do not exist: {missing[:3]}")
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise WeightUpdateError(f"no *.safetensors files in {model_path}")
    return files


def tensor_headers(model_path: str | Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, safetensors dtype such as ``F32``) of every tensor in the folder, tensors unread."""
    headers: dict[str, tuple[tuple[int, ...], str]] = {}
    for f in checkpoint_files(model_path):
        try:
            with safe_open(str(f), framework="pt") as opened:
                for name in opened.keys():
                    piece = opened.get_slice(name)
                    headers[name] = (tuple(piece.get_shape()), piece.get_dtype())
        except Exception as e:  # safetensors raises its own SafetensorError for corrupt files
            raise WeightUpdateError(f"{f}: not a readable safetensors file ({type(e).__name__}: {e})") from None
    if not headers:
        raise WeightUpdateError(f"the safetensors files in {model_path} hold no tensors")
    return headers


def _floating(dtype: str) -> bool:
    return dtype.startswith(("F", "BF"))


def check_compatible(model_path: str | Path, served: dict[str, tuple[tuple[int, ...], str]]) -> int:
    """Check every tensor of ``model_path`` against ``served`` (``tensor_headers`` of the checkpoint an
    engine serves): see ``check_tensor``. -> the number of tensors."""
    new = tensor_headers(model_path)
    for name, (shape, dtype) in new.items():
        check_tensor(str(model_path), name, shape, _floating(dtype), served)
    return len(new)


def check_tensor(
    where: str, name: str, shape: tuple[int, ...], floating: bool, served: dict[str, tuple[tuple[int, ...], str]]
) -> None:
    """A tensor that can replace one of ``served``: a name it does not have, another shape, or an
    integer tensor for a floating one (or the reverse) is a WeightUpdateError naming ``where`` and it."""
    if name not in served:
        raise WeightUpdateError(f"{where}: weight '{name}' is not in the served checkpoint")
    served_shape, served_dtype = served[name]
    if tuple(shape) != served_shape:
        raise WeightUpdateError(f"{where}: weight '{name}': shape {tuple(shape)} != served {served_shape}")
    if floating != _floating(served_dtype):
        kind = "a floating" if floating else "an integer"
        raise WeightUpdateError(f"{where}: weight '{name}': {kind} tensor cannot replace {served_dtype}")
