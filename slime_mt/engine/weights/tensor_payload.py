"""``/update_weights_from_tensor``'s payload: named tensors passed by handle between processes of one node.

SGLang's format (``MultiprocessingSerializer``): a list of ``(name, tensor)`` pickled by torch's
``ForkingPickler``, which puts a handle in the pickle instead of the data (CUDA IPC for a device
tensor, a shared-memory file for a CPU one), base64-encoded; one entry per tensor-parallel rank of
the engine. The sender keeps the tensors alive until the engine has answered.

The embedded engine reads it with an unpickler that rebuilds tensors and storages and nothing else:
a payload naming any other callable is refused, so the endpoint cannot run arbitrary code.
"""

from __future__ import annotations

import base64
import contextlib
import io
import pickle
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing as mp
import torch.multiprocessing.reductions  # noqa: F401  (registers the tensor reductions with ForkingPickler)

from slime_mt.errors import PayloadError

_REBUILDERS = {
    ("torch.multiprocessing.reductions", name)
    for name in (
        "rebuild_tensor",
        "rebuild_cuda_tensor",
        "rebuild_typed_storage",
        "rebuild_typed_storage_child",
        "rebuild_storage_filename",
        "rebuild_storage_empty",
        "rebuild_event",
    )
} | {
    ("torch", "Tensor"),
    ("torch", "Size"),
    ("torch.nn.parameter", "Parameter"),
    ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"),
}


class _TensorsOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _REBUILDERS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise PayloadError(f"the payload names {module}.{name}, which is not a tensor or storage rebuilder")


@contextlib.contextmanager
def _shared_by_file():
    """CPU storages shared by a file name another process can open (the default passes a file
    descriptor, which only a multiprocessing child of this process can receive)."""
    previous = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        mp.set_sharing_strategy(previous)


def serialize(named: list[tuple[str, torch.Tensor]]) -> str:
    """``named`` as one entry of ``serialized_named_tensors`` (keep the tensors alive until it is read)."""
    buffer = io.BytesIO()
    with _shared_by_file():
        ForkingPickler(buffer).dump([(name, tensor.detach()) for name, tensor in named])
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def deserialize(entry: str | bytes) -> list[tuple[str, torch.Tensor]]:
    """One entry of ``serialized_named_tensors`` -> the named tensors; PayloadError naming what is wrong."""
    try:
        raw = base64.b64decode(entry, validate=True)
    except (ValueError, TypeError) as e:
        raise PayloadError(f"serialized_named_tensors entry is not base64: {e}") from None
    try:
        named = _TensorsOnly(io.BytesIO(raw)).load()
    except PayloadError:
        raise
    except Exception as e:  # a truncated pickle, a handle that cannot be opened
        raise PayloadError(f"serialized_named_tensors entry cannot be read: {type(e).__name__}: {e}") from None
    if not isinstance(named, list) or not all(
        isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], torch.Tensor)
        for item in named
    ):
        raise PayloadError("serialized_named_tensors entry must hold a list of (name, tensor) pairs")
    return named
