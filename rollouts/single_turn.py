"""A single-turn generate function (``--custom-generate-function-path rollouts.single_turn.generate``):
one engine call, no environment; the reward comes from ``--custom-rm-path``."""

import dataclasses

from slime_mt.rollout.multi_turn import run_episode
from slime_mt.types import Sample


async def generate(args, sample: Sample, sampling_params: dict) -> Sample:
    ctx = args.rollout_context
    single = dataclasses.replace(ctx, rollout=dataclasses.replace(ctx.rollout, max_turns=1))
    return await run_episode(single, sample, sampling_params, env=None)
