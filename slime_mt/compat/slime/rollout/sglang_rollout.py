"""slime.rollout.sglang_rollout: ``GenerateState`` (the run's tokenizer, processor, semaphore and
sampling params), ``get_model_url``, and ``generate_and_rm`` / ``generate_and_rm_group``, which run
samples through the run's generate and reward functions (slime_mt's ``run_group``)."""

from __future__ import annotations

import asyncio
import contextlib

from slime_mt.compat.run_state import active
from slime_mt.compat.slime.utils.processing_utils import hf_style

__all__ = ["GenerateState", "generate_and_rm", "generate_and_rm_group", "get_model_url"]


class GenerateState:
    """One per run (slime's singleton)."""

    def __new__(cls, args=None):
        compat = active()
        if compat.state is None:
            state = super().__new__(cls)
            state._build(compat)
            compat.state = state
        return compat.state

    def __init__(self, args=None):
        pass

    def _build(self, compat) -> None:
        ctx = compat.ctx
        self.args = ctx.args
        self.tokenizer = ctx.tokenizer
        self.processor = hf_style(ctx.processor)
        self.semaphore = asyncio.Semaphore(ctx.rollout.rollout_concurrency)
        self.sampling_params = ctx.sampling_params()
        self.plugins = None  # (generate, reward) of the run, loaded by the first generate_and_rm_group
        self.reset()

    def reset(self) -> None:
        self.remaining_batch_size = 0
        self.pendings = set()
        self.aborted = False

    @contextlib.contextmanager
    def dp_rank_context(self):
        yield 0


def get_model_url(args, model_name: str = "", endpoint: str = "/generate") -> str:
    return f"http://{args.sglang_router_ip}:{args.sglang_router_port}{endpoint}"


async def generate_and_rm_group(args, group, sampling_params, evaluation: bool = False):
    """Every sample of a group through the run's generate function, then its reward; at most
    ``--rollout-concurrency`` samples generate at once over every group (``GenerateState.semaphore``)."""
    from slime_mt.rollout.group_rollout import load_plugins, run_group

    state = GenerateState(args)
    if state.plugins is None:
        state.plugins = load_plugins(active().ctx.rollout)[:2]
    generate, rm = state.plugins
    return await run_group(
        active().ctx, list(group), generate, rm, sampling_params, state.semaphore, evaluation=evaluation
    )


async def generate_and_rm(args, sample, sampling_params, evaluation: bool = False):
    results = await generate_and_rm_group(args, [sample], sampling_params, evaluation)
    return results[0] if len(results) == 1 else results
