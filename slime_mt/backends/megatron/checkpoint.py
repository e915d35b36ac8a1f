"""Checkpoints in the Hugging Face layout, so a run saved at one TP size resumes at another.

    root/iter_0000004/                  an HF model folder (config and tokenizer files copied)
      model.safetensors (or shards + index)   weights, float32 (the optimizer's main copies under bf16)
      optimizer/exp_avg/, optimizer/exp_avg_sq/   per-parameter optimizer tensors, HF names and layout
      trainer_state.json                  step, LR schedule, optimizer scalars, the saving layout, extra
      rng/rank_000.pt ...                 RNG states, restored when the layout (TP, DP) is the same
    root/latest                           the newest complete checkpoint's folder name

Saving gathers each tensor to global rank 0 (tensor by tensor; it writes shards of at most 2 GB);
loading reads only this rank's slices through the same conversion as the initial weights. Written to
a temp folder and renamed, then ``latest`` is replaced atomically: a save that dies midway leaves
the previous checkpoint loadable. At the same layout a resume is bitwise exact.

A LoRA run's checkpoint (``--lora-rank``) holds its adapters only, the base being ``--hf-checkpoint``: the
folder is a PEFT adapter (``adapter_config.json``, ``adapter_model.safetensors``), which
``peft.PeftModel.from_pretrained`` and ``--lora-adapter-path`` read as it is, and its optimizer state has the
adapters' PEFT names (``optimizer/exp_avg/adapter_model.safetensors``); it resumes at any TP size as the
full checkpoint does.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from slime_mt.backends.megatron.export import iter_hf_weights
from slime_mt.backends.megatron.peft import adapter_config, check_adapter, iter_adapter_slices, iter_adapter_tensors
from slime_mt.engine.weights.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from slime_mt.errors import CheckpointError
from slime_mt.safetensors_files import CheckpointReader, ShardWriter


def _inner_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _main(param: torch.nn.Parameter) -> torch.Tensor:
    """The tensor the optimizer updates for ``param`` (its fp32 main copy under bf16)."""
    return getattr(param, "main_param", param)


def _split_names(model) -> tuple[dict[str, torch.nn.Parameter], dict[str, torch.nn.Parameter]]:
    """(decoder params by megatron state name, vision params by HF name)."""
    decoder, vision = {}, {}
    for name, param in model.module.named_parameters():
        if name.startswith("gpt."):
            decoder[name[len("gpt.") :]] = param
        elif name.startswith("visual."):
            vision[model.module.vision_prefix + name[len("visual.") :]] = param
        else:
            raise CheckpointError(f"parameter {name} belongs to neither the decoder nor the vision tower")
    return decoder, vision


def _sharding(model) -> dict[torch.nn.Parameter, object]:
    """param -> the distributed optimizer holding a shard of its main copy and state over its DP group
    (``--use-distributed-optimizer``); {} for the replicated optimizer."""
    owners = {}
    for inner in _inner_optimizers(model.optimizer):
        if hasattr(inner, "model_param_gbuf_map"):  # every parameter of its buffers, held here or not
            for buffer in inner.buffers:
                owners.update((param, inner) for param in buffer.params)
    return owners


def _gathered(owner, param: torch.nn.Parameter, key: str) -> torch.Tensor:
    """The whole fp32 main copy (``key`` "param") or optimizer state ``key`` of ``param``, from the
    shards of ``owner``'s DP group (each element is on one rank: a sum gathers them); collective, so a
    rank holding none of it joins too (``key`` is one the saving ranks found in their state)."""
    full = torch.zeros(param.numel(), dtype=torch.float32, device=param.device)
    if param in owner.model_param_group_index_map:  # this rank holds a piece of it
        piece = owner._get_model_param_range_map(param)["param"]
        full[piece.start : piece.end] = owner._get_main_param_and_optimizer_states(param)[key]
    dist.all_reduce(full, group=owner.data_parallel_group)
    return full.view(param.shape)


def _scatter(owner, param: torch.nn.Parameter, key: str, tensor: torch.Tensor, scalars: dict) -> None:
    """Set this rank's shard of ``param``'s main copy (``key`` "param") or state ``key`` from the whole."""
    if param not in owner.model_param_group_index_map:
        return
    piece = owner._get_model_param_range_map(param)["param"]
    values = tensor.reshape(-1)[piece.start : piece.end]
    main = owner._get_main_param_and_optimizer_states(param)["param"]
    if key == "param":
        main.copy_(values)
        return
    entry = owner.optimizer.state[main]
    entry[key] = values.to(device=main.device, dtype=main.dtype).clone()
    for scalar, value in scalars.items():
        entry.setdefault(scalar, torch.tensor(value, dtype=torch.float32))


def _optimizer_state(model) -> dict[int, dict]:
    """id(main tensor) -> its torch optimizer state."""
    states = {}
    for inner in _inner_optimizers(model.optimizer):
        for main, state in inner.optimizer.state.items():
            states[id(main)] = state
    return states


def _hf_tensors(model, pick) -> Iterator[tuple[str, torch.Tensor | None]]:
    """HF-named ``pick(param)`` for every parameter (None where pick returns None), full tensors on
    global rank 0 only; collective over the TP group of DP rank 0. A LoRA model's: its adapters', PEFT-named."""
    if model.adapters:
        yield from iter_adapter_tensors(model, pick)
        return
    decoder, vision = _split_names(model)
    picked = {name: pick(p) for name, p in decoder.items()}
    if all(t is not None for t in picked.values()):
        yield from iter_hf_weights(model, tensors=picked)
    here = model.info.rank == 0
    for name, param in vision.items():
        t = pick(param)
        if t is not None:
            yield name, t.detach().clone() if here else None


NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
HF_WEIGHT_FILES = (".safetensors", ".safetensors.index.json")  # written here; the folder's other files copied


class _Writes:
    """One rank's writes of a save: the first OSError stops them, while the rank goes on taking part in
    every gather (no rank waits forever); the bytes the checkpoint needs are counted either way."""

    def __init__(self):
        self.error: OSError | None = None
        self.bytes = 0

    def call(self, fn, *args, size: int = 0):
        """``fn(*args)`` unless a write already failed -> its result (None after a failure)."""
        self.bytes += size
        if self.error is not None:
            return None
        try:
            return fn(*args)
        except OSError as e:
            self.error = e
            return None


def _settle(model, writes: _Writes, root: Path, tmp: Path, name: str) -> None:
    """Every rank learns whether any rank's writes failed (collective); if one did, the temp folder goes
    and every rank raises CheckpointError naming ``--save``, the bytes needed and the bytes free."""
    code = 0 if writes.error is None else 2 if writes.error.errno in NO_SPACE else 1  # a full disk explains the rest
    status = torch.tensor([code, writes.bytes, model.info.rank if code else -1], dtype=torch.int64, device=model.device)
    dist.all_reduce(status, op=dist.ReduceOp.MAX)
    code, needed, rank = status.tolist()
    if not code:
        return
    if model.info.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    latest = root / "latest"
    kept = f"checkpoint {latest.read_text().strip()} is unchanged" if latest.is_file() else "no checkpoint was there"
    if code == 2:
        free = shutil.disk_usage(root).free
        raise CheckpointError(
            f"--save {root}: no space left on its disk: checkpoint {name} needs {needed:,} bytes and "
            f"{free:,} are free there; nothing of it was kept ({kept}). Free space or give --save a folder "
            "with room, then resume with --load"
        )
    why = writes.error if writes.error is not None else f"rank {rank} could not write its part"
    raise CheckpointError(f"--save {root}: writing checkpoint {name} failed: {why}; nothing of it was kept ({kept})")


def save_checkpoint(model, root: str | Path, extra: dict) -> Path:
    """Every rank's part of a checkpoint of ``model`` into ``root`` (collective) -> its folder; a write
    that fails (a full disk) leaves no part of it and raises CheckpointError on every rank."""
    root = Path(root)
    name = f"iter_{model.step:07d}"
    tmp = root / f".tmp_{name}"
    main = model.info.rank == 0
    writes = _Writes()
    # an HF model folder's other files (config, tokenizer); a LoRA checkpoint is a PEFT folder, its base apart
    base_files = [] if model.adapters else Path(model.hf_path).iterdir()
    copied = [f for f in base_files if f.is_file() and not f.name.endswith(HF_WEIGHT_FILES)]
    prefix = ADAPTER_WEIGHTS if model.adapters else "model"
    if main:
        writes.bytes += sum(f.stat().st_size for f in copied)  # the whole need is named if a write fails
        shutil.rmtree(tmp, ignore_errors=True)
        writes.call(lambda: (tmp / "rng").mkdir(parents=True))
    dist.barrier()
    sharded = _sharding(model)

    def write_tensors(folder: Path, tensors) -> None:
        """Rank 0 writes the gathered tensors; every rank iterates (the gathers are collective)."""
        writer = writes.call(ShardWriter, folder, prefix) if main else None
        for hf_name, t in tensors:
            if writer:
                writes.call(writer.add, hf_name, t.float(), size=t.numel() * 4)
            elif main:
                writes.bytes += t.numel() * 4  # counted for the message after a failed write
        if writer:
            writes.call(writer.close)

    def weight(param):
        return _gathered(sharded[param], param, "param") if param in sharded else _main(param).detach()

    write_tensors(tmp, _hf_tensors(model, weight))
    states = _optimizer_state(model)
    keys = sorted({k for s in states.values() for k, v in s.items() if torch.is_tensor(v) and v.dim() > 0})

    def state(param, key):
        if param in sharded:
            return _gathered(sharded[param], param, key)
        return states.get(id(_main(param)), {}).get(key)

    for key in keys:
        write_tensors(tmp / "optimizer" / key, _hf_tensors(model, lambda p, k=key: state(p, k)))
    from megatron.core.tensor_parallel import random as mp_random

    rng = {"torch": torch.get_rng_state(), "tracker": mp_random.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    writes.call(torch.save, rng, tmp / "rng" / f"rank_{model.info.rank:03d}.pt")
    _settle(model, writes, root, tmp, name)
    if main:
        state_text = json.dumps(
            {
                "step": model.step,
                "scheduler": model.scheduler.state_dict(),
                "optimizer_keys": keys,
                "optimizer_scalars": _optimizer_scalars(states),
                "param_groups": _param_groups(model),
                "layout": _layout(model),
                "extra": extra,
            },
            indent=1,
        )
        writes.call((tmp / "trainer_state.json").write_text, state_text, size=len(state_text))
        if model.adapters:
            writes.call((tmp / ADAPTER_CONFIG).write_text, json.dumps(adapter_config(model), indent=1))
        for file in copied:  # config, tokenizer, processor: an HF model folder
            writes.call(shutil.copy2, file, tmp / file.name)
        writes.call(_publish, root, tmp, name)
    _settle(model, writes, root, tmp, name)
    return root / name


def _optimizer_scalars(states: dict[int, dict]) -> dict[str, float]:
    return {k: float(v) for s in states.values() for k, v in s.items() if torch.is_tensor(v) and v.dim() == 0}


def _param_groups(model) -> list[list[dict]]:
    return [
        [
            {k: v for k, v in g.items() if k != "params" and isinstance(v, (int, float, bool))}
            for g in inner.optimizer.param_groups
        ]
        for inner in _inner_optimizers(model.optimizer)
    ]


def _publish(root: Path, tmp: Path, name: str) -> None:
    """The complete temp folder becomes ``root/name`` and ``latest`` names it (replaced atomically)."""
    final = root / name
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    latest_tmp = root / ".latest.tmp"
    try:
        latest_tmp.write_text(name)
        os.replace(latest_tmp, root / "latest")
    except OSError:
        latest_tmp.unlink(missing_ok=True)
        os.rename(final, tmp)  # not published: the temp folder goes with the others' parts
        raise


def _layout(model) -> dict[str, int]:
    """The saving layout (RNG states are restored only at the same one); EP, CP and PP only when above
    1, so checkpoints of dense runs keep their earlier layout record."""
    layout = {"tp": model.info.tp_size, "dp": model.info.dp_size}
    if model.info.ep_size > 1 or model.info.etp_size != model.info.tp_size:
        layout.update(ep=model.info.ep_size, etp=model.info.etp_size)
    if model.info.cp_size > 1:
        layout.update(cp=model.info.cp_size)
    if model.info.pp_size > 1:
        layout.update(pp=model.info.pp_size)
    return layout


def read_latest(root: Path) -> Path:
    """The checkpoint folder ``--load root`` names: ``root`` itself (an ``iter_*`` folder), else the one
    ``root/latest`` names; CheckpointError when there is none."""
    if root.name.startswith("iter_"):
        return root
    latest = root / "latest"
    if not latest.is_file():
        raise CheckpointError(f"--load {root}: no 'latest' file (no completed checkpoint there)")
    name = latest.read_text().strip()
    if not (root / name).is_dir():
        raise CheckpointError(f"--load {root}: 'latest' names {name}, which does not exist")
    return root / name


def _load_params(model, reader: CheckpointReader, target) -> None:
    """Copy this rank's slices of the checkpoint tensors into ``target(param)`` for every parameter (a LoRA
    model's: every adapter parameter)."""
    if model.adapters:
        with torch.no_grad():
            for param, tensor in iter_adapter_slices(model, reader):
                target(param, tensor)
        return
    decoder, vision = _split_names(model)
    names = reader.names()
    seen = set()
    with torch.no_grad():
        for name, tensor in model.iter_megatron_tensors(reader):
            if name not in decoder:
                raise CheckpointError(f"checkpoint tensor {name} has no parameter in this model")
            target(decoder[name], tensor)
            seen.add(name)
        if seen != set(decoder):
            raise CheckpointError(f"parameters without a tensor in the checkpoint: {sorted(set(decoder) - seen)[:5]}")
        for hf_name, param in vision.items():
            if hf_name in names:
                target(param, reader.get(hf_name))


def _weight_setter(model, sharded: dict):
    """``set_weight(param, tensor)``: a parameter and the optimizer's main copy of it (its shard under the
    distributed optimizer) set from the whole tensor's slice for this rank."""

    def set_weight(param, tensor):
        param.copy_(tensor)
        if param in sharded:
            _scatter(sharded[param], param, "param", tensor, {})
        elif _main(param) is not param:
            _main(param).copy_(tensor)

    return set_weight


def _check_kind(model, folder: Path) -> None:
    """A LoRA run resumes a LoRA checkpoint of its own adapters' shapes, a full run a full checkpoint."""
    lora = (folder / ADAPTER_CONFIG).is_file()
    if model.adapters and not lora:
        raise CheckpointError(
            f"checkpoint {folder} holds full weights and this run trains LoRA adapters (--lora-rank): start from "
            f"it with --hf-checkpoint (its folder is a Hugging Face model) instead of --load"
        )
    if lora and not model.adapters:
        raise CheckpointError(
            f"checkpoint {folder} holds LoRA adapters (adapter_config.json): resume it with --lora-rank"
        )
    if lora:
        options = model.lora
        check_adapter(folder, model.spec, options.targets, options.rank, options.alpha, flag="--load")


def load_adapter(model, folder: str | Path) -> None:
    """``--lora-adapter-path``: the adapters' weights from a PEFT folder (a LoRA checkpoint or peft's
    ``save_pretrained``), nothing else: the run starts at step 0 with a fresh optimizer."""
    folder = Path(folder)
    options = model.lora
    check_adapter(folder, model.spec, options.targets, options.rank, options.alpha)
    _load_params(model, CheckpointReader(folder), _weight_setter(model, _sharding(model)))


def load_checkpoint(model, root: str | Path) -> dict:
    """Restore weights, optimizer state, LR schedule, step (and RNG at the same layout) from
    ``root/latest`` or an ``iter_*`` folder -> the saved ``extra`` dict."""
    folder = read_latest(Path(root))
    state_file = folder / "trainer_state.json"
    if not state_file.is_file():
        raise CheckpointError(f"checkpoint {folder} has no trainer_state.json")
    saved = json.loads(state_file.read_text())
    _check_kind(model, folder)
    sharded = _sharding(model)
    _load_params(model, CheckpointReader(folder), _weight_setter(model, sharded))
    states = {}
    for inner in _inner_optimizers(model.optimizer):
        for group in inner.optimizer.param_groups:
            for main in group["params"]:
                states[id(main)] = (inner.optimizer, main)
    for key in saved["optimizer_keys"]:

        def set_state(param, tensor, key=key):
            if param in sharded:
                _scatter(sharded[param], param, key, tensor, saved["optimizer_scalars"])
                return
            owner, main = states[id(_main(param))]
            entry = owner.state[main]
            entry[key] = tensor.to(device=main.device, dtype=main.dtype).clone()
            for scalar, value in saved["optimizer_scalars"].items():
                entry.setdefault(scalar, torch.tensor(value, dtype=torch.float32))

        _load_params(model, CheckpointReader(folder / "optimizer" / key), set_state)
    for inner, groups in zip(_inner_optimizers(model.optimizer), saved["param_groups"]):
        for group, values in zip(inner.optimizer.param_groups, groups):
            group.update(values)
    model.scheduler.load_state_dict(saved["scheduler"])
    model.step = int(saved["step"])
    rng_file = folder / "rng" / f"rank_{model.info.rank:03d}.pt"
    if saved["layout"] == _layout(model) and rng_file.is_file():
        from megatron.core.tensor_parallel import random as mp_random

        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["torch"])
        mp_random.get_cuda_rng_tracker().set_states(rng["tracker"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return saved["extra"]
