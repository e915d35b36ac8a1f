"""Environment workers (``--env-num-workers N``): episodes' environments in Ray actors on any node.

Heavy environments (sandboxes, browsers, simulators) leave the rollout process: each of N
``EnvWorker`` actors (``--env-worker-num-cpus`` each, spread over the cluster's nodes) imports the
``--rollout-interaction-env-path`` module and holds the environments of the episodes given to it.
The rollout holds a ``RemoteEnv`` per episode, which has the environment's interface (``reset``,
``step``, ``format_observation``, ``close``), so ``run_episode`` and the environments written for the
in-process path run unchanged. Inside a worker, a sync method runs on the worker's thread pool and an
``async def`` one on its event loop, as they do in-process.

A worker that dies (its process killed, its node lost) is restarted by Ray. The step in flight, and
the next call of every other episode it held, fails as a ``RetryableEnvError``; the step's retry
(``--max-env-retries-per-turn``) first rebuilds the episode's environment on the restarted worker
from the sample it was built from, resets it and replays the episode's earlier steps. A replay whose
observation differs from the one the model saw fails the sample (the environment is not
deterministic, and the trajectory no longer matches its state): nothing is trained against an
environment state the model did not see. The restarts are counted (``env/worker_restarts``).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import logging
import os
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

from slime_mt.cluster.pool import ActorPool
from slime_mt.environment import opening_of, opening_text
from slime_mt.errors import EnvReplayDiverged, EpisodeLost, RetryableEnvError
from slime_mt.plugins import load_module
from slime_mt.timeline import current_lane, maybe_span

logger = logging.getLogger(__name__)


class EnvWorker:
    """One worker process: the environments of the episodes given to it, by episode key."""

    def __init__(self, cwd: str, paths: list[str], env_path: str, args: argparse.Namespace) -> None:
        from slime_mt.cluster.runtime import enter

        enter(cwd, paths)

        self.module = load_module(env_path)
        self.args = args
        self.envs: dict[str, Any] = {}
        self.pool = ThreadPoolExecutor(64, "slime-mt-env")
        self.incarnation = uuid.uuid4().hex

    def where(self) -> dict:
        from slime_mt.cluster.runtime import location

        return {**location(), "incarnation": self.incarnation}

    def held(self) -> int:
        """How many episodes' environments this worker holds."""
        return len(self.envs)

    async def _call(self, fn, *args, **kw) -> Any:
        if inspect.iscoroutinefunction(fn):
            return await fn(*args, **kw)
        result = await asyncio.get_running_loop().run_in_executor(self.pool, partial(fn, *args, **kw))
        return await result if inspect.isawaitable(result) else result

    def _env(self, key: str):
        try:
            return self.envs[key]
        except KeyError:
            raise EpisodeLost(f"worker {self.incarnation[:8]} holds no environment for episode {key}") from None

    async def build(self, key: str, sample) -> tuple[str, list | None, bool]:
        """Build the episode's environment -> (this worker's incarnation, new after every restart; the
        env's ``tools``; whether it is ``replayable``)."""
        env = self.envs[key] = await self._call(self.module.build_env, sample=sample, args=self.args)
        return self.incarnation, getattr(env, "tools", None), getattr(env, "replayable", True)

    async def reset(self, key: str) -> tuple[Any, tuple[bool, Any]]:
        """``env.reset()`` -> (what it returned, formatted as ``step`` formats: an observation that
        opens the episode is formatted here)."""
        env = self._env(key)
        returned = opening_of(await self._call(env.reset))
        return returned, self._format(env, returned if isinstance(returned, dict) and returned else None)

    async def step(self, key: str, text: str) -> tuple[Any, tuple[bool, Any]]:
        """``env.step(text)`` -> (its result, (True, the observation formatted as chat messages) or
        (False, the exception formatting raised)); formatting here keeps an env's own
        ``format_observation`` (and its images) where the env is."""
        env = self._env(key)
        result = await self._call(env.step, text)
        ok = isinstance(result, tuple) and len(result) == 3 and isinstance(result[0], dict) and not result[1]
        return result, self._format(env, result[0] if ok else None)

    @staticmethod
    def _format(env, observation: dict | None) -> tuple[bool, Any]:
        if observation is None:
            return True, None
        try:
            return True, env.format_observation(observation)
        except Exception as e:  # raised where the rollout formats it, as in-process
            return False, e

    async def close(self, key: str) -> None:
        env = self.envs.pop(key, None)
        if env is not None:
            await self._call(env.close)


class EnvWorkerPool(ActorPool):
    """The run's environment workers: started spread over the cluster's nodes, restarted by Ray when
    they die; episodes go to the worker holding the fewest (``load``: episodes held). ``timeline``: the
    rollout process's trace, where each call to a worker is a span of that worker's."""

    timeline = None

    def __init__(
        self,
        num_workers: int,
        num_cpus: float,
        env_path: str,
        args: argparse.Namespace,
        ray_address: str | None = None,
        retries: int = 2,
    ) -> None:
        import ray

        from slime_mt.cluster.runtime import connect

        self.started_ray = connect(ray_address)
        self.owned = True
        shipped = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "rollout_context"})
        actor = ray.remote(EnvWorker).options(
            num_cpus=num_cpus,
            max_restarts=-1,
            max_task_retries=0,
            scheduling_strategy="SPREAD",
        )
        self.start(
            actor,
            num_workers,
            (os.getcwd(), list(sys.path), env_path, shipped),
            f"--env-num-workers {num_workers}: the environment workers (--rollout-interaction-env-path "
            f"{env_path}, --env-worker-num-cpus {num_cpus})",
        )
        self._track(retries)

    def _track(self, retries: int) -> None:
        self.retries = retries
        self.seen: list[tuple[int, str]] = []  # (worker, incarnation) of every restart seen, for ``take_seen``

    def shared(self) -> dict:
        """What another rollout process needs to use these workers (``attached``)."""
        return {"workers": list(self.workers), "where": self.where, "retries": self.retries}

    @classmethod
    def attached(cls, shared: dict) -> EnvWorkerPool:
        """Another process's handle on the workers of ``shared`` (``--rollout-num-processes``): it
        places its episodes on them and never stops them; the restarts it sees go back to the pool's
        owner through ``take_seen``, which counts each once."""
        pool = cls.__new__(cls)
        pool.started_ray, pool.owned = False, False
        pool.workers = list(shared["workers"])
        ActorPool.__init__(pool, shared["where"])
        pool._track(shared["retries"])
        return pool

    def describe(self) -> list[str]:
        return super().describe("env worker")

    def saw(self, index: int, incarnation: str) -> bool:
        """A worker answered as ``incarnation``: a new one is a restart (kept for ``take_seen``)."""
        if not super().saw(index, incarnation):
            return False
        with self._lock:
            self.seen.append((index, incarnation))
        logger.warning("environment worker %d was restarted (%d in this run)", index, self.total_restarts)
        return True

    def take_seen(self) -> list[tuple[int, str]]:
        with self._lock:
            seen, self.seen = self.seen, []
            return seen

    async def open_env(self, sample) -> RemoteEnv:
        import ray

        env = RemoteEnv(self, ray.put(sample))
        try:
            await env.retrying(env.build)
        except BaseException:
            env.release()
            raise
        return env


class RemoteEnv:
    """One episode's environment on an environment worker, with the environment's interface."""

    def __init__(self, pool: EnvWorkerPool, sample_ref) -> None:
        self.pool = pool
        self.sample_ref = sample_ref  # the sample as it was built from (a restart rebuilds from it)
        self.index = pool.assign()  # never None: no worker is excluded
        self.key = uuid.uuid4().hex
        self.history: list[tuple[str, Any]] = []  # (text, observation text) of every step that answered
        self.tools: list | None = None  # the environment's, as its build reported them
        self.replayable = True
        self.was_reset = False
        self.opened_with: Any = None  # what the last reset returned (the episode's opening observation)
        self.lost = False
        self.closed = False
        self._formatted: tuple[int, tuple[bool, Any]] | None = None

    async def _remote(self, method: str, *args, idempotent: bool = False) -> Any:
        """``method`` of the episode on its worker. An ``idempotent`` call (a build, which makes the
        episode's environment afresh) waits for a worker Ray is restarting, as Ray retries it there, so
        that one death costs the step one retry, however long the restart takes."""
        import ray

        worker = self.pool.workers[self.index]
        call = getattr(worker, method)
        if idempotent:
            call = call.options(max_task_retries=self.pool.retries)
        try:
            where = {"process": f"env worker {self.index}", "lane": current_lane.get() or f"episode {self.key[:8]}"}
            with maybe_span(self.pool.timeline, f"env.{method}", "env", **where):
                return await call.remote(self.key, *args)
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, EpisodeLost):
                self.lost = True
            raise e.cause from None
        except ray.exceptions.RayActorError as e:  # died, or restarting
            self.lost = True
            raise RetryableEnvError(
                f"environment worker {self.index} died during {method} ({type(e).__name__}); the episode "
                "is rebuilt on the restarted worker"
            ) from e

    async def build(self) -> None:
        self.lost = True  # until the build answers
        incarnation, self.tools, self.replayable = await self._remote("build", self.sample_ref, idempotent=True)
        self.pool.saw(self.index, incarnation)
        self.lost = False

    async def _restore(self) -> None:
        """Rebuild the episode on its (restarted) worker: build, reset, replay every step that answered."""
        await self.build()
        self.lost = True  # until the replay is done
        if self.was_reset:
            (returned, _) = await self._remote("reset")
            now, seen = opening_text(returned), opening_text(self.opened_with)
            if now != seen:
                raise EnvReplayDiverged(
                    f"the restarted environment worker {self.index} opens the episode with another "
                    f"observation than the model saw: {now!r:.120} != {seen!r:.120}"
                )
        for k, (text, seen) in enumerate(self.history):
            (observation, _, _), _ = await self._remote("step", text)
            if observation.get("text") != seen:
                raise EnvReplayDiverged(
                    f"replaying step {k} on the restarted environment worker {self.index} gave another "
                    f"observation than the model saw: {observation.get('text')!r:.120} != {seen!r:.120}"
                )
        self.lost = False

    async def _ensure(self) -> None:
        if self.lost:
            await self._restore()

    async def reset(self) -> Any:
        """Reset the environment -> what its ``reset()`` returned: the episode's steps begin again (a
        restore replays those after it)."""
        returned = await self.retrying(self._reset_once)
        self.was_reset = True
        self.history = []
        self.opened_with = returned
        return returned

    async def _reset_once(self) -> Any:
        await self._ensure()
        returned, formatted = await self._remote("reset")
        if isinstance(returned, dict):
            self._formatted = (id(returned), formatted)
        return returned

    async def retrying(self, once) -> Any:
        """``once()`` again while the worker dies under it: a build or a reset has no step retry around
        it, so it gets the same budget here."""
        for attempt in range(self.pool.retries + 1):
            try:
                return await once()
            except RetryableEnvError:
                if not self.lost or attempt == self.pool.retries:
                    raise

    async def step(self, text: str) -> tuple[dict, bool, dict]:
        await self._ensure()
        result, formatted = await self._remote("step", text)
        if isinstance(result, tuple) and len(result) == 3 and isinstance(result[0], dict):
            if not result[2].get("retryable"):
                self.history.append((text, result[0].get("text")))
            self._formatted = (id(result[0]), formatted)
        return result

    def format_observation(self, observation: dict):
        """The observation as the environment formatted it in its worker, with the step (or reset) that
        returned it."""
        if self._formatted is None or self._formatted[0] != id(observation):
            raise RuntimeError("a remote environment formats the observation its last step or reset returned, no other")
        ok, value = self._formatted[1]
        if not ok:
            raise value
        return value

    async def close(self) -> None:
        if self.closed:
            return
        try:
            if not self.lost:
                await self._remote("close")
        except RetryableEnvError:
            if not self.lost:
                raise
            # the worker died: the environment went with it, there is nothing left to close
        finally:
            self.release()

    def release(self) -> None:
        self.closed = True
        self.pool.unassign(self.index)
