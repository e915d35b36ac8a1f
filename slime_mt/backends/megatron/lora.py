"""LoRA adapters on Megatron's parallel linear layers (``--lora-rank``): ``y = W x + (alpha / r) B A x`` beside
each targeted layer, the base frozen and out of the optimizer, A and B sharded as the layer's weight is.

Megatron-Bridge's PEFT was the first choice; its wheel (0.3.1) requires Transformer Engine's CUDA 13 build,
mamba-ssm, causal-conv1d and transformers < 5, none of which installs beside the CPU torch and the
transformers this project runs, so the adapters are written here (the layouts follow what Bridge and miles
do; the code is ours).

A column-parallel layer (``linear_qkv``, ``linear_fc1``: the output dim split over TP) gets a whole A
``[r, in]`` on every rank and its slice of B ``[out / tp, r]``; a row-parallel one (``linear_proj``,
``linear_fc2``: the input dim split) its slice of A ``[r, in / tp]`` and a whole B ``[out, r]``. The
communication mirrors the base layer's:

- column, no SP: ``h = x A^T`` on every rank, its gradient all-reduced over TP (``copy_to``), so A's gradient
  and the input's are whole on every rank, as the base layer's input gradient is;
- column, SP: the sequence-sharded input gathered first (its backward reduce-scatters), A's gradient summed
  over TP by ``finalize_model_grads`` (``A.sequence_parallel``);
- row: ``h = x_i A_i^T`` all-reduced over TP (rank ``r``, not the output's width), ``y = h B^T`` on every rank,
  scattered along the sequence under SP as the base layer's output is.

B starts at zero, so a model with fresh adapters computes exactly what its base does; A is drawn from one
generator per layer seeded by the layer's name, whole, then sliced: every TP layout starts from the same A.
Q, K and V are one fused layer in Megatron (gate and up too): an adapter on ``linear_qkv`` is PEFT's q, k
and v adapters with one A shared by the three.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from slime_mt.config.training import LORA_LAYERS, lora_targets
from slime_mt.errors import ConfigError

# Megatron's parallel linear layers an adapter can sit beside, and whether each splits its output over TP
COLUMN, ROW = "column", "row"
LAYER_KINDS = {"linear_qkv": COLUMN, "linear_fc1": COLUMN, "linear_proj": ROW, "linear_fc2": ROW}


@dataclass(frozen=True)
class LoraOptions:
    """What ``--lora-rank``, ``--lora-alpha``, ``--lora-dropout`` and the resolved ``--target-modules``
    ask of a model's build."""

    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]  # Megatron layer names (LAYER_KINDS' keys)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def of(cls, train) -> LoraOptions | None:
        """The options of a ``TrainConfig`` (None when ``--lora-rank`` is 0)."""
        if not train.lora_rank:
            return None
        targets = lora_targets(train.target_modules, train.exclude_modules)
        return cls(train.lora_rank, float(train.lora_alpha), float(train.lora_dropout), targets)


MLP_LAYERS = ("linear_fc1", "linear_fc2")  # an MoE layer's are its experts, which take no adapters yet


def projection_widths(spec) -> dict[str, tuple[int, int]]:
    """(input, output) width of each HF projection an adapter can sit beside, in a dense layer of ``spec``."""
    h, q, kv, ffn = (
        spec.hidden_size,
        spec.num_heads * spec.head_dim,
        spec.num_kv_heads * spec.head_dim,
        spec.ffn_hidden_size,
    )
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, ffn),
        "up_proj": (h, ffn),
        "down_proj": (ffn, h),
    }


def layer_widths(spec) -> dict[str, tuple[int, int]]:
    """(input, output) width of each Megatron layer an adapter can sit beside: the input of the projections
    it fuses (they share it) and the sum of their outputs."""
    widths = projection_widths(spec)
    return {
        layer: (widths[projections[0]][0], sum(widths[p][1] for p in projections))
        for layer, projections in LORA_LAYERS.items()
    }


def adapted_layers(spec, targets: tuple[str, ...], layer: int) -> tuple[str, ...]:
    """The ``targets`` decoder layer ``layer`` of ``spec`` has adapters on (a MoE layer's MLP has none)."""
    sparse = spec.moe is not None and spec.moe.sparse_layers[layer]
    return tuple(t for t in targets if not (sparse and t in MLP_LAYERS))


def check_targets(spec, options: LoraOptions, model: str) -> None:
    """Before a run: the layers ``--target-modules`` names exist in every layer they must be in (a MoE
    layer's MLP is experts, which take no adapters yet) and ``--lora-rank`` is below each one's smaller
    dimension; ConfigError naming the flag, the model and the fix otherwise."""
    sparse = [i for i in range(spec.num_layers) if adapted_layers(spec, options.targets, i) != options.targets]
    if sparse:
        raise ConfigError(
            f"--target-modules: the MLPs of {len(sparse)} of the {spec.num_layers} layers of {model} are experts, "
            "which take no LoRA adapters yet (its layers have q_proj, k_proj, v_proj, o_proj; gate_proj, "
            "up_proj, down_proj only where dense): add --exclude-modules gate_proj,up_proj,down_proj"
        )
    widths = layer_widths(spec)
    smallest = min(min(widths[t]) for t in options.targets)
    if options.rank > smallest:
        raise ConfigError(
            f"--lora-rank {options.rank}: larger than the smallest dimension of an adapted layer of {model} "
            f"({smallest}); a rank above it adds nothing a full-rank update would not"
        )


def rank_elements(spec, options: LoraOptions, tp: int, layers: range) -> int:
    """Elements of one TP rank's adapters on decoder ``layers``: A and B sharded as their layer is (a
    column layer's A whole and B split, a row layer's A split and B whole)."""
    widths, r, total = layer_widths(spec), options.rank, 0
    for i in layers:
        for t in adapted_layers(spec, options.targets, i):
            fan_in, fan_out = widths[t]
            total += r * fan_in + fan_out * r // tp if LAYER_KINDS[t] == COLUMN else r * fan_in // tp + fan_out * r
    return total


def _initial_a(name: str, rank: int, fan_in: int) -> torch.Tensor:
    """A layer's whole A as PEFT initialises it (Kaiming-uniform with a = sqrt(5): U(-1/sqrt(in), 1/sqrt(in))),
    from a generator seeded by the layer's name, so every rank and every layout draws the same."""
    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    generator = torch.Generator().manual_seed(seed)
    bound = 1.0 / math.sqrt(fan_in)
    return torch.rand(rank, fan_in, generator=generator, dtype=torch.float32) * (2 * bound) - bound


class LoraAdapter(torch.nn.Module):
    """The adapter beside one parallel linear layer: ``lora_A`` and ``lora_B`` (this rank's shards) and the
    forward that computes ``scale * B A x``, which the layer's forward hook adds to its output."""

    def __init__(
        self, name: str, base: torch.nn.Module, kind: str, options: LoraOptions, tp: tuple[int, int], sp: bool
    ):
        super().__init__()
        from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

        tp_rank, tp_size = tp
        weight = base.weight
        out_local, in_local = weight.shape
        self.kind, self.scale, self.sp, self.tp_size = kind, options.scale, sp and tp_size > 1, tp_size
        self.enabled = True  # False inside ``adapters_off``
        self.dropout = torch.nn.Dropout(options.dropout) if options.dropout > 0 else torch.nn.Identity()
        fan_in = in_local if kind == COLUMN else in_local * tp_size
        a = _initial_a(name, options.rank, fan_in)
        if kind == ROW:
            a = a[:, tp_rank * in_local : (tp_rank + 1) * in_local]
        self.lora_A = torch.nn.Parameter(a.to(device=weight.device, dtype=weight.dtype).contiguous())
        self.lora_B = torch.nn.Parameter(torch.zeros(out_local, options.rank, device=weight.device, dtype=weight.dtype))
        sharded, replicated = (self.lora_B, self.lora_A) if kind == COLUMN else (self.lora_A, self.lora_B)
        if tp_size > 1:
            # counted once per rank in the grad norm; the replicated factor counts on TP rank 0 only
            set_tensor_model_parallel_attributes(sharded, True, 0 if kind == COLUMN else 1, 1)
            if kind == COLUMN and self.sp:
                replicated.sequence_parallel = True  # its gradient summed over TP by finalize_model_grads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``scale * B A x`` for the layer's input ``x``, laid out as the layer's output is."""
        from megatron.core import tensor_parallel as mp

        if self.kind == COLUMN:
            if self.sp:
                x = mp.gather_from_sequence_parallel_region(x)
                h = torch.nn.functional.linear(self.dropout(x), self.lora_A)
            else:
                h = torch.nn.functional.linear(self.dropout(x), self.lora_A)
                h = mp.copy_to_tensor_model_parallel_region(h) if self.tp_size > 1 else h
            return torch.nn.functional.linear(h, self.lora_B) * self.scale
        h = torch.nn.functional.linear(self.dropout(x), self.lora_A)
        h = mp.reduce_from_tensor_model_parallel_region(h) if self.tp_size > 1 else h
        y = torch.nn.functional.linear(h, self.lora_B) * self.scale
        return mp.scatter_to_sequence_parallel_region(y) if self.sp else y

    def merged(self, weight: torch.Tensor) -> torch.Tensor:
        """This rank's shard of ``W + scale * B A`` (the layer's weight with the adapter folded in)."""
        delta = (self.lora_B.detach().float() @ self.lora_A.detach().float()) * self.scale
        return (weight.detach().float() + delta).to(weight.dtype)


def _add_adapter_output(module, args, output):
    """Forward hook of an adapted layer: its output plus the adapter's, the bias untouched (the output
    alone while the adapters are off: ``adapters_off``)."""
    if not module.lora.enabled:
        return output
    out, bias = output
    return out + module.lora(args[0]), bias


@contextlib.contextmanager
def adapters_off(adapters: dict[str, LoraAdapter]) -> Iterator[None]:
    """The model computes what its base does while inside (every adapter skipped, on every rank alike, so
    no collective of theirs runs): the KL reference of a LoRA run is its own base, not a second copy."""
    for adapter in adapters.values():
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter in adapters.values():
            adapter.enabled = True


def _seed_name(name: str, first_layer: int) -> str:
    """A module's name with its layer numbered as in the whole model (a pipeline stage numbers from 0)."""
    return re.sub(r"layers\.(\d+)\.", lambda m: f"layers.{int(m.group(1)) + first_layer}.", name, count=1)


def add_adapters(
    decoder: torch.nn.Module, options: LoraOptions, tp: tuple[int, int], sp: bool, first_layer: int = 0
) -> dict[str, LoraAdapter]:
    """Adapters beside every targeted parallel linear layer of ``decoder`` (each registered as the layer's
    ``lora`` child, its output added by a forward hook). ``first_layer``: the
    whole model's index of the decoder's first layer (a pipeline stage's), so that every layout seeds the
    same A. Returns {module name: adapter}. A layer of a MoE layer's experts, or one with Transformer
    Engine's fused layer norm, is refused by name."""
    adapters = {}
    for name, module in decoder.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in options.targets:
            continue
        if ".experts." in name:
            raise ValueError(f"{name}: LoRA on experts is not implemented yet; target the attention projections")
        if hasattr(module, "return_layernorm_output"):
            raise ValueError(
                f"{name}: LoRA beside Transformer Engine's fused layer norm and linear is not tested yet; "
                "use --transformer-impl local"
            )
        module.lora = LoraAdapter(_seed_name(name, first_layer), module, LAYER_KINDS[leaf], options, tp, sp)
        module.register_forward_hook(_add_adapter_output)
        adapters[name] = module.lora
    if not adapters:
        raise ValueError(f"--target-modules {', '.join(options.targets)}: the model has no such layer")
    return adapters


def freeze_all_but_adapters(module: torch.nn.Module) -> None:
    """Every parameter of ``module`` frozen but the adapters' (the base never reaches the optimizer)."""
    for name, param in module.named_parameters():
        param.requires_grad_(".lora." in f".{name}")


def merged_state(state: dict[str, torch.Tensor], adapters: dict[str, LoraAdapter]) -> dict[str, torch.Tensor]:
    """A decoder state with each adapted layer's weight shard replaced by ``W + scale * B A`` (what the
    engines serve until they load adapters of their own)."""
    merged = dict(state)
    for name, adapter in adapters.items():
        merged[f"{name}.weight"] = adapter.merged(state[f"{name}.weight"])
    return merged
