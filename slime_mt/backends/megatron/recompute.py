"""Activation recompute (``--recompute-granularity``, ``--recompute-method``, ``--recompute-num-layers``,
``--recompute-modules``): Megatron's own, through its ``TransformerConfig``.

Megatron recomputes through ``tensor_parallel.checkpoint``, which keeps its arguments with
``save_for_backward``, so every argument must be a tensor. This trainer's fused attention takes a
packed row's layout (``Segments``, ``Tree``) as its attention mask, a plain object;
``allow_layouts_in_checkpoints`` wraps Megatron's checkpoint so that such arguments ride in the
recomputed function's closure instead (they are read, never differentiated). What a layer reads
from outside its arguments at forward time must still hold when its backward recomputes it: the
MoE layers keep the row's replayed routes until the next forward (``moe.py``), and count routes and
loads only outside a backward pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_WRAPPED = False


@dataclass(frozen=True)
class Recompute:
    """Which activations the backward pass recomputes (Megatron's names). ``granularity`` ``full``
    recomputes whole layers (``method`` ``uniform``: chunks of ``num_layers`` layers, only each
    chunk's input kept; ``block``: the first ``num_layers`` layers), ``selective`` the ``modules``
    only (Megatron's default: the core attention); None keeps every activation."""

    granularity: str | None = None
    method: str | None = None
    num_layers: int | None = None
    modules: tuple[str, ...] | None = None

    @classmethod
    def of(cls, train) -> Recompute:
        """The recompute a ``TrainConfig`` sets."""
        modules = train.recompute_modules
        return cls(
            train.recompute_granularity,
            train.recompute_method,
            train.recompute_num_layers,
            None if modules is None else tuple(modules),
        )

    def config_kwargs(self) -> dict:
        """Megatron ``TransformerConfig`` fields (none without recompute)."""
        if self.granularity is None:
            return {}
        allow_layouts_in_checkpoints()
        modules = {} if self.modules is None else {"recompute_modules": list(self.modules)}
        return dict(
            recompute_granularity=self.granularity,
            recompute_method=self.method,
            recompute_num_layers=self.num_layers,
            **modules,
        )


def allow_layouts_in_checkpoints() -> None:
    """Let ``tensor_parallel.checkpoint`` take arguments that are not tensors (once per process; see
    the module docstring). Every Megatron module calls it through the package attribute."""
    global _WRAPPED
    if _WRAPPED:
        return
    from megatron.core import tensor_parallel

    tensor_parallel.checkpoint = _with_fixed_objects(tensor_parallel.checkpoint)
    _WRAPPED = True


def _with_fixed_objects(checkpoint):
    def wrapped(function, distribute_saved_activations, *args):
        fixed = {i: a for i, a in enumerate(args) if a is not None and not torch.is_tensor(a)}
        if not fixed:
            return checkpoint(function, distribute_saved_activations, *args)
        tensors = [a for i, a in enumerate(args) if i not in fixed]

        def run(*given):
            rest = iter(given)
            return function(*[fixed[i] if i in fixed else next(rest) for i in range(len(args))])

        return checkpoint(run, distribute_saved_activations, *tensors)

    return wrapped


def in_backward() -> bool:
    """Whether this code runs inside an autograd backward pass (a recomputed forward)."""
    return torch._C._current_graph_task_id() != -1
