"""A ``MegatronModel``'s LoRA adapters in PEFT's format: ``adapter_config.json`` and
``adapter_model.safetensors`` with HF module names (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``
``[r, in]``, ``...lora_B.weight`` ``[out, r]``), which ``peft.PeftModel.from_pretrained``, SGLang's
``/load_lora_adapter`` and vLLM's ``--lora-modules`` read, and which ``--lora-adapter-path`` and a LoRA run's
checkpoints load back at any TP size.

The names are transformers' module paths (a VLM's decoder under ``model.language_model.``; its vision tower,
whose projections may share the decoder's names, is excluded in the config). Megatron's fused layers become
PEFT's separate projections: the adapter of ``linear_qkv`` is q_proj's, k_proj's
and v_proj's with the same A and B's rows unpacked from Megatron's grouped layout as the weight's are
(``convert.unpack_qkv``); ``linear_fc1``'s is gate_proj's and up_proj's (``convert.split_gate_up``). Each tensor is
gathered over the TP group to global rank 0 (``export.tp_gather``), one at a time; only rank 0 writes, to a
temporary folder renamed into place. Loading reads this rank's slices the way the base weights are read
(``convert.qkv_shard``): an adapter whose q, k and v (gate and up) have different A's, as peft trains them,
cannot sit on one fused layer and is refused by name, as is one of another rank, alpha, layer set or shape.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from slime_mt.backends.megatron.convert import qkv_shard, span, split_gate_up, text_prefix, unpack_qkv
from slime_mt.backends.megatron.export import stages_to_rank0, tp_gather
from slime_mt.backends.megatron.families import DecoderSpec
from slime_mt.backends.megatron.lora import adapted_layers, layer_widths, projection_widths
from slime_mt.config.training import LORA_LAYERS
from slime_mt.engine.weights.adapters import (
    PEFT_PREFIX,
    AdapterStream,
    adapter_scale,
    read_adapter_config,
    write_adapter,
)
from slime_mt.errors import CheckpointError
from slime_mt.safetensors_files import CheckpointReader, ShardWriter

# Megatron's layer -> (its HF module under the decoder layer, the projections it fuses: the config's table)
HF_MODULES = {
    layer: ("self_attn." if layer in ("linear_qkv", "linear_proj") else "mlp.", projections)
    for layer, projections in LORA_LAYERS.items()
}


def _layer_of(name: str) -> tuple[int, str]:
    """(the decoder layer's index within its stage, the Megatron layer) of an adapter's module name."""
    parts = name.split(".")
    return int(parts[parts.index("layers") + 1]), parts[-1]


def module_prefix(spec: DecoderSpec) -> str:
    """Where transformers keeps the decoder layers: ``model.language_model.`` in a VLM (whatever names its
    checkpoint uses: Qwen2.5-VL's say ``model.``), ``model.`` in a text model."""
    return "model.language_model." if spec.mrope_section is not None else "model."


def _module(spec: DecoderSpec, layer: int, megatron_layer: str) -> str:
    """The PEFT name of a decoder layer's HF module holding ``megatron_layer`` (``...layers.3.self_attn.``)."""
    return f"{PEFT_PREFIX}{module_prefix(spec)}layers.{layer}.{HF_MODULES[megatron_layer][0]}"


def expected_shapes(spec: DecoderSpec, targets: tuple[str, ...], rank: int) -> dict[str, tuple[int, int]]:
    """PEFT name -> the whole shape of every adapter tensor a model of ``spec`` with adapters of ``rank`` on
    the Megatron layers ``targets`` has (a MoE layer's experts have none: adapters on them are refused)."""
    widths = projection_widths(spec)
    shapes = {}
    for i in range(spec.num_layers):
        for layer in adapted_layers(spec, targets, i):
            for projection in LORA_LAYERS[layer]:
                fan_in, fan_out = widths[projection]
                name = f"{_module(spec, i, layer)}{projection}"
                shapes[f"{name}.lora_A.weight"] = (rank, fan_in)
                shapes[f"{name}.lora_B.weight"] = (fan_out, rank)
    return shapes


def check_adapter(
    folder: str | Path,
    spec: DecoderSpec,
    targets: tuple[str, ...],
    rank: int,
    alpha: float,
    flag: str = "--lora-adapter-path",
) -> None:
    """An adapter folder fits this model and these flags (its config's r, lora_alpha and target_modules,
    every tensor's name and shape), else CheckpointError naming ``flag`` (the one that gave the folder),
    the tensor and both shapes."""
    folder = Path(folder)
    config = _config(folder, flag)
    if config.get("r") != rank:
        raise CheckpointError(f"{flag} {folder}: the adapter has r={config.get('r')}; --lora-rank {rank}")
    if float(config.get("lora_alpha", -1)) != alpha:
        raise CheckpointError(
            f"{flag} {folder}: the adapter has lora_alpha={config.get('lora_alpha')}; --lora-alpha {alpha}"
        )
    want = sorted(p for layer in targets for p in LORA_LAYERS[layer])
    have = config.get("target_modules")
    have = sorted(have) if isinstance(have, list) else have
    if have != want:
        raise CheckpointError(f"{flag} {folder}: the adapter targets {have}; --target-modules resolves to {want}")
    reader = CheckpointReader(folder)
    expected = expected_shapes(spec, targets, rank)
    missing = sorted(set(expected) - reader.names())
    extra = sorted(reader.names() - set(expected))
    if missing or extra:
        raise CheckpointError(
            f"{flag} {folder}: an adapter of another model: {len(missing)} tensors this model needs "
            f"are missing (first: {missing[:2]}), {len(extra)} it has none for (first: {extra[:2]})"
        )
    for name, shape in expected.items():
        if tuple(reader.shape(name)) != shape:
            raise CheckpointError(
                f"{flag} {folder}: {name} is {list(reader.shape(name))} in the adapter and "
                f"{list(shape)} in this model: an adapter of another base model"
            )
    for name in expected:
        projection = name.rsplit(".", 3)[-3]
        fused = next(hf for hf in LORA_LAYERS.values() if projection in hf)
        if projection == fused[0] and name.endswith("lora_A.weight") and len(fused) > 1:
            a = reader.get(name)
            if any(not torch.equal(a, reader.get(name.replace(projection, p, 1))) for p in fused[1:]):
                base = name[: -len(f"{projection}.lora_A.weight")]
                raise CheckpointError(
                    f"{flag} {folder}: {base}{{{','.join(fused)}}} have different lora_A; they are "
                    "one fused layer in Megatron and share one A here (an adapter peft trained, with an A of "
                    "each, cannot be loaded)"
                )


def _config(folder: Path, flag: str) -> dict:
    """The PEFT LoRA config of ``folder``; CheckpointError naming ``flag`` and what the folder lacks."""
    try:
        return read_adapter_config(folder)
    except ValueError as e:
        raise CheckpointError(f"{flag} {e}") from None


def iter_adapter_tensors(
    model, pick: Callable[[torch.nn.Parameter], torch.Tensor] | None = None
) -> Iterator[tuple[str, torch.Tensor | None]]:
    """(PEFT name, whole ``pick(param)`` on global rank 0 / None elsewhere) of every adapter, layer by layer
    (``pick``: the parameter itself by default; a checkpoint picks its fp32 main copy or an optimizer state,
    collectively over the DP group, so every rank picks); the gathers are collective over the TP group of
    the first data-parallel replica (other replicas yield nothing), and under pipeline parallelism every
    later stage's adapters are sent to global rank 0 after its own, stage by stage (``export``'s rule)."""
    mine = _stage_adapter_tensors(model, pick)
    yield from stages_to_rank0(model, mine) if model.info.pp_size > 1 else mine


def _stage_adapter_tensors(model, pick) -> Iterator[tuple[str, torch.Tensor | None]]:
    """``iter_adapter_tensors`` of this pipeline stage's adapters (its layers numbered as in the whole model)."""
    picked = {
        name: (pick(a.lora_A), pick(a.lora_B)) if pick else (a.lora_A, a.lora_B) for name, a in model.adapters.items()
    }
    if not model.info.first_replica:
        return
    gather = tp_gather(model)
    for name, adapter in model.adapters.items():
        a_local, b_local = (t.detach() for t in picked[name])
        local, layer = _layer_of(name)
        projections = HF_MODULES[layer][1]
        base = _module(model.spec, local + model.stage.layers.start, layer)
        if adapter.kind == "column":
            a = gather.replicated(a_local)
            parts = gather.parts(b_local)
            if parts is None:
                bs = (None,) * len(projections)
            else:
                bs = unpack_qkv(parts, model.spec) if layer == "linear_qkv" else split_gate_up(parts)
        else:
            a, bs = gather.cat(a_local, 1), (gather.replicated(b_local),)
        for i, (projection, b) in enumerate(zip(projections, bs)):
            # q, k and v (gate and up) share one A: each gets a copy of its own (safetensors refuses shared storage)
            yield f"{base}{projection}.lora_A.weight", a if i == 0 or a is None else a.clone()
            yield f"{base}{projection}.lora_B.weight", b


def iter_adapter_slices(model, reader: CheckpointReader) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
    """(adapter parameter, this rank's slice of it) for every adapter of ``model`` from a PEFT folder's
    tensors (one ``check_adapter`` passed), sliced over TP as the base weights are (q, k and v's B rows
    regrouped as Megatron fuses them)."""
    spec, rank, tp = model.spec, model.info.tp_rank, model.info.tp_size
    for name, adapter in model.adapters.items():
        local, layer = _layer_of(name)
        base = _module(spec, local + model.stage.layers.start, layer)
        projections = HF_MODULES[layer][1]
        if layer == "linear_qkv":  # q, k and v share one A (check_adapter made sure)
            a = reader.get(f"{base}{projections[0]}.lora_A.weight")
            b = qkv_shard(reader, base, "lora_B.weight", spec, rank, tp)
        elif layer == "linear_fc1":
            f0, f1 = span(spec.ffn_hidden_size, rank, tp)
            a = reader.get(f"{base}{projections[0]}.lora_A.weight")
            b = torch.cat([reader.rows(f"{base}{p}.lora_B.weight", f0, f1) for p in projections])
        else:
            a = reader.cols(f"{base}{projections[0]}.lora_A.weight", *span(layer_widths(spec)[layer][0], rank, tp))
            b = reader.get(f"{base}{projections[0]}.lora_B.weight")
        yield adapter.lora_A, a
        yield adapter.lora_B, b


def adapter_config(model) -> dict:
    """PEFT's ``adapter_config.json`` of the model's adapters."""
    options = model.lora
    targets = sorted({p for name in model.adapters for p in HF_MODULES[_layer_of(name)[1]][1]})
    prefix = module_prefix(model.spec)
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
        "exclude_modules": None if model.mrope is None else rf"(?!{re.escape(prefix)}).*",
    }


def save_adapter(model, folder: str | Path) -> Path | None:
    """Write the adapters to ``folder`` in PEFT's format (global rank 0 writes; the others take part in the
    gathers and return None). Written to ``folder.tmp`` and renamed: a save that dies leaves no half folder."""
    stream = AdapterStream(iter_adapter_tensors(model), adapter_config(model))
    if model.info.rank != 0:
        for _ in stream:  # the gathers are collective
            pass
        return None
    folder = Path(folder)
    return write_adapter(folder, folder.with_name(folder.name + ".tmp"), stream)


def write_merged(base: str | Path, adapter: str | Path, target: str | Path) -> Path:
    """``base`` (an HF model folder) with the LoRA adapter folder ``adapter`` folded into its weights
    (``W + alpha / r x B A``, alpha / sqrt(r) under rsLoRA; in float32, stored in each weight's dtype) as a
    model folder at ``target``: what an engine without adapters serves, and what ``slime-mt eval --load``
    of a LoRA checkpoint evaluates. Any PEFT LoRA adapter of ``base`` (one A per projection or shared);
    an adapter tensor that names no weight of ``base`` is refused. Written beside ``target`` and renamed.
    -> ``target``."""
    base, adapter, target = Path(base), Path(adapter), Path(target)
    scale = adapter_scale(_config(adapter, "--lora-adapter-path"))
    weights, lora = CheckpointReader(base), CheckpointReader(adapter)
    names = weights.names()
    decoder = text_prefix(names)  # where the checkpoint keeps the decoder (a VLM's may say model.)
    vlm = "vision_config" in json.loads((base / "config.json").read_text())
    modules = "model.language_model." if vlm else "model."  # transformers' module path of the decoder
    left = {n for n in lora.names() if n.endswith(".lora_A.weight")}
    tmp = target.parent / f".tmp_{target.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    writer = ShardWriter(tmp, "model")
    for name in sorted(names):
        tensor = weights.get(name)
        module = name[: -len(".weight")] if name.startswith(decoder) and name.endswith(".weight") else None
        a_name = f"{PEFT_PREFIX}{modules}{module[len(decoder) :]}.lora_A.weight" if module else None
        if a_name in left:
            left.discard(a_name)
            b, a = lora.get(a_name.replace("lora_A", "lora_B")).float(), lora.get(a_name).float()
            tensor = (tensor.float() + scale * (b @ a)).to(tensor.dtype)
        writer.add(name, tensor)
    if left:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"{adapter}: {len(left)} adapters name no weight of {base} (first: {sorted(left)[0]})")
    writer.close()
    for path in base.iterdir():
        if path.is_file() and not path.name.endswith((".safetensors", ".safetensors.index.json")):
            shutil.copy2(path, tmp / path.name)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    return target
