"""Rollout processes (``--rollout-num-processes N``): a run's trajectories spread over N Ray actors.

One process turns a node's turns into CPU work (the client's HTTP and JSON, chat templates and
tokenizing, environments, rewards); when it cannot keep a cluster's engines busy, the groups run in
N ``RolloutWorker`` actors (``--rollout-process-num-cpus`` each, spread over the nodes). Each holds
what a rollout needs (``RolloutContext``: its own engine client, tokenizer or processor, encoders,
plug-ins) and runs a group as the rollout role's process would (``group_rollout.run_group``: every
sample through ``--custom-generate-function-path``, then its reward).

What decides which group is trained stays in the rollout role's process: the data and its cursor,
the dynamic-sampling filter, the fully-async manager's throttle and staleness bound, the checkpoint's
data state and the metrics. The processes are executors of whole groups, given a copy and answering
the finished one, so a group is drawn once, and trained and checkpointed once, whichever ran it.

A group goes to the process with the fewest samples in flight (``--rollout-concurrency`` is shared
out, each process running at most its part). A process that dies is restarted by Ray, and the groups
it was running run again from their copies on another one (``rollout/process_restarts``): nothing it
generated reaches training. Weight updates span the processes: the rollout role's ``UpdateGate``
holds every process's gate before it pauses the engines and waits for their requests
(``RolloutWorkerPool`` is its ``followers``). Environment workers (``--env-num-workers``) are shared:
every process places its episodes on the same workers, and a restart is counted once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import sys
import uuid
from typing import Any

from slime_mt.cluster.pool import ActorPool
from slime_mt.engine.clients.update_gate import UpdateGate
from slime_mt.errors import RolloutProcessLost
from slime_mt.rollout.env_workers import EnvWorkerPool

logger = logging.getLogger(__name__)

GROUP_ATTEMPTS = 3  # a group whose process dies under it runs again, at most this often in all
RESTART_SECONDS = 300.0  # the longest a lost process is waited for


class RolloutWorker:
    """One rollout process: a ``RolloutContext`` of its own against the run's engines."""

    def __init__(
        self,
        cwd: str,
        paths: list[str],
        cfg,
        url: str,
        worker_urls: list[str] | None,
        concurrency: int,
        env_workers: dict | None,
    ) -> None:
        from slime_mt.cluster.runtime import enter

        enter(cwd, paths)
        from slime_mt.rollout.context import RolloutContext

        rollout = dataclasses.replace(cfg.rollout, rollout_num_processes=1, env_num_workers=0)
        cfg = dataclasses.replace(cfg, rollout=rollout)
        self.ctx = RolloutContext.create(
            cfg, cfg.train.hf_checkpoint, url, worker_urls, process=f"rollout process {os.getpid()}"
        )
        self.ctx.client.gate = UpdateGate()
        if env_workers is not None:
            self.ctx.env_workers = EnvWorkerPool.attached(env_workers)
            self.ctx.env_workers.timeline = self.ctx.timeline
        self.semaphore = asyncio.Semaphore(concurrency)  # used on the context's loop only
        self.plugins: dict[bool, tuple] = {}
        self.incarnation = uuid.uuid4().hex

    def where(self) -> dict:
        from slime_mt.cluster.runtime import location

        return {**location(), "incarnation": self.incarnation}

    async def _on_loop(self, coro) -> Any:
        """Run ``coro`` on the context's loop, where the client's connections live (cancelled with it)."""
        return await asyncio.wrap_future(self.ctx.submit(coro))

    async def run_group(self, group: list, sampling_params: dict, evaluation: bool, start_version: int):
        """The group's samples generated and rewarded -> (the samples, the environment workers'
        restarts this process saw since its last answer, its trace spans since then)."""
        from slime_mt.rollout.group_rollout import load_plugins, run_group

        self.ctx.start_version = start_version
        if evaluation not in self.plugins:
            self.plugins[evaluation] = load_plugins(self.ctx.rollout, evaluation)
        generate, rm, _ = self.plugins[evaluation]
        done = await self._on_loop(
            run_group(self.ctx, group, generate, rm, sampling_params, self.semaphore, None, evaluation)
        )
        seen = self.ctx.env_workers.take_seen() if self.ctx.env_workers is not None else []
        return done, seen, self.ctx.timeline.drain() if self.ctx.timeline is not None else []

    async def gate_hold(self) -> None:
        await self._on_loop(_call(self.ctx.client.gate.hold))

    async def gate_release(self) -> None:
        await self._on_loop(_call(self.ctx.client.gate.release))

    async def gate_back(self, timeout: float) -> bool:
        return await self._on_loop(self.ctx.client.gate.back(timeout))

    async def gate_out(self) -> int:
        return await self._on_loop(_call(lambda: self.ctx.client.gate.out))


async def _call(fn):
    return fn()


class RolloutWorkerPool(ActorPool):
    """The run's rollout processes, seen from the rollout role: groups out, finished groups back
    (``load``: the samples each runs); the ``followers`` of its update gate. Methods are coroutines on
    the rollout role's loop. ``timeline``: the rollout role's trace, which takes the processes' spans."""

    timeline = None

    def __init__(self, cfg, url: str, worker_urls: list[str] | None, env_workers=None) -> None:
        import ray

        from slime_mt.cluster.runtime import connect

        r = cfg.rollout
        n = r.rollout_num_processes
        self.started_ray, self.owned = connect(cfg.cluster.ray_address), True
        self.concurrency = max(math.ceil(r.rollout_concurrency / n), 1)
        actor = ray.remote(RolloutWorker).options(
            num_cpus=r.rollout_process_num_cpus,
            num_gpus=0,
            max_restarts=-1,
            max_task_retries=0,
            max_concurrency=1000,  # one group per task; the context's loop interleaves them
            scheduling_strategy="SPREAD",
        )
        shared = env_workers.shared() if env_workers is not None else None
        self.env_workers = env_workers
        self.start(
            actor,
            n,
            (os.getcwd(), list(sys.path), cfg, url, worker_urls, self.concurrency, shared),
            f"--rollout-num-processes {n}: the rollout processes (--rollout-process-num-cpus "
            f"{r.rollout_process_num_cpus})",
        )
        self.down: set[int] = set()  # processes lost and not yet answering again: given no group
        self._watching: set[asyncio.Task] = set()

    def describe(self) -> list[str]:
        return super().describe("rollout process")

    async def _pick(self, samples: int) -> int:
        """The process for a group of ``samples``, waiting while every one is down."""
        deadline = asyncio.get_running_loop().time() + RESTART_SECONDS
        while (index := self.assign(samples, self.down)) is None:
            if asyncio.get_running_loop().time() > deadline:
                raise RolloutProcessLost(
                    f"every rollout process is down and none came back within {RESTART_SECONDS:.0f} s "
                    "(--rollout-num-processes)"
                )
            await asyncio.sleep(0.1)
        return index

    def _lost(self, index: int) -> None:
        """Process ``index`` died: no group goes to it until Ray has started it again and it answers."""
        with self._lock:
            if index in self.down:
                return
            self.down.add(index)
        task = asyncio.get_running_loop().create_task(self._watch(index))
        self._watching.add(task)
        task.add_done_callback(self._watching.discard)

    async def _watch(self, index: int) -> None:
        import ray

        loop = asyncio.get_running_loop()
        deadline = loop.time() + RESTART_SECONDS
        while loop.time() < deadline:
            try:
                where = await self.workers[index].where.remote()
            except ray.exceptions.RayActorError:
                await asyncio.sleep(0.2)
                continue
            if self.saw(index, where["incarnation"]):
                logger.warning("rollout process %d was restarted (%d in this run)", index, self.total_restarts)
            with self._lock:
                self.down.discard(index)
            return
        logger.error("rollout process %d did not come back within %.0f s", index, RESTART_SECONDS)

    async def run_group(self, group: list, sampling_params: dict, evaluation: bool, start_version: int) -> list:
        """``group`` run in the process with the fewest samples in flight -> its finished samples (new
        objects; ``group`` is untouched). A process that dies under it: run again on another."""
        import ray

        for attempt in range(GROUP_ATTEMPTS):
            index = await self._pick(len(group))
            ref = self.workers[index].run_group.remote(group, sampling_params, evaluation, start_version)
            try:
                done, seen, events = await ref
            except asyncio.CancelledError:
                ray.cancel(ref)
                raise
            except ray.exceptions.RayTaskError as e:
                raise e.cause from None
            except ray.exceptions.RayActorError as e:  # died, or restarting
                self._lost(index)
                logger.warning(
                    "rollout process %d died running group %s (%s); the group runs again from its copy",
                    index,
                    group[0].group_index if group else "?",
                    type(e).__name__,
                )
                if attempt + 1 == GROUP_ATTEMPTS:
                    raise RolloutProcessLost(
                        f"group {group[0].group_index if group else '?'}: its rollout process died under it "
                        f"{GROUP_ATTEMPTS} times (--rollout-num-processes)"
                    ) from e
                continue
            finally:
                self.unassign(index, len(group))
            if self.timeline is not None:
                self.timeline.extend(events)
            if self.env_workers is not None:
                for worker, incarnation in seen:
                    self.env_workers.saw(worker, incarnation)
            return done
        raise AssertionError("unreachable")

    # ---------------------------------------------------------------- the update gate's followers

    async def _each(self, method: str, *args) -> list:
        import ray

        calls = [getattr(w, method).remote(*args) for w in self.workers]
        results = await asyncio.gather(*calls, return_exceptions=True)
        answered = []
        for result in results:
            if isinstance(result, ray.exceptions.RayActorError):  # a dead process sends nothing
                continue
            if isinstance(result, BaseException):
                raise result
            answered.append(result)
        return answered

    async def hold(self) -> None:
        await self._each("gate_hold")

    async def release(self) -> None:
        await self._each("gate_release")

    async def back(self, timeout: float) -> bool:
        return all(await self._each("gate_back", timeout))

    async def out(self) -> int:
        return sum(await self._each("gate_out"))
