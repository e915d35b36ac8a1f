"""Block-wise FP8 weights in the Hugging Face format, for engines that serve an FP8 copy of the policy.

The format (Qwen3-*-FP8, DeepSeek-V3; transformers' ``FineGrainedFP8Config``; SGLang's and vLLM's
``fp8`` loaders): a linear weight ``W [..., N, K]`` is stored as ``X.weight`` in ``float8_e4m3fn`` and
``X.weight_scale_inv [..., ceil(N/bn), ceil(K/bk)]`` in float32, one scale per ``bn x bk`` block (the
last block of a row or column partial), and ``W[..., i, j] = weight[..., i, j] * scale_inv[..., i // bn,
j // bk]``. A 3-D fused expert tensor (``experts.gate_up_proj``) is blocked over its last two
dimensions, its scale named ``experts.gate_up_proj_scale_inv`` (transformers' rule). ``config.json``
says so under ``quantization_config``: ``{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme":
"dynamic", "weight_block_size": [bn, bk], "modules_to_not_convert": [...]}``.

What is quantized: the decoder's linear weights (attention and MLP projections, every expert). What
stays as it is, as the published FP8 checkpoints keep it: embeddings, the LM head, norms, biases,
MoE routers (``mlp.gate``) and the vision tower.

Quantizing a block: ``scale_inv = amax(|block|) / 448`` (e4m3's largest finite value), ``weight =
round(W / scale_inv)`` to e4m3 (round to nearest even), in float32 on the tensor's device; an all-zero
block has ``scale_inv = 1``. The round trip's error per element is at most half an e4m3 step of its
block's scale.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from slime_mt.engine.weights.checkpoint import checkpoint_files
from slime_mt.errors import ConfigError, WeightUpdateError
from slime_mt.safetensors_files import ShardWriter

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
SCALE_SUFFIX = "_scale_inv"
FUSED_EXPERTS = ("experts.gate_up_proj", "experts.down_proj")
# substrings of the names that stay unquantized (besides biases and 1-D tensors)
KEPT = ("embed_tokens", "lm_head", "norm", "visual.", "vision_tower", "shared_expert_gate")


@dataclasses.dataclass(frozen=True)
class BlockFp8:
    """Block-wise e4m3 with ``block = (rows, columns)`` of the last two dimensions (128 x 128 in the
    published checkpoints)."""

    block: tuple[int, int] = (128, 128)

    def __post_init__(self) -> None:
        if len(self.block) != 2 or any(int(b) < 1 for b in self.block):
            raise ConfigError(f"FP8 block size {list(self.block)}: two positive integers (rows, columns)")

    @classmethod
    def of_config(cls, config: dict, where: str) -> BlockFp8 | None:
        """The format an HF ``config.json`` (``config``, read from ``where``) declares; None when it has
        no ``quantization_config``. Another method or layout is a ConfigError naming it."""
        quant = config.get("quantization_config")
        if quant is None:
            return None
        method, fmt = quant.get("quant_method"), quant.get("fmt", "e4m3")
        if method != "fp8" or fmt != "e4m3":
            raise ConfigError(
                f"{where}: quantization_config {{'quant_method': {method!r}, 'fmt': {fmt!r}}}: only block-wise "
                "'fp8' e4m3 is served from trained weights"
            )
        block = quant.get("weight_block_size")
        if block is None:
            raise ConfigError(f"{where}: quantization_config has no weight_block_size (per-tensor FP8 is not served)")
        if quant.get("scale_fmt") not in (None, "float32"):
            raise ConfigError(f"{where}: quantization_config scale_fmt {quant['scale_fmt']!r}: only float32 scales")
        return cls(tuple(int(b) for b in block))

    def config(self, kept_modules: Iterable[str]) -> dict:
        """The ``quantization_config`` of a folder in this format whose unquantized weights are those of
        ``kept_modules`` (module names)."""
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(self.block),
            "modules_to_not_convert": sorted(set(kept_modules)),
        }

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``weight [..., N, K]`` -> (``float8_e4m3fn [..., N, K]``, float32 ``scale_inv [..., ceil(N/bn),
        ceil(K/bk)]``), on the weight's device."""
        bn, bk = self.block
        *lead, n, k = weight.shape
        rows, cols = -(-n // bn), -(-k // bk)
        padded = torch.zeros((*lead, rows * bn, cols * bk), dtype=torch.float32, device=weight.device)
        padded[..., :n, :k] = weight  # zeros do not raise a block's amax
        blocks = padded.unflatten(-1, (cols, bk)).unflatten(-3, (rows, bn))  # [..., rows, bn, cols, bk]
        amax = blocks.abs().amax(dim=(-3, -1))  # [..., rows, cols]
        scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        quantized = (blocks / scale_inv[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        return quantized.flatten(-2).flatten(-3, -2)[..., :n, :k].contiguous(), scale_inv

    def dequantize(self, weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The inverse of ``quantize`` (up to e4m3's rounding): ``weight * scale_inv`` block by block, in
        float32, then ``dtype``. A scale grid that does not match the weight's shape is a
        WeightUpdateError."""
        bn, bk = self.block
        *lead, n, k = weight.shape
        want = (*lead, -(-n // bn), -(-k // bk))
        if tuple(scale_inv.shape) != want:
            raise WeightUpdateError(
                f"scale_inv of shape {tuple(scale_inv.shape)} for an FP8 weight of shape {tuple(weight.shape)} "
                f"in {bn} x {bk} blocks: expected {want}"
            )
        scale = scale_inv.to(torch.float32).repeat_interleave(bn, -2)[..., :n, :]
        scale = scale.repeat_interleave(bk, -1)[..., :k]
        return (weight.to(torch.float32) * scale).to(dtype)


def quantized(name: str, tensor: torch.Tensor) -> bool:
    """Whether the format stores this HF-named tensor in FP8: a decoder linear weight (2-D ``.weight``,
    or a 3-D fused expert tensor), not an embedding, the LM head, a norm, a router or the vision tower."""
    if tensor.dim() < 2 or not tensor.is_floating_point() or any(part in name for part in KEPT):
        return False
    if name.endswith(FUSED_EXPERTS):
        return tensor.dim() == 3
    return name.endswith(".weight") and tensor.dim() == 2 and not name.endswith("mlp.gate.weight")


def scale_name(name: str) -> str:
    """``X.weight`` -> ``X.weight_scale_inv``; ``...experts.gate_up_proj`` -> ``..._scale_inv``."""
    return name + SCALE_SUFFIX


def module_name(name: str) -> str:
    return name.removesuffix(".weight")


def quantize_stream(stream: Iterable[tuple[str, torch.Tensor]], fmt: BlockFp8) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors -> the same in ``fmt``: each quantized weight followed by its scale, the rest
    as they come."""
    for name, tensor in stream:
        if quantized(name, tensor):
            weight, scale_inv = fmt.quantize(tensor)
            yield name, weight
            yield scale_name(name), scale_inv
        else:
            yield name, tensor


def dequantize_named(named: dict[str, torch.Tensor], fmt: BlockFp8, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """HF-named tensors of an FP8 folder or update -> full-precision ones (``dtype`` for the FP8
    weights; the rest as they are). A weight in FP8 without its scale, or a scale without its weight, is
    a WeightUpdateError naming it; nothing is changed."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in named.items():
        if name.endswith(SCALE_SUFFIX):
            if name.removesuffix(SCALE_SUFFIX) not in named:
                raise WeightUpdateError(f"'{name}' scales no weight: '{name.removesuffix(SCALE_SUFFIX)}' is missing")
            continue
        if tensor.dtype == FP8_DTYPE:
            scale = named.get(scale_name(name))
            if scale is None:
                raise WeightUpdateError(f"weight '{name}' is float8_e4m3fn without its '{scale_name(name)}'")
            try:
                out[name] = fmt.dequantize(tensor, scale, dtype)
            except WeightUpdateError as e:
                raise WeightUpdateError(f"weight '{name}': {e}") from None
        else:
            out[name] = tensor
    return out


def folder_format(folder: str | Path) -> BlockFp8 | None:
    """The FP8 format a model folder's ``config.json`` declares (None: not quantized)."""
    path = Path(folder) / "config.json"
    return BlockFp8.of_config(json.loads(path.read_text()), str(path))


def convert_folder(source: str | Path, target: str | Path, fmt: BlockFp8) -> Path:
    """Write ``source`` (an HF model folder, full precision) as an FP8 folder at ``target``: every
    safetensors tensor through ``quantize_stream``, ``config.json`` with the ``quantization_config``,
    the other files (tokenizer, processor, generation config) copied. Written to a temporary folder
    beside ``target`` and renamed, so ``target`` is whole or absent. -> ``target``."""
    from safetensors import safe_open

    source, target = Path(source), Path(target)
    config = json.loads((source / "config.json").read_text())
    if config.get("quantization_config") is not None:
        raise ConfigError(f"{source}: already quantized ({config['quantization_config'].get('quant_method')})")
    tmp = target.parent / f".tmp_{target.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    writer, kept = ShardWriter(tmp, "model"), []

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for file in checkpoint_files(source):
            with safe_open(str(file), framework="pt") as opened:
                for name in opened.keys():
                    yield name, opened.get_tensor(name)

    for name, tensor in quantize_stream(tensors(), fmt):
        if tensor.dtype != FP8_DTYPE and name.endswith((".weight", *FUSED_EXPERTS)):  # biases ride with theirs
            kept.append(module_name(name))
        writer.add(name, tensor)
    writer.close()
    config["quantization_config"] = fmt.config(kept)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for path in source.iterdir():
        weights = path.name.endswith(".safetensors") or path.name == "model.safetensors.index.json"
        if path.is_file() and path.name != "config.json" and not weights:
            shutil.copy2(path, tmp / path.name)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    return target


def check_rollout_checkpoint(engine_cfg, hf_checkpoint: str) -> BlockFp8 | None:
    """The format of the folder the engines start from (``--rollout-checkpoint``, else
    ``hf_checkpoint``; ``engine_cfg``: the EngineConfig) -> None when it is in full precision. A folder
    in the other precision than ``--rollout-quantization`` says is a ConfigError naming both (the
    checkpoint to convert at start is the one exception: fp8 without a ``--rollout-checkpoint``)."""
    folder = engine_cfg.rollout_checkpoint or hf_checkpoint
    flag = "--rollout-checkpoint" if engine_cfg.rollout_checkpoint else "--hf-checkpoint"
    if not (Path(folder) / "config.json").is_file():
        raise ConfigError(f"{flag} {folder}: not a model folder (no config.json)")
    fmt = folder_format(folder)
    if engine_cfg.rollout_quantization == "none" and fmt is not None:
        raise ConfigError(
            f"{flag} {folder} is FP8 ({fmt.block[0]} x {fmt.block[1]} blocks): the engines would serve it and "
            "take the trainer's full-precision weights; add --rollout-quantization fp8"
        )
    if engine_cfg.rollout_quantization == "fp8" and engine_cfg.rollout_checkpoint and fmt is None:
        raise ConfigError(
            f"--rollout-checkpoint {folder}: not FP8 (its config.json has no quantization_config); convert it "
            "(slime-mt convert-fp8) or leave the flag out to convert --hf-checkpoint at start"
        )
    return fmt


def rollout_checkpoint(engine_cfg, hf_checkpoint: str, run_dir: Path) -> tuple[str, BlockFp8 | None]:
    """The folder the engines start from and the format every weight update takes (None: the trainer's
    precision), checked by ``check_rollout_checkpoint``. Under fp8 without a ``--rollout-checkpoint``,
    ``hf_checkpoint`` is converted into ``run_dir/rollout_checkpoint`` (again at every start: the
    trainer's weights reach it at the first update anyway)."""
    fmt = check_rollout_checkpoint(engine_cfg, hf_checkpoint)
    folder = engine_cfg.rollout_checkpoint or hf_checkpoint
    if engine_cfg.rollout_quantization == "none" or fmt is not None:
        return str(folder), fmt
    block = BlockFp8(tuple(engine_cfg.rollout_quantization_block_size))
    target = convert_folder(hf_checkpoint, Path(run_dir) / "rollout_checkpoint", block)
    return str(target), block
