"""The trainer's device memory handed to colocated engines while they generate (``--offload``).

Every storage that holds the trainer's state (parameters and their fp32 main copies, gradient
buffers, optimizer state, the reference model) is copied to (pinned) host memory, gradients are
not (every step zeroes them first), and its device memory is released in place with
``resize_(0)``: every view of it (DDP's buffers, ``main_grad``) stays valid, and ``onload`` brings
the same bytes back into the same storages.
"""

from __future__ import annotations

import torch


def state_storages(modules, optimizer, device: torch.device) -> list[tuple[torch.UntypedStorage, bool]]:
    """Every storage on ``device`` that holds the state of ``modules`` and ``optimizer`` (None: a frozen
    model has none), once -> (storage, whether its content must survive an offload)."""
    tensors: list[tuple[torch.Tensor, bool]] = []
    for module in modules:
        for param in module.parameters() if module is not None else []:
            tensors.append((param, True))
            for attr, keep in (("main_param", True), ("main_grad", False)):
                if isinstance(getattr(param, attr, None), torch.Tensor):
                    tensors.append((getattr(param, attr), keep))
    for chained in getattr(optimizer, "chained_optimizers", [optimizer] if optimizer is not None else []):
        inner = getattr(chained, "optimizer", chained)
        tensors += [(param, True) for group in inner.param_groups for param in group["params"]]
        tensors += [(v, True) for state in inner.state.values() for v in state.values() if torch.is_tensor(v)]
    found: dict[int, list] = {}  # by the storage's address: views of one buffer share it
    for tensor, keep in tensors:
        storage = tensor.untyped_storage()
        if tensor.device.type == device.type and storage.nbytes() > 0:
            entry = found.setdefault(storage.data_ptr(), [storage, False])
            entry[1] = entry[1] or keep
    return [(storage, keep) for storage, keep in found.values()]


def offload(storages: list[tuple[torch.UntypedStorage, bool]], device: torch.device) -> list:
    """Release ``storages`` on ``device``, their content kept on the host where it must survive ->
    what ``onload`` takes."""
    pin = device.type == "cuda"
    offloaded = []
    for storage, keep in storages:
        backup = None
        if keep:
            backup = torch.UntypedStorage(storage.nbytes(), device="cpu")
            backup.copy_(storage)
            backup = backup.pin_memory() if pin else backup
        offloaded.append((storage, storage.nbytes(), backup))
        storage.resize_(0)
    if pin:
        torch.cuda.empty_cache()
    return offloaded


def onload(offloaded: list) -> None:
    """The storages ``offload`` released, back at their size and content (zeros where none was kept)."""
    for storage, nbytes, backup in offloaded:
        storage.resize_(nbytes)
        if backup is None:
            storage.fill_(0)
        else:
            storage.copy_(backup)
