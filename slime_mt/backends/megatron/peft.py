"""A ``MegatronModel``'s LoRA adapters in PEFT's format: ``adapter_config.json`` and
``adapter_model.safetensors`` with HF module names (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``
``[r, in]``, ``...lora_B.weight`` ``[out, r]``), which ``peft.PeftModel.from_pretrained``, SGLang's
``/load_lora_adapter`` and vLLM's ``--lora-modules`` read.

The names are transformers' module paths (a VLM's decoder under ``model.language_model.``; its vision tower,
whose projections may share the decoder's names, is excluded in the config). Megatron's fused layers become
PEFT's separate projections: the adapter of ``linear_qkv`` is q_proj's, k_proj's
and v_proj's with the same A and B's rows unpacked from Megatron's grouped layout as the weight's are
(``convert.unpack_qkv``); ``linear_fc1``'s is gate_proj's and up_proj's (``convert.split_gate_up``). Each tensor is
gathered over the TP group to global rank 0 (``export.tp_gather``), one at a time; only rank 0 writes, to a
temporary folder renamed into place.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from slime_mt.backends.megatron.convert import split_gate_up, unpack_qkv
from slime_mt.backends.megatron.export import tp_gather
from slime_mt.config.training import LORA_LAYERS

PEFT_PREFIX = "base_model.model."
# Megatron's layer -> (its HF module under the decoder layer, the projections it fuses: the config's table)
HF_MODULES = {
    layer: ("self_attn." if layer in ("linear_qkv", "linear_proj") else "mlp.", projections)
    for layer, projections in LORA_LAYERS.items()
}


def _layer_of(name: str) -> tuple[int, str]:
    """(the decoder layer's index within its stage, the Megatron layer) of an adapter's module name."""
    parts = name.split(".")
    return int(parts[parts.index("layers") + 1]), parts[-1]


def module_prefix(model) -> str:
    """Where transformers keeps the decoder layers: ``model.language_model.`` in a VLM (whatever names its
    checkpoint uses: Qwen2.5-VL's say ``model.``), ``model.`` in a text model."""
    return "model.language_model." if model.mrope is not None else "model."


def iter_adapter_tensors(model) -> Iterator[tuple[str, torch.Tensor | None]]:
    """(PEFT name, whole tensor on global rank 0 / None elsewhere) of every adapter, layer by layer;
    collective over the TP group of the first data-parallel replica (other replicas yield nothing)."""
    if not model.info.first_replica:
        return
    gather = tp_gather(model)
    for name, adapter in model.adapters.items():
        local, layer = _layer_of(name)
        module, projections = HF_MODULES[layer]
        base = f"{PEFT_PREFIX}{module_prefix(model)}layers.{local + model.stage.layers.start}.{module}"
        if adapter.kind == "column":
            a = gather.replicated(adapter.lora_A)
            parts = gather.parts(adapter.lora_B)
            if parts is None:
                bs = (None,) * len(projections)
            else:
                bs = unpack_qkv(parts, model.spec) if layer == "linear_qkv" else split_gate_up(parts)
        else:
            a, bs = gather.cat(adapter.lora_A, 1), (gather.replicated(adapter.lora_B),)
        for projection, b in zip(projections, bs):
            yield f"{base}{projection}.lora_A.weight", a
            yield f"{base}{projection}.lora_B.weight", b


def adapter_config(model) -> dict:
    """PEFT's ``adapter_config.json`` of the model's adapters."""
    options = model.lora
    targets = sorted({p for name in model.adapters for p in HF_MODULES[_layer_of(name)[1]][1]})
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": model.hf_path,
        "r": options.rank,
        "lora_alpha": options.alpha,
        "lora_dropout": options.dropout,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        # a VLM's vision tower has projections of the same names (Qwen2.5-VL's gate_proj, ...): not adapted
        "exclude_modules": None if model.mrope is None else rf"(?!{re.escape(module_prefix(model))}).*",
    }


def save_adapter(model, folder: str | Path) -> Path | None:
    """Write the adapters to ``folder`` in PEFT's format (global rank 0 writes; the others take part in the
    gathers and return None). Written to ``folder.tmp`` and renamed: a save that dies leaves no half folder."""
    from safetensors.torch import save_file

    tensors = {name: t for name, t in iter_adapter_tensors(model)}
    if model.info.rank != 0:
        return None
    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # q, k and v (gate and up) share one A: each is written as a copy of its own
    save_file({n: t.detach().to("cpu").clone() for n, t in tensors.items()}, str(tmp / "adapter_model.safetensors"))
    (tmp / "adapter_config.json").write_text(json.dumps(adapter_config(model), indent=1))
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)
    return folder
