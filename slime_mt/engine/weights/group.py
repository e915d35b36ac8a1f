"""The process group that carries weights from trainer rank 0 to engines on other nodes.

SGLang's ``init_weights_update_group`` joins a group beside the engine's own: rank 0 is the trainer,
engine e's devices are ranks ``rank_offset .. rank_offset + tp - 1``, the rendezvous is a TCP store on
the trainer's node (``master_address:master_port``), and its keys are prefixed with the group's name.
``join`` makes the same group the same way on both ends (the trainer here, the embedded engine in
``engine/embedded/server.py``, SGLang in its model runner), so one trainer talks to either engine. It goes
through torch's ``_new_process_group_helper``, as SGLang does: ``new_group`` can only split the
default group, and the engine and the trainer each have their own.

Per update, the trainer POSTs ``/update_weights_from_distributed`` (names, dtypes, shapes of one
bucket, at most ``--update-weight-buffer-size`` bytes) to every engine and broadcasts the bucket's
tensors from rank 0 in the same order; each engine receives them into fresh tensors and loads them.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Iterator
from datetime import timedelta
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

GROUP_NAME = "weight_update_group"  # SGLang's default
JOIN_TIMEOUT = timedelta(minutes=10)

DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "uint8", "float8_e4m3fn")
}


def dtype_name(dtype: torch.dtype) -> str:
    """SGLang's spelling of a dtype in a request (``torch.bfloat16`` -> ``bfloat16``)."""
    return str(dtype).removeprefix("torch.")


def on_the_wire(tensor: torch.Tensor) -> torch.Tensor:
    """What a broadcast moves for ``tensor``: its bytes as uint8 for an FP8 tensor (gloo has no FP8
    type; NCCL moves FP8 as bytes too, so an engine that receives in FP8 gets the same), else itself."""
    return tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor


def dtype_of(name: str) -> torch.dtype:
    if name.removeprefix("torch.") not in DTYPES:
        raise ValueError(f"dtype {name!r} is not one of {sorted(DTYPES)}")
    return DTYPES[name.removeprefix("torch.")]


def join(
    backend: str,
    master_address: str,
    master_port: int,
    world_size: int,
    rank: int,
    group_name: str = GROUP_NAME,
    timeout: timedelta = JOIN_TIMEOUT,
) -> dist.ProcessGroup:
    """Join the weight group as ``rank`` of ``world_size`` (rank 0 hosts the store); blocks until every
    rank has joined or ``timeout`` passes."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    host = f"[{master_address}]" if ":" in master_address else master_address
    store, rank, world_size = next(rendezvous(f"tcp://{host}:{master_port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), PrefixStore(group_name, store), group_name=group_name, timeout=timeout
    )
    _world.pg_group_ranks[group] = {r: r for r in range(world_size)}
    return group


def leave(group: dist.ProcessGroup) -> None:
    dist.destroy_process_group(group)


def buckets(named: Iterable[tuple[str, torch.Tensor]], max_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """HF-named tensors in buckets of at most ``max_bytes`` (a larger tensor is a bucket alone), in order."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def address_toward(urls: list[str]) -> str:
    """This machine's address on the route to the first engine in ``urls`` (what its engines connect
    back to); 127.0.0.1 when the engines are on this machine's loopback."""
    host = urlsplit(urls[0]).hostname or "127.0.0.1"
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # UDP: no packet is sent, the kernel only picks the route
        return s.getsockname()[0]


def free_port(address: str) -> int:
    """A port free on every interface of this machine (the store listens on all of them)."""
    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def receive(
    group: dist.ProcessGroup, names: list[str], dtypes: list[str], shapes: list[list[int]], device: str
) -> dict[str, torch.Tensor]:
    """The engine's end of one bucket: every tensor broadcast from rank 0, in order -> {name: tensor}."""
    tensors = {
        name: torch.empty(shape, dtype=dtype_of(d), device=device) for name, d, shape in zip(names, dtypes, shapes)
    }
    works = [dist.broadcast(on_the_wire(t), src=0, group=group, async_op=True) for t in tensors.values()]
    for work in works:
        work.wait()
    return tensors


def check_bucket(body: dict) -> tuple[list[str], list[str], list[list[int]]]:
    """``/update_weights_from_distributed``'s names, dtypes and shapes -> themselves; ValueError naming
    the field when they cannot describe one bucket."""
    names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
    for field, value in (("names", names), ("dtypes", dtypes), ("shapes", shapes)):
        if not isinstance(value, list) or not value:
            raise ValueError(f"{field} must be a non-empty list, got {str(value)[:100]}")
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, {len(shapes)})")
    for name, dtype, shape in zip(names, dtypes, shapes):
        if not isinstance(name, str) or not isinstance(dtype, str):
            raise ValueError(f"names and dtypes must be strings, got {name!r}, {dtype!r}")
        dtype_of(dtype)
        if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
            raise ValueError(f"shape of {name!r} must be a list of non-negative integers, got {shape!r}")
    return names, dtypes, shapes
