"""Default ``--custom-generate-function-path``: the multi-turn loop against the env of
``--rollout-interaction-env-path`` (``slime_mt.rollout.multi_turn.run_episode``)."""

from slime_mt.rollout.multi_turn import run_episode
from slime_mt.types import Sample


async def generate(args, sample: Sample, sampling_params: dict) -> Sample:
    """One trajectory for ``sample``; the run's RolloutContext travels on ``args.rollout_context``."""
    return await run_episode(args.rollout_context, sample, sampling_params)
