"""The Megatron-core backend: parallel state, models, conversion, log-probs, packing, the actor."""

from __future__ import annotations

import functools
import sys
from types import ModuleType


def import_megatron_core() -> ModuleType:
    """megatron.core, imported (once) with its fused kernels' ``torch.compile`` deferred to their first call.

    megatron-core wraps its fusions in ``torch.compile`` as its modules load, which imports TorchDynamo
    and Inductor (about 1.5 s of CPU in every process) whether or not a fused kernel ever runs.
    ``torch.compile`` compiles at a function's first call in any case; making its wrapper at that call
    changes nothing else (on CUDA the fusions compile as before)."""
    if "megatron.core" in sys.modules:
        return sys.modules["megatron.core"]
    import torch

    real = torch.compile
    torch.compile = _deferred(real)
    try:
        import megatron.core
    finally:
        torch.compile = real
    return megatron.core


def _deferred(compile_fn):
    def deferred_compile(model=None, **options):
        if model is None:  # @torch.compile(mode=...) form
            return lambda fn: deferred_compile(fn, **options)
        compiled = None

        @functools.wraps(model)
        def compiled_at_first_call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = compile_fn(model, **options)
            return compiled(*args, **kwargs)

        return compiled_at_first_call

    return deferred_compile
