"""An episode's calls into its environment: steps retried on transient faults, resets retried, and
recovery from faults that lose the environment's state.

Three kinds of fault, three answers (``slime_mt/environment.py`` states the contract):

  RetryableEnvError, a step timeout, info["retryable"]   the same step again, at most
                                                          --max-env-retries-per-turn times
  RecoverableEnvError (from step or reset), a failing    env.reset(), then the episode's actions so far
  reset()                                                 replayed in order; an env that cannot replay
                                                          (``replayable = False``), or a replay that
                                                          answers otherwise than the model saw, restarts
                                                          the episode from its prompt. At most
                                                          --max-env-resets per sample
  anything else, or a budget spent                        EnvStepFailed: the sample is FAILED with its
                                                          cause (left out of its group's statistics)

``sample.metadata`` counts what happened: ``env_retry_causes`` and ``env_reset_causes`` (exception
type -> count), ``env_resets`` and ``episode_restarts``.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

from slime_mt.engine.http import within
from slime_mt.environment import opening_of, opening_text
from slime_mt.errors import EnvStepFailed, EpisodeRestart, InvalidActionError, RecoverableEnvError, RetryableEnvError
from slime_mt.rollout.context import RolloutContext
from slime_mt.timeline import maybe_span
from slime_mt.types import Sample


async def call_env(ctx: RolloutContext, fn, *args) -> Any:
    """Call a sync or async env method; sync ones run on the env thread pool, off the event loop."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    result = await asyncio.get_running_loop().run_in_executor(ctx.env_executor, fn, *args)
    return await result if inspect.isawaitable(result) else result


def _count(metadata: dict | None, key: str, name: str) -> None:
    if metadata is not None:
        counts = metadata.setdefault(key, {})
        counts[name] = counts.get(name, 0) + 1


async def step_with_retries(
    ctx: RolloutContext, env, text: str, metadata: dict | None = None
) -> tuple[dict, bool, dict, int]:
    """``env.step(text)`` retried on RetryableEnvError, timeouts and ``info["retryable"]``
    -> (observation, done, info, retries). Raises EnvStepFailed past the budget or on other errors;
    RecoverableEnvError goes to the caller (``EpisodeEnv`` resets). ``metadata``: where the retries
    are counted by cause (``env_retry_causes``)."""
    with maybe_span(ctx.timeline, "env.step", "env") as span:
        observation, done, info, retries = await _attempts(ctx, env, text, metadata)
        span.update(retries=retries, done=done)
    return observation, done, info, retries


async def _attempts(ctx: RolloutContext, env, text: str, metadata: dict | None) -> tuple[dict, bool, dict, int]:
    budget = ctx.rollout.max_env_retries_per_turn
    timeout = ctx.rollout.env_step_timeout
    last = ""
    for attempt in range(budget + 1):
        try:
            result = await within(call_env(ctx, env.step, text), timeout)
        except RetryableEnvError as e:
            last = f"{type(e).__name__}: {e}"
            _count(metadata, "env_retry_causes", type(e).__name__)
            continue
        except asyncio.TimeoutError:
            last = f"env step timed out after {timeout}s"
            _count(metadata, "env_retry_causes", "timeout")
            continue
        except InvalidActionError as e:  # the model's fault, not the env's: its feedback answers the turn
            return e.observation, False, {"invalid_action": True}, attempt
        except RecoverableEnvError:
            raise
        except Exception as e:
            raise EnvStepFailed(
                f"env step raised {type(e).__name__}: {e}", attempt, f"env step raised {type(e).__name__}"
            ) from e
        if not (
            isinstance(result, tuple)
            and len(result) == 3
            and isinstance(result[0], dict)
            and isinstance(result[2], dict)
        ):
            raise EnvStepFailed(
                f"env step must return (observation: dict, done: bool, info: dict), got {result!r:.200}",
                attempt,
                "bad env return",
            )
        observation, done, info = result
        if info.get("retryable"):
            last = f"env marked the step retryable: {info.get('error', info)}"
            _count(metadata, "env_retry_causes", "info_retryable")
            continue
        return observation, bool(done), info, attempt
    raise EnvStepFailed(
        f"env step failed {budget + 1} times (--max-env-retries-per-turn {budget}); last: {last}",
        budget,
        "env step failed past its retries",
    )


class EpisodeEnv:
    """One episode's environment as the turn loop drives it: ``reset`` and ``step`` with the retry and
    reset budgets, and the record of every action the env answered (what a reset replays)."""

    def __init__(self, ctx: RolloutContext, env, sample: Sample) -> None:
        self.ctx = ctx
        self.env = env
        self.sample = sample
        self.actions: list[tuple[str, Any, bool]] = []  # (text, observation text, invalid) since the last reset
        self.resets = 0
        self.first_observation: dict | None = None  # what the last reset() returned (it opens the episode)

    @property
    def tools(self) -> list[dict] | None:
        return getattr(self.env, "tools", None) or None

    def format_observation(self, observation: dict):
        return self.env.format_observation(observation)

    async def reset(self) -> dict | None:
        """``env.reset()`` -> the observation that opens the episode (None: the row's prompt alone);
        a failure (any exception) is tried again within ``--max-env-resets``."""
        while True:
            try:
                returned = await call_env(self.ctx, self.env.reset)
            except Exception as e:
                self._spend_reset(e, "env reset")
                continue
            self.first_observation = _first_observation(returned)
            self.actions = []
            return self.first_observation

    def _spend_reset(self, error: BaseException, where: str) -> None:
        """Count one reset for ``error``; past the budget the sample fails with it as the cause."""
        name = type(error).__name__
        _count(self.sample.metadata, "env_reset_causes", name)
        self.resets += 1
        self.sample.metadata["env_resets"] = self.resets
        budget = self.ctx.rollout.max_env_resets
        if self.resets > budget:
            raise EnvStepFailed(
                f"{where} raised {name}: {error}; the environment was reset {budget} times (--max-env-resets {budget})",
                0,
                f"env faults past --max-env-resets ({name})",
            ) from error

    async def step(self, text: str) -> tuple[dict, bool, dict, int]:
        """``env.step(text)`` -> (observation, done, info, retries); a RecoverableEnvError resets the
        env, replays the actions before this one, and steps again (or raises EpisodeRestart)."""
        while True:
            try:
                observation, done, info, retries = await step_with_retries(
                    self.ctx, self.env, text, self.sample.metadata
                )
            except RecoverableEnvError as e:
                await self._recover(e, "env step")
                continue
            self.actions.append((text, observation.get("text"), bool(info.get("invalid_action"))))
            return observation, done, info, retries

    async def _recover(self, error: BaseException, where: str) -> None:
        """Reset and bring the env back to the episode's state, within the reset budget."""
        actions = self.actions
        while True:
            self._spend_reset(error, where)
            self.actions = []
            try:
                seen_first, self.first_observation = (
                    self.first_observation,
                    _first_observation(await call_env(self.ctx, self.env.reset)),
                )
                if not getattr(self.env, "replayable", True):
                    raise EpisodeRestart(f"{type(self.env).__name__} cannot replay its episode after a reset")
                if opening_text(self.first_observation) != opening_text(seen_first):
                    raise EpisodeRestart(
                        f"after a reset the env opens with another observation than the model saw: "
                        f"{opening_text(self.first_observation)!r:.120} != {opening_text(seen_first)!r:.120}"
                    )
                for k, (text, seen, invalid) in enumerate(actions):
                    observation, _, info, _ = await step_with_retries(self.ctx, self.env, text, self.sample.metadata)
                    if observation.get("text") != seen or bool(info.get("invalid_action")) != invalid:
                        # the replay moved it: the new episode starts fresh
                        self.first_observation = _first_observation(await call_env(self.ctx, self.env.reset))
                        raise EpisodeRestart(
                            f"replaying action {k} after a reset gave another observation than the model "
                            f"saw: {observation.get('text')!r:.120} != {seen!r:.120}"
                        )
                    self.actions.append((text, seen, invalid))
                return
            except EpisodeRestart:
                self.actions = []
                self.sample.metadata["episode_restarts"] = self.sample.metadata.get("episode_restarts", 0) + 1
                raise
            except RecoverableEnvError as e:  # again, during the reset or the replay
                error, where = e, "env replay"
            except EnvStepFailed:
                raise
            except Exception as e:  # the reset itself failed
                error, where = e, "env reset"


def _first_observation(returned: Any) -> dict | None:
    """What ``reset()`` returned -> the observation that opens the episode (None: nothing)."""
    returned = opening_of(returned)
    if returned is None:
        return None
    if not isinstance(returned, dict):
        raise TypeError(
            "env.reset() must return None, an observation dict, a string or slime's (observation, info); "
            f"got {type(returned).__name__}"
        )
    return returned if (returned.get("text") or returned.get("images")) else None
