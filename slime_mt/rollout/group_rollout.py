"""Default ``--rollout-function-path``: prompt groups -> trajectories -> rewards -> kept groups.

``generate_rollout(args, rollout_id, data_source, evaluation=False) -> list[list[Sample]]`` (slime's
contract). Each prompt becomes ``n_samples_per_prompt`` samples sharing ``group_index``; every sample
runs through ``--custom-generate-function-path`` with at most ``rollout_concurrency`` in flight; the
reward comes from ``--custom-rm-path`` (async, float or dict read at ``--reward-key``), a built-in
grader (``--rm-type``), or the env's ``info["reward"]``; FAILED samples get reward 0 and are marked
(advantages leave them out). With ``--slime-compat`` the sample reaches the generate function as slime
hands it over (no tokens) and is adopted afterwards (``slime_mt.compat``).
With ``--dynamic-sampling-filter-path``, groups the filter rejects are dropped and more prompts are
drawn (``--over-sampling-batch-size`` per round) until ``rollout_batch_size`` groups are kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
from typing import Any

from tqdm import tqdm

from slime_mt.engine.clients.priority import set_rank
from slime_mt.errors import PluginError, RolloutError
from slime_mt.plugins import load_function
from slime_mt.rollout.context import RolloutContext
from slime_mt.rollout.failures import fail
from slime_mt.rollout.rewards import overlong_penalty, rule_based_rm
from slime_mt.timeline import current_lane, maybe_span, now_us, sample_lane
from slime_mt.types import Sample, Status

MAX_OVERSAMPLING_ROUNDS = 16


def _expected_rollout(args, rollout_id, data_source, evaluation=False):
    """Contract of --rollout-function-path."""


async def _expected_generate(args, sample, sampling_params):
    """Contract of --custom-generate-function-path."""


async def _expected_rm(args, sample):
    """Contract of --custom-rm-path."""


def _expected_filter(args, samples):
    """Contract of --dynamic-sampling-filter-path."""


def generate_rollout(args, rollout_id: int, data_source, evaluation: bool = False) -> list[list[Sample]]:
    """slime's rollout contract, synchronous: runs the async rollout on the run's event loop."""
    ctx: RolloutContext = args.rollout_context
    return ctx.run_sync(rollout_groups(ctx, data_source, evaluation, rollout_id))


def rollout_output(output) -> tuple[list[list[Sample]], dict[str, float]]:
    """What a rollout function returned -> (groups, metrics to log with the step): a list of groups,
    or slime's ``RolloutFnTrainOutput(samples, metrics)``."""
    if isinstance(output, list):
        groups, metrics = output, {}
    elif hasattr(output, "samples"):
        groups, metrics = output.samples, {k: float(v) for k, v in (output.metrics or {}).items()}
    else:
        raise PluginError(
            f"--rollout-function-path returned a {type(output).__name__}; expected list[list[Sample]] "
            "or RolloutFnTrainOutput(samples, metrics)"
        )
    _check_nesting(groups)
    for sample in (s for g in groups for s in g):
        if isinstance(sample.reward, (int, float)) and not math.isfinite(sample.reward):
            fail(
                sample,
                "reward not finite",
                f"the rollout function gave the reward {sample.reward} (not a finite number)",
            )
            sample.reward = 0.0
    return groups, metrics


def _check_nesting(groups) -> None:
    """A rollout function's groups are a list of lists of Samples; anything else is named, with the fix."""
    expected = "expected list[list[Sample]]: one list per prompt, of its samples (those sharing a group_index)"
    if not isinstance(groups, list):
        raise PluginError(f"--rollout-function-path returned samples as a {type(groups).__name__}; {expected}")
    for g, group in enumerate(groups):
        if isinstance(group, Sample):
            raise PluginError(
                f"--rollout-function-path returned a flat list: item {g} is a Sample, not a group; {expected}"
            )
        if not isinstance(group, list):
            raise PluginError(f"--rollout-function-path: group {g} is a {type(group).__name__}; {expected}")
        for k, sample in enumerate(group):
            if not isinstance(sample, Sample):
                raise PluginError(
                    f"--rollout-function-path: item {k} of group {g} is a {type(sample).__name__}, not a Sample "
                    f"(nested one level too deep?); {expected}"
                )


def load_plugins(r, evaluation: bool = False) -> tuple:
    """The run's generate function, reward function (``--custom-rm-path``, else the ``--rm-type``
    grader, else None) and group filter (None when unset or evaluating)."""
    generate = load_function(r.custom_generate_function_path, _expected_generate, "--custom-generate-function-path")
    rm = load_function(r.custom_rm_path, _expected_rm, "--custom-rm-path") if r.custom_rm_path else None
    if rm is None and r.rm_type:
        rm = rule_based_rm
    keep = None
    if r.dynamic_sampling_filter_path and not evaluation:
        keep = load_function(r.dynamic_sampling_filter_path, _expected_filter, "--dynamic-sampling-filter-path")
    return generate, rm, keep


async def rollout_groups(
    ctx: RolloutContext, data_source, evaluation: bool = False, rollout_id: int | None = None
) -> list[list[Sample]]:
    r = ctx.rollout
    generate, rm, keep = load_plugins(r, evaluation)
    semaphore = asyncio.Semaphore(r.rollout_concurrency)
    sampling_params = ctx.sampling_params()
    target = r.rollout_batch_size
    kept: list[list[Sample]] = []
    rounds = 0
    with tqdm(
        total=target * r.n_samples_per_prompt, desc="rollout", mininterval=1.0, leave=False, disable=None
    ) as bar:  # None: only on a terminal, not in logs
        while len(kept) < target:
            rounds += 1
            if rounds > MAX_OVERSAMPLING_ROUNDS:
                raise RolloutError(
                    f"--dynamic-sampling-filter-path {r.dynamic_sampling_filter_path} kept only "
                    f"{len(kept)} of {target} groups after {MAX_OVERSAMPLING_ROUNDS} rounds"
                )
            draw = target - len(kept) if keep is None else max(r.over_sampling_batch_size or target, target - len(kept))
            groups = data_source.get_samples(draw)
            if rollout_id is not None:
                for s in (s for g in groups for s in g):
                    s.metadata["rollout_id"] = rollout_id
            done = await asyncio.gather(
                *(run_group(ctx, g, generate, rm, sampling_params, semaphore, bar, evaluation) for g in groups)
            )
            for group in done:
                if keep is None or kept_by_filter(keep(ctx.args, group)):
                    kept.append(group)
                else:
                    for s in group:
                        s.metadata["filtered"] = True
    return kept[:target]


def kept_by_filter(verdict: Any) -> bool:
    return bool(getattr(verdict, "keep", verdict))


async def run_group(
    ctx, group: list[Sample], generate, rm, sampling_params, semaphore, bar=None, evaluation: bool = False
) -> list[Sample]:
    """Every sample of a group through ``generate`` (at most ``semaphore`` at once), then its reward.
    Before the call the sample's prompt is encoded into ``sample.tokens``; a generate function that
    takes ``evaluation`` gets it (slime's keyword). Under ``--rollout-num-processes`` the group runs so
    in one of the rollout processes (``rollout_workers.py``) and its finished samples come back."""
    if ctx.rollout_workers is not None:
        done = await ctx.rollout_workers.run_group(group, sampling_params, evaluation, ctx.start_version)
        if bar is not None:
            bar.update(len(group))
        return done

    with_evaluation = "evaluation" in inspect.signature(generate).parameters

    async def one(sample: Sample) -> Sample:
        lane = ("eval " if evaluation else "") + sample_lane(sample)
        current_lane.set(lane)  # this task's engine calls and env steps land on its trajectory's lane
        # this task's engine requests rank by their group's age, an evaluation's after every other
        set_rank(
            ctx.priority_scheduling, ctx.rollout.oldest_groups_first, sample.metadata.get("start_version"), evaluation
        )
        async with semaphore:
            started = now_us()
            result = await _generate(ctx, generate, sample, sampling_params, evaluation if with_evaluation else None)
        results = result if isinstance(result, list) else [result]
        for s in results:
            if ctx.compat is not None:
                ctx.compat.adopt(s)
            settle_status(s)
            with maybe_span(ctx.timeline, "reward", "reward"):
                await _assign_reward(ctx, s, rm, shape=not evaluation)
        if ctx.timeline is not None:
            status = results[0].status
            ctx.timeline.add(
                "sample",
                started,
                now_us(),
                lane,
                "sample",
                status=str(getattr(status, "value", status)),
                turns=len(results[0].turns),
                evaluation=evaluation,
            )
        if bar is not None:
            bar.update(1)
        return results

    nested = await asyncio.gather(*(one(s) for s in group))
    return [s for results in nested for s in results]


async def _generate(ctx, generate, sample: Sample, sampling_params, evaluation: bool | None):
    """``generate`` on a sample whose prompt is encoded first (not under ``--slime-compat``: slime hands
    the sample over without tokens); what raises fails this sample only."""
    try:
        if ctx.compat is None:
            ctx.prepare_prompt(sample)
    except Exception as e:
        fail(sample, f"prompt encoding raised {type(e).__name__}", f"encoding the prompt: {e}", e)
        return sample
    try:
        extra = {} if evaluation is None else {"evaluation": evaluation}
        with ctx.compat.generating(sample) if ctx.compat is not None else contextlib.nullcontext():
            return await generate(ctx.args, sample, dict(sampling_params), **extra)
    except Exception as e:
        fail(sample, f"generate raised {type(e).__name__}", f"generate raised {type(e).__name__}: {e}", e)
        return sample
    finally:
        ctx.take_prompt_encoding(sample)


def settle_status(sample: Sample) -> None:
    """A sample a generate function returned still PENDING ends COMPLETED, or TRUNCATED when its last
    turn hit the length limit (slime's generate sets the status itself; custom ones often do not)."""
    if sample.status != Status.PENDING:
        return
    if sample.turns and sample.turns[-1].finish_reason == "length":
        sample.status = Status.TRUNCATED
        sample.metadata.setdefault("termination", "engine_length")
    else:
        sample.status = Status.COMPLETED


async def _assign_reward(ctx, sample: Sample, rm, shape: bool = True) -> None:
    """The reward function's value; without one, the reward the generate function set, else the env's
    ``info["reward"]``, else 0 (``--slime-compat``: slime's order, a reward already set is kept and the
    reward function runs only without one). FAILED samples get 0. ``shape`` (training, not evaluation):
    add the over-long penalty (``--overlong-buffer-len``), kept in ``metadata["overlong_penalty"]``."""
    if sample.status == Status.FAILED:
        sample.reward = 0.0
        return
    try:
        if rm is not None and not (ctx.compat is not None and sample.reward is not None):
            value, source = await rm(ctx.args, sample), "the reward function"
        elif sample.reward is not None:
            value, source = sample.reward, "the generate function"
        else:
            value, source = sample.metadata.get("env_reward", 0.0), "the environment's info['reward']"
        if isinstance(value, dict):
            key = ctx.rollout.reward_key
            if key is None or key not in value:
                raise RolloutError(f"reward function returned a dict {sorted(value)}; set --reward-key to one of them")
            sample.metadata["reward_dict"] = value
            value = value[key]
        if not math.isfinite(float(value)):  # a NaN or infinite reward trains nothing sound: the sample fails
            fail(sample, "reward not finite", f"{source} gave the reward {float(value)} (not a finite number)")
            sample.reward = 0.0
            return
        sample.reward = float(value)
        r = ctx.rollout
        if shape and r.overlong_buffer_len:
            penalty = overlong_penalty(
                sample.generated_tokens, r.overlong_lmax, r.overlong_buffer_len, r.overlong_penalty_factor
            )
            sample.metadata["overlong_penalty"] = penalty
            sample.reward += penalty
    except RolloutError:
        raise
    except Exception as e:
        fail(sample, f"reward raised {type(e).__name__}", f"reward raised {type(e).__name__}: {e}", e)
        sample.reward = 0.0
