"""LoRA adapters served by the embedded engine, as SGLang serves them (``--enable-lora``): PEFT folders
loaded and unloaded by name at run time (``/load_lora_adapter``, ``/unload_lora_adapter``), a request picks
one with ``lora_path`` (its name), and rows of different adapters (and of the base) decode in one batch.

Each adapter is applied by a forward hook on the model's linear layers it names
(``base_model.model.<module>.lora_A.weight`` -> ``<module>``): ``y = W x + scale * B A x`` for the rows of
the forward that use it, ``scale = alpha / r`` (``alpha / sqrt(r)`` under rsLoRA), in the layer's dtype. The
base weights never change, so a weight update of the base and an adapter's load are independent; the
prefix cache keeps each adapter's KV states apart (``prefix_cache.py``'s namespaces).

SGLang's answers are kept: a load or unload answers ``{success, error_message, loaded_adapters}`` (HTTP 400
when it fails: LoRA not enabled, a name already loaded, a name not loaded), a request naming an adapter
that is not loaded is refused with SGLang's text, a batch holds at most ``max_loras_per_batch`` adapters
(the base not counted), and an unload waits for the requests that use the adapter.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from starlette.responses import JSONResponse

from slime_mt.engine.weights.adapters import PEFT_PREFIX, adapter_scale, read_adapter_config
from slime_mt.errors import ProtocolError

UNLOAD_POLL_SECONDS = 0.01


class AdapterError(ProtocolError):
    """A load or unload that cannot be done; the message is SGLang's where SGLang has one."""


@dataclass
class ServedAdapter:
    """One loaded adapter: its path, scale and rank, and (A [r, in], B [out, r]) per module name."""

    name: str
    path: str
    scale: float
    rank: int
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    pinned: bool = False
    serial: int = 0  # the load that made it: a reloaded name is another namespace of the prefix cache


def _read_adapter(path: str, name: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config.json, tensors) of a PEFT folder; AdapterError naming what is missing."""
    from safetensors.torch import load_file

    folder = Path(path)
    try:
        config = read_adapter_config(folder)
    except ValueError as e:
        raise AdapterError(f"LoRA adapter {name}: {e}") from None
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise AdapterError(f"LoRA adapter {name}: {path} has no adapter_model.safetensors")
    tensors = {}
    for file in files:
        tensors.update(load_file(str(file)))
    return config, tensors


class ServedAdapters:
    """The adapters an engine serves, and the hooks that apply them to the rows of each forward.

    ``set_rows`` is called by the runner before each forward (one adapter name or None per row), on the
    scheduler's thread; loads and unloads come from the HTTP thread and change the set under ``lock``
    (a forward never sees an adapter half loaded)."""

    def __init__(
        self,
        model: torch.nn.Module,
        enabled: bool = False,
        max_loras_per_batch: int = 8,
        max_lora_rank: int | None = None,
    ):
        self.model, self.enabled = model, enabled
        self.max_loras_per_batch, self.max_lora_rank = max_loras_per_batch, max_lora_rank
        self.adapters: dict[str, ServedAdapter] = {}  # the names requests may use
        self._applied: dict[str, ServedAdapter] = {}  # what the hooks apply (an unloading one until it is idle)
        self._groups: list[tuple[ServedAdapter, torch.Tensor | None]] = []  # this forward's (adapter, its rows)
        self.lock = threading.Lock()
        # held by every forward (the scheduler's lock, which it sets): a hook is never added to a layer
        # while a forward runs through it
        self.step_lock: contextlib.AbstractContextManager = contextlib.nullcontext()
        self._modules = dict(model.named_modules())
        self._hooked: set[str] = set()
        self.version = 0  # loads and unloads so far
        self.update_lock: asyncio.Lock | None = None  # one load or unload at a time (made in the server's loop)

    def loaded(self) -> dict[str, str]:
        """name -> path of every loaded adapter (SGLang's ``loaded_adapters``)."""
        return {name: a.path for name, a in self.adapters.items()}

    def check_request(self, name: str | None) -> None:
        """A request's ``lora_path`` names a loaded adapter (or none), else SGLang's refusal."""
        if name is None:
            return
        if not self.enabled:
            raise ProtocolError("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        if name not in self.adapters:
            raise ProtocolError(
                f"The following requested LoRA adapters are not loaded: {name}\nLoaded adapters: {set(self.adapters)}."
            )

    def fits(self, name: str | None, batch: list[str | None]) -> bool:
        """Whether a row of adapter ``name`` may join a batch whose rows use ``batch``."""
        others = {n for n in batch if n is not None}
        return name is None or name in others or len(others) < self.max_loras_per_batch

    def load(self, name: str, path: str, pinned: bool = False) -> ServedAdapter:
        """Read and check the PEFT folder ``path`` and serve it as ``name``; AdapterError leaves the set as it was."""
        if not self.enabled:
            raise AdapterError("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        if not name:
            raise AdapterError("lora_name must be a non-empty string")
        if name in self.adapters or name in self._applied:
            raise AdapterError(f"LoRA with name {name} already exists. Loaded LoRAs: {set(self.adapters)}")
        adapter = self._adapter(name, str(path), pinned)
        self._serve(adapter)
        return adapter

    def _serve(self, adapter: ServedAdapter) -> None:
        """``adapter`` in place under its name (hooks on the layers it names, once each), between forwards."""
        with self.step_lock, self.lock:
            for module in adapter.weights:
                if module not in self._hooked:
                    self._modules[module].register_forward_hook(self._hook(module))
                    self._hooked.add(module)
            self.version += 1
            adapter.serial = self.version
            self._applied[adapter.name] = self.adapters[adapter.name] = adapter

    def namespace(self, name: str | None) -> tuple[str, int] | None:
        """The prefix cache's namespace of rows decoded with adapter ``name`` (None: the base model's)."""
        if name is None:
            return None
        adapter = self._applied.get(name)
        return name, adapter.serial if adapter is not None else -1

    def retire(self, name: str) -> None:
        """The first half of an unload: requests can no longer name ``name``; those already admitted keep
        it until ``drop``."""
        if name not in self.adapters:
            raise AdapterError(f"LoRA with name {name} does not exist. Loaded LoRAs: {set(self.adapters)}")
        with self.lock:
            del self.adapters[name]

    def drop(self, name: str) -> None:
        """The second half, once no request uses ``name``: its weights go."""
        with self.lock:
            self._applied.pop(name, None)
            self.version += 1

    def replace(self, name: str, config: dict, tensors: dict[str, torch.Tensor]) -> int:
        """Serve ``tensors`` (PEFT-named, with their ``adapter_config.json`` as ``config``) as ``name`` in
        place of what was served under it (a training run's update, run by the scheduler between steps)
        -> the tensors taken. AdapterError leaves what was served."""
        if not self.enabled:
            raise AdapterError("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        self._serve(self._adapter(name, "<tensors>", False, (config, tensors)))
        return len(tensors)

    def _adapter(self, name: str, path: str, pinned: bool, given: tuple[dict, dict] | None = None) -> ServedAdapter:
        """The adapter of the PEFT folder ``path`` (or the ``given`` config and tensors), its tensors on the
        model's device and dtype, each checked against the layer it names (AdapterError naming the tensor
        and both shapes)."""
        config, tensors = given or _read_adapter(path, name)
        rank = config.get("r")
        if not isinstance(rank, int) or rank <= 0:
            raise AdapterError(f"LoRA adapter {name}: {path}: r={rank} in adapter_config.json")
        if self.max_lora_rank is not None and rank > self.max_lora_rank:
            raise AdapterError(f"LoRA adapter {name} has rank {rank}, above --max-lora-rank {self.max_lora_rank}")
        scale = adapter_scale(config)
        weights = {}
        for key in sorted(tensors):
            if not key.endswith(".lora_A.weight"):
                continue
            module_name = key[len(PEFT_PREFIX) : -len(".lora_A.weight")] if key.startswith(PEFT_PREFIX) else None
            module = self._modules.get(module_name) if module_name else None
            if not isinstance(module, torch.nn.Linear):
                raise AdapterError(f"LoRA adapter {name}: {key} names no linear layer of the served model")
            b_key = key.replace(".lora_A.", ".lora_B.")
            a, b = tensors[key], tensors.get(b_key)
            want_a, want_b = (rank, module.in_features), (module.out_features, rank)
            if b is None or tuple(a.shape) != want_a or tuple(b.shape) != want_b:
                got = f"{list(a.shape)} and {None if b is None else list(b.shape)}"
                raise AdapterError(
                    f"LoRA adapter {name}: {key} and its lora_B are {got}; the served model's {module_name} needs "
                    f"{list(want_a)} and {list(want_b)} (an adapter of another base model)"
                )
            weight = module.weight
            weights[module_name] = (a.to(weight.device, weight.dtype), b.to(weight.device, weight.dtype))
        if not weights:
            raise AdapterError(f"LoRA adapter {name}: {path} holds no lora_A tensors")
        return ServedAdapter(name, path, scale, rank, weights, pinned)

    def set_rows(self, rows: list[str | None], device: torch.device) -> None:
        """The adapter of each row of the next forward (None: the base): grouped once here, so each
        hooked layer only computes (every row of one adapter: no gather or scatter at all)."""
        names = {n for n in rows if n is not None}
        groups = []
        for name in sorted(names):
            adapter = self._applied.get(name)
            if adapter is None:
                continue
            index = None if len(names) == 1 and None not in rows else [i for i, n in enumerate(rows) if n == name]
            groups.append((adapter, None if index is None else torch.tensor(index, device=device)))
        self._groups = groups

    def _hook(self, module_name: str):
        linear = torch.nn.functional.linear

        def add_adapters(module, args, output):
            out = output
            for adapter, index in self._groups:
                factors = adapter.weights.get(module_name)
                if factors is None:
                    continue
                a, b = factors
                if index is None:  # every row: one adapter's batch
                    out = out + linear(linear(args[0], a), b) * adapter.scale
                    continue
                delta = linear(linear(args[0].index_select(0, index), a), b) * adapter.scale
                out = out.index_add(0, index, delta)
            return out

        return add_adapters


@dataclass(frozen=True)
class LoraServing:
    """SGLang's LoRA server arguments for an embedded engine: ``--enable-lora``, the adapters loaded at
    start (``--lora-paths``: name -> folder), ``--max-loras-per-batch`` and ``--max-lora-rank``."""

    paths: dict[str, str]
    max_loras_per_batch: int = 8
    max_lora_rank: int | None = None

    def apply(self, adapters: ServedAdapters) -> None:
        """Enable ``adapters`` with these options and load ``paths`` (an AdapterError names a bad one)."""
        adapters.enabled = True
        adapters.max_loras_per_batch, adapters.max_lora_rank = self.max_loras_per_batch, self.max_lora_rank
        for name, path in self.paths.items():
            adapters.load(name, path, pinned=True)


def parse_lora_paths(items: list[str] | None) -> dict[str, str]:
    """SGLang's ``--lora-paths``: ``NAME=PATH`` or ``PATH`` (named by itself) or its JSON form
    ``{"lora_name": ..., "lora_path": ...}`` -> {name: path}."""
    paths = {}
    for item in items or []:
        if item.lstrip().startswith("{"):
            entry = json.loads(item)
            name, path = entry["lora_name"], entry["lora_path"]
        else:
            name, _, path = item.partition("=") if "=" in item else (item, "", item)
        paths[name] = path
    return paths


async def update(adapters: ServedAdapters, scheduler, body: dict, load: bool) -> JSONResponse:
    """``/load_lora_adapter`` (``load``) or ``/unload_lora_adapter``, one at a time: SGLang's answer,
    HTTP 400 with ``error_message`` when it cannot be done (nothing changed then). An unload first stops
    new requests from naming the adapter, then waits for those that use it."""
    name = body.get("lora_name")
    if not isinstance(name, str) or not name:
        raise ProtocolError(f"lora_name must be a non-empty string, got {name!r}")
    if adapters.update_lock is None:
        adapters.update_lock = asyncio.Lock()
    async with adapters.update_lock:
        try:
            if load:
                path = body.get("lora_path")
                if not isinstance(path, str) or not path:
                    raise AdapterError(f"lora_path must be a PEFT adapter folder, got {path!r}")
                pinned = bool(body.get("pinned", False))
                await asyncio.get_running_loop().run_in_executor(None, adapters.load, name, path, pinned)
            else:
                adapters.retire(name)
                while scheduler.uses(name):
                    await asyncio.sleep(UNLOAD_POLL_SECONDS)
                adapters.drop(name)
        except AdapterError as e:
            body = {"success": False, "error_message": str(e), "loaded_adapters": adapters.loaded()}
            return JSONResponse(body, status_code=400)
    return JSONResponse({"success": True, "error_message": None, "loaded_adapters": adapters.loaded()})
