"""A LoRA run's weight update when the engines serve its adapter (``config.training.adapter_updates``):
the adapter's PEFT-named tensors and its ``adapter_config.json``, streamed from the trainer as the full
weights are, and loaded by each transport under the run's adapter name (``POLICY_ADAPTER``) instead of
into the base weights, which never move after the engines start."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from slime_mt.safetensors_files import ShardWriter

# PEFT's adapter folder: its config, its tensors' file (``adapter_model.safetensors``), their names' prefix
ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX = "adapter_config.json", "adapter_model", "base_model.model."


PEFT_DEFAULT_ALPHA = 8  # peft.LoraConfig's lora_alpha, for a config that leaves it out


def read_adapter_config(folder: str | Path) -> dict:
    """A PEFT LoRA folder's ``adapter_config.json``; ValueError saying what it lacks (no config: not a PEFT
    adapter folder; another PEFT type; no positive ``r``)."""
    config_file = Path(folder) / ADAPTER_CONFIG
    if not config_file.is_file():
        raise ValueError(f"{folder}: no {ADAPTER_CONFIG} (not a PEFT adapter folder)")
    config = json.loads(config_file.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{folder}: a {config['peft_type']} adapter, not LoRA")
    if not isinstance(config.get("r"), int) or config["r"] <= 0:
        raise ValueError(f"{folder}: r={config.get('r')} in {ADAPTER_CONFIG}")
    return config


def adapter_scale(config: dict) -> float:
    """PEFT's scale of an adapter's ``B A x``: ``lora_alpha / r``, ``lora_alpha / sqrt(r)`` under rsLoRA."""
    rank = config["r"]
    alpha = float(config.get("lora_alpha", PEFT_DEFAULT_ALPHA))
    return alpha / (rank**0.5 if config.get("use_rslora") else rank)


class AdapterStream:
    """(PEFT name, tensor) pairs of one adapter, and its PEFT config: what ``push`` sends for a LoRA run."""

    def __init__(self, tensors: Iterable[tuple[str, torch.Tensor]], config: dict):
        self.tensors, self.config = tensors, config

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.tensors)


def write_adapter(folder: Path, tmp: Path, stream: AdapterStream) -> Path:
    """The adapter as a PEFT folder at ``folder`` (written to ``tmp``, then renamed) -> ``folder``."""
    shutil.rmtree(tmp, ignore_errors=True)
    writer = ShardWriter(tmp, ADAPTER_WEIGHTS)
    for name, tensor in stream:
        writer.add(name, tensor)
    writer.close()
    (tmp / ADAPTER_CONFIG).write_text(json.dumps(stream.config, indent=1))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder
