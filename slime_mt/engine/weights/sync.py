"""New weights to the engines, one way per kind of engine (``transport_for`` picks it).

- ``InProcessWeights``: embedded engines in the trainer's rank-0 process take the tensors directly.

A LoRA run whose engines serve its adapter (``config.training.adapter_updates``) streams an
``AdapterStream`` instead: the in-process and disk transports load it under ``POLICY_ADAPTER`` (the
folder is a PEFT adapter), and the base weights never move.
- ``FolderWeights``: engines on this machine (``--engine-url``, launched SGLang servers) load a
  safetensors folder per version (``WeightFolders``, below) through ``/update_weights_from_disk``.
- ``DistributedWeights``: engines on other nodes, with no shared file system: rank 0 joins a process
  group with every engine's devices (``/init_weights_update_group``) and broadcasts the weights in
  buckets of ``--update-weight-buffer-size`` bytes, each announced by
  ``/update_weights_from_distributed`` (NCCL on GPUs, gloo on CPUs; ``weight_group.py``), as slime does.
- ``TensorWeights``: engines on rank 0's node (colocated on GPUs, where NCCL cannot pair two processes
  on one device): each bucket passed by handle through ``/update_weights_from_tensor``.

Every transport's ``push(stream, version, gate_closed)`` loads the whole stream as ``version`` on
every engine, with generation held only while the engines change (``gate_closed``). ``EngineWeights``
holds the run's transport where the weights are (the rollout role's process, or under ``--ray`` the
trainer rank that exports them) and makes it again when the engines that take them change
(``UpdatePlan``, from the rollout role before each update).

``WeightFolders`` writes ``ROOT/v{N}`` for version N (to ``ROOT/.tmp_v{N}`` first, then renamed, so
an engine never reads half a folder) and deletes what no engine needs: once every engine has
acknowledged version N (``update_weights_from_disk`` answered success on each), only v{N} and the
``keep`` versions before it stay (``--keep-weight-versions``, default 1). Each folder is a full
model, about 15 GB for a 7B model in bf16, so without this a run fills its disk.

A folder is never deleted while an engine may read it: deletion only follows every engine's
acknowledgement of a newer version (a load reads its folder within the update call), and an
update that fails on any engine deletes nothing. Folders an earlier run left in ROOT (a resumed run
in the same run directory) are deleted when the run starts: no update is reading them then.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import importlib
import logging
import os
import shutil
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from slime_mt.config.training import POLICY_ADAPTER
from slime_mt.engine.weights import group as weight_group
from slime_mt.engine.weights import tensor_payload
from slime_mt.engine.weights.adapters import AdapterStream, write_adapter
from slime_mt.engine.weights.fp8 import BlockFp8, quantize_stream
from slime_mt.errors import ConfigError, EngineError
from slime_mt.safetensors_files import ShardWriter

logger = logging.getLogger(__name__)


class WeightFolders:
    def __init__(self, root: str | Path, keep: int = 1):
        if keep < 0:
            raise ValueError(f"--keep-weight-versions must be >= 0, got {keep}")
        self.root = Path(root)
        self.keep = keep
        self._versions: list[int] = []  # written by this run and not deleted, oldest first
        self.root.mkdir(parents=True, exist_ok=True)
        stale = sorted(p for p in self.root.iterdir() if p.is_dir() and _is_version(p.name.removeprefix(".tmp_")))
        for path in stale:
            shutil.rmtree(path, ignore_errors=True)
        if stale:
            logger.info("deleted %d weight folders an earlier run left in %s", len(stale), self.root)

    def folder(self, version: int) -> Path:
        return self.root / f"v{version}"

    def write(self, version: int, tensors: Iterable[tuple[str, torch.Tensor]]) -> Path:
        """Write HF-named ``tensors`` as version ``version`` -> its folder (complete when it appears); an
        ``AdapterStream`` as a PEFT adapter folder."""
        folder, tmp = self.folder(version), self.root / f".tmp_v{version}"
        if isinstance(tensors, AdapterStream):
            write_adapter(folder, tmp, tensors)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
            writer = ShardWriter(tmp, "model")
            for name, tensor in tensors:
                writer.add(name, tensor)
            writer.close()
            shutil.rmtree(folder, ignore_errors=True)
            os.replace(tmp, folder)
        if version not in self._versions:
            self._versions.append(version)
        return folder

    def acknowledged(self, version: int) -> list[Path]:
        """Every engine serves ``version``: delete the folders of older versions beyond the ``keep``
        before it -> the folders deleted."""
        older = [v for v in self._versions if v < version]
        deleted = []
        for v in older[: max(len(older) - self.keep, 0)]:
            shutil.rmtree(self.folder(v), ignore_errors=True)
            self._versions.remove(v)
            deleted.append(self.folder(v))
        return deleted

    def kept(self) -> list[Path]:
        return [self.folder(v) for v in self._versions]


def _is_version(name: str) -> bool:
    return name.startswith("v") and name[1:].isdigit()


def transport_for(cfg, on_ray: bool, colocated: bool, local_engines: list, ctx, run_dir: Path):
    """The run's weight transport from ``--weight-transport`` (``cfg``: the EngineConfig) and where the
    engines are (``local_engines``: those in this process, ``ctx``: the rollout context, or an
    ``EngineControl``, with its client)."""
    mode = cfg.weight_transport
    if mode == "auto":
        mode = "inprocess" if local_engines else ("distributed" if on_ray else "disk")
        if mode == "distributed" and colocated and torch.cuda.is_available():
            mode = "tensor"  # NCCL cannot broadcast between two processes on one device
    if mode == "inprocess":
        if not local_engines:
            raise ConfigError(
                "--weight-transport inprocess: the engines are not in this process; use disk or distributed"
            )
        return InProcessWeights(local_engines)
    if mode == "disk":
        return FolderWeights(ctx, WeightFolders(run_dir / "weights", cfg.keep_weight_versions))
    if cfg.update_weight_buffer_size < 1:
        raise ConfigError(
            f"--update-weight-buffer-size={cfg.update_weight_buffer_size}: must be a positive number of bytes"
        )
    tp_sizes = [int(info.get("tp_size", 1)) for info in ctx.run_sync(ctx.client.server_info())]
    if mode == "tensor":
        return TensorWeights(ctx, tp_sizes, cfg.update_weight_buffer_size)
    return DistributedWeights(ctx, tp_sizes, cfg.update_weight_buffer_size)


GateClosed = Callable[[], contextlib.AbstractContextManager]


@dataclasses.dataclass
class UpdatePlan:
    """What the rollout role says before a weight update: the engines that take it (``worker_urls``),
    those started again and waiting for it (``ready``: engine -> URL, under ``--ray``), and whether the
    engines are asleep (``--colocate``: their weights' memory was just given back, nothing generates)."""

    worker_urls: list[str]
    ready: dict[int, str] = dataclasses.field(default_factory=dict)
    asleep: bool = False


class EngineWeights:
    """The run's transport (``make``: engine URLs -> a transport), made again when the engines that take
    the weights change (one was lost, or came back): each ``push`` loads a whole version on the
    engines of its ``UpdatePlan``, behind the update gate unless they are asleep. With ``quantization``
    (the FP8 format the engines serve, ``fp8.rollout_checkpoint``) every tensor is quantized on its way,
    one at a time, so a bucket or the disk folder holds the served format."""

    def __init__(
        self, make: Callable[[list[str]], object], worker_urls: list[str], quantization: BlockFp8 | None = None
    ) -> None:
        self.make = make
        self.worker_urls = list(worker_urls)
        self.quantization = quantization
        self.transport = make(self.worker_urls)

    def push(self, stream: Iterator, version: int, plan: UpdatePlan, gate_closed: GateClosed) -> None:
        if plan.worker_urls != self.worker_urls:  # engines left or came back: a new group
            self.transport.close()
            self.transport = self.make(plan.worker_urls)
            self.worker_urls = list(plan.worker_urls)
        if self.quantization is not None and not isinstance(stream, AdapterStream):  # an adapter stays as trained
            stream = quantize_stream(stream, self.quantization)
        self.transport.push(stream, version, contextlib.nullcontext if plan.asleep else gate_closed)

    def close(self) -> None:
        self.transport.close()


class InProcessWeights:
    def __init__(self, engines: list) -> None:
        self.engines = engines  # LocalEngine objects in this process

    def push(self, stream: Iterator, version: int, gate_closed: GateClosed) -> None:
        named = dict(stream)
        with gate_closed():
            for engine in self.engines:
                if isinstance(stream, AdapterStream):  # a LoRA run's: its adapter, the base untouched
                    engine.update_adapter(POLICY_ADAPTER, stream.config, named, weight_version=str(version))
                else:
                    engine.update_weights_from_tensors(named, weight_version=str(version))

    def close(self) -> None:
        pass


class FolderWeights:
    def __init__(self, ctx, folders: WeightFolders) -> None:
        self.ctx, self.folders = ctx, folders

    def push(self, stream: Iterator, version: int, gate_closed: GateClosed) -> None:
        folder = self.folders.write(version, stream)  # written while the engines still generate
        client = self.ctx.client
        with gate_closed():
            if isinstance(stream, AdapterStream):  # a LoRA run's: its adapter, loaded under its name
                self.ctx.run_sync(client.replace_lora_adapter(POLICY_ADAPTER, str(folder), weight_version=str(version)))
            else:
                self.ctx.run_sync(client.update_weights_from_disk(str(folder), weight_version=str(version)))
        self.folders.acknowledged(version)

    def close(self) -> None:
        pass


class DistributedWeights:
    """Rank 0's end of the weight group: joined at start (every engine's devices after it), one
    broadcast per bucket per version, left at the end."""

    def __init__(self, ctx, tp_sizes: list[int], buffer_bytes: int, address: str | None = None) -> None:
        self.ctx, self.buffer_bytes = ctx, buffer_bytes
        self.backend = "nccl" if torch.cuda.is_available() else "gloo"
        self.name = f"slime_mt_weights_{uuid.uuid4().hex[:8]}"  # a failed group is abandoned, never reused
        self.broken = False  # a bucket failed: the engines' weights are mixed, the run must stop
        self._unfinished = None  # the broadcasts of a failed bucket, when they had not finished
        client = ctx.client
        address = address or weight_group.address_toward(client.worker_urls)
        port = weight_group.free_port(address)
        joined = ctx.submit(client.init_weights_update_group(address, port, tp_sizes, self.name, self.backend))
        group = _in_thread(weight_group.join, self.backend, address, port, 1 + sum(tp_sizes), 0, self.name)
        _first_failure([group, joined], "joining the weight group")
        self.group = group.result()
        logger.info(
            "weight group %s: rank 0 at %s:%d (%s), engines %s with %s devices",
            self.name,
            address,
            port,
            self.backend,
            client.worker_urls,
            tp_sizes,
        )

    def push(self, stream: Iterator, version: int, gate_closed: GateClosed) -> None:
        device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        client = self.ctx.client
        with gate_closed():
            for bucket in weight_group.buckets(stream, self.buffer_bytes):
                tensors = [t.detach().to(device).contiguous() for _, t in bucket]
                answered = self.ctx.submit(
                    client.update_weights_from_distributed(
                        [name for name, _ in bucket],
                        [weight_group.dtype_name(t.dtype) for t in tensors],
                        [list(t.shape) for t in tensors],
                        self.name,
                        str(version),
                    )
                )
                works = [
                    dist.broadcast(weight_group.on_the_wire(t), src=0, group=self.group, async_op=True) for t in tensors
                ]
                sent = _in_thread(_wait_all, works)
                try:
                    _first_failure([sent, answered], f"weights version {version} to {client.worker_urls}")
                except BaseException:
                    self.broken = True
                    self._unfinished = None if sent.done() else sent
                    try:
                        self.ctx.run_sync(client.finish_weights_update(None))
                    except Exception as e:  # the bucket's own failure is the one to raise
                        logger.warning("ending the failed update of version %s: %s", version, e)
                    raise
            self.ctx.run_sync(client.finish_weights_update(str(version)))

    def close(self) -> None:
        """Leave the group on every engine and here; an engine that cannot (it left, or is gone) is logged."""
        try:
            self.ctx.run_sync(self.ctx.client.destroy_weights_update_group(self.name))
        except EngineError as e:
            logger.warning("leaving the weight group %s: %s", self.name, e)
        finally:
            if self._unfinished is None:  # destroying a group with a broadcast pending would wait on it
                weight_group.leave(self.group)


class TensorWeights:
    """Engines on rank 0's node, colocated or not: each bucket passed by handle (CUDA IPC on GPUs,
    shared memory on CPUs) through ``/update_weights_from_tensor``, as slime does for colocated
    engines. Every rank of an engine is given rank 0's handles, which a rank on another device can
    only open where peer access allows; an engine of several devices colocated on several trainer
    ranks needs each rank's own copy (colocated mode)."""

    def __init__(self, ctx, tp_sizes: list[int], buffer_bytes: int) -> None:
        self.ctx, self.tp_sizes, self.buffer_bytes = ctx, tp_sizes, buffer_bytes
        _sglang_device_reductions()

    def push(self, stream: Iterator, version: int, gate_closed: GateClosed) -> None:
        with gate_closed():
            for bucket in weight_group.buckets(stream, self.buffer_bytes):
                entry = tensor_payload.serialize(bucket)  # the bucket stays referenced until the engines answer
                entries = [[entry] * tp for tp in self.tp_sizes]
                self.ctx.run_sync(self.ctx.client.update_weights_from_tensor(entries, str(version)))

    def close(self) -> None:
        pass


def _sglang_device_reductions() -> None:
    """Where SGLang is installed, its CUDA reductions (a device named by UUID, so an engine that sees
    other devices than the trainer opens the right one), as slime applies them before serializing."""
    for module in ("sglang.srt.utils.patch_torch", "sglang.srt.patch_torch"):
        try:
            patch = importlib.import_module(module).monkey_patch_torch_reductions
        except (ImportError, AttributeError):
            continue
        patch()
        return


def _in_thread(fn, *args) -> concurrent.futures.Future:
    """``fn(*args)`` in a daemon thread -> its future (a wait that may never end must not hold the exit)."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run():
        try:
            future.set_result(fn(*args))
        except BaseException as e:
            future.set_exception(e)

    threading.Thread(target=run, daemon=True, name="slime-mt-weights").start()
    return future


def _wait_all(works: list) -> None:
    for work in works:
        work.wait()


def _first_failure(futures: list[concurrent.futures.Future], what: str, grace: float = 5.0) -> None:
    """Wait for every future; once one fails, give the others ``grace`` seconds (the engine's answer says
    why better than the broken connection does) and raise every failure. An engine that refused a bucket
    never receives it, and the broadcast would otherwise wait for it until the group's timeout."""
    done, pending = concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
    if not any(f.exception() is not None for f in done):
        return
    concurrent.futures.wait(pending, timeout=grace)
    failures = [f.exception() for f in futures if f.done() and f.exception() is not None]
    raise RuntimeError(f"{what}: " + "; ".join(str(e) for e in failures)) from failures[0]
