"""The fully-async rollout manager (rank 0, ``--fully-async``).

A task on the run's event loop draws prompt groups one at a time and runs each (every sample through
``--custom-generate-function-path``, then its reward, as ``group_rollout`` does) without ever waiting
for training. A finished group that the dynamic-sampling filter keeps joins a buffer, in finish
order; each training step takes the next ``--rollout-batch-size`` groups from it. Weights change in
the middle of generation through the client's ``UpdateGate``.

Staleness, AReaL's semantics, with version v = weight updates so far = steps trained, B = groups per
step and S = ``--max-staleness``:
  throttle  a group starts only while trained + buffered + running groups < (v + S + 1) * B (plus
            ``--over-sampling-batch-size`` - B when a filter drops groups), so a group started
            under version v is, finishing in order, trained by step v + S; with
            ``--max-tokens-in-flight`` also only while the running trajectories hold fewer tokens;
  bound     a group that finished out of order and whose oldest trainable token is more than S
            versions behind the step that takes it is dropped and counted, never trained (with
            ``--mask-offpolicy-in-partial-rollout`` its tokens beyond the bound are masked instead,
            ``staleness.mask_stale``; with ``--use-decoupled-loss`` it is trained as it is, each token
            weighted by its own behaviour policy, so the long trajectories are not the ones lost).
Filtered and dropped groups do not count against the throttle, and every change to what it counts
(a group finishing, dropped or taken, a new version) wakes the generation task at once.

At a checkpoint the groups in the buffer and in flight go into the saved data state
(``PromptDataset.state_dict(untrained=...)``): a resumed run draws them again, so no group is
trained twice and none that was drawn is lost.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from slime_mt.data import PromptDataset
from slime_mt.errors import RolloutError
from slime_mt.rollout.context import RolloutContext
from slime_mt.rollout.group_rollout import MAX_OVERSAMPLING_ROUNDS, kept_by_filter, load_plugins, run_group
from slime_mt.rollout.staleness import oldest_version
from slime_mt.types import Sample

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Batch:
    """What one training step takes: its groups and what happened while they were waited for."""

    groups: list[list[Sample]]
    dropped: list[list[Sample]]  # beyond the staleness bound, never trained
    stale_groups: int  # beyond the bound, kept: masked (--mask-offpolicy-...) or trained (--use-decoupled-loss)
    filtered: list[list[Sample]]  # rejected by the dynamic-sampling filter since the last take
    trainer_wait_seconds: float  # the trainer waiting for groups
    rollout_idle_seconds: float  # no group in flight, since the last take
    tokens_in_flight: int | None = None  # what the running trajectories held when the step took its groups
    groups_started: int = 0  # since the manager started, when the step took its groups
    groups_running: int = 0  # in flight then

    @property
    def dropped_groups(self) -> int:
        return len(self.dropped)


class RolloutManager:
    """Start with ``start()`` from any thread; the other methods are coroutines on the ctx's loop
    (``ctx.run_sync(manager.take(...))``)."""

    def __init__(self, ctx: RolloutContext, data: PromptDataset, version: int = 0, train_stale: bool = False):
        r = ctx.rollout
        self.ctx, self.data = ctx, data
        self.batch_size = r.rollout_batch_size
        self.max_staleness = r.max_staleness
        self.mask_stale = r.mask_offpolicy_in_partial_rollout
        self.train_stale = train_stale  # --use-decoupled-loss: a group beyond the bound is trained as it is
        self.max_tokens = r.max_tokens_in_flight
        self.extra = (
            max((r.over_sampling_batch_size or r.rollout_batch_size) - r.rollout_batch_size, 0)
            if r.dynamic_sampling_filter_path
            else 0
        )
        self.version = version  # weights the engines serve
        self.first_version = version
        self.trained = 0  # groups taken since the manager started
        self.started = 0  # groups started since the manager started
        self.buffer: list[list[Sample]] = []
        self.running: dict[int, list[Sample]] = {}  # group index -> its samples, in flight
        self._tasks: set[asyncio.Task] = set()
        self._main: asyncio.Task | None = None
        self._changed: asyncio.Condition | None = None
        self._error: BaseException | None = None
        self._filtered: list[list[Sample]] = []
        self._rejected_in_a_row = 0
        self._idle_seconds = 0.0
        self._idle_since: float | None = None

    # ------------------------------------------------------------------ the generation task

    def start(self) -> None:
        self.ctx.run_sync(self._start())

    async def _start(self) -> None:
        self._changed = asyncio.Condition()
        self._idle_since = self._now()
        self._main = asyncio.get_running_loop().create_task(self._run())

    def capacity(self) -> int:
        """Groups that may be trained, buffered or running under the current version."""
        return (self.version - self.first_version + self.max_staleness + 1) * self.batch_size + self.extra

    def admitted(self) -> int:
        return self.trained + len(self.buffer) + len(self.running)

    def tokens_in_flight(self) -> int:
        """Tokens the running trajectories hold now (their contexts grow in place as turns run; one not
        yet tokenized counts one)."""
        return sum(max(len(s.tokens), 1) for group in self.running.values() for s in group)

    def may_start(self) -> bool:
        """The throttle: a group may start under the group bound and, with --max-tokens-in-flight, the
        token budget (re-checked whenever a group finishes, so growing contexts only ever delay a start)."""
        if self.admitted() >= self.capacity():
            return False
        return self.max_tokens is None or self.tokens_in_flight() < self.max_tokens

    async def _run(self) -> None:
        generate, rm, keep = load_plugins(self.ctx.rollout)
        semaphore = asyncio.Semaphore(self.ctx.rollout.rollout_concurrency)
        sampling_params = self.ctx.sampling_params()
        try:
            while True:
                async with self._changed:
                    await self._changed.wait_for(self.may_start)
                group = self.data.get_samples(1)[0]
                for s in group:
                    s.metadata["rollout_id"] = self.version
                    s.metadata["start_version"] = self.version
                self.running[group[0].group_index] = group
                self.started += 1
                self._set_idle()
                task = asyncio.get_running_loop().create_task(
                    self._one(group, generate, rm, keep, sampling_params, semaphore)
                )
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - handed to the trainer, which raises it
            await self._fail(e)

    async def _one(self, group, generate, rm, keep, sampling_params, semaphore) -> None:
        try:
            done = await run_group(self.ctx, group, generate, rm, sampling_params, semaphore)
            kept = keep is None or kept_by_filter(keep(self.ctx.args, done))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001
            await self._fail(e)
            return
        async with self._changed:
            del self.running[group[0].group_index]
            if kept:
                self.buffer.append(done)
                self._rejected_in_a_row = 0
            else:
                for s in done:
                    s.metadata["filtered"] = True
                self._filtered.append(done)
                self._rejected_in_a_row += 1
                if self._rejected_in_a_row > MAX_OVERSAMPLING_ROUNDS * self.batch_size:
                    self._error = RolloutError(
                        f"--dynamic-sampling-filter-path {self.ctx.rollout.dynamic_sampling_filter_path} "
                        f"rejected {self._rejected_in_a_row} groups in a row"
                    )
            self._set_idle()
            self._changed.notify_all()

    async def _fail(self, error: BaseException) -> None:
        logger.error("the rollout manager failed: %s: %s", type(error).__name__, error)
        async with self._changed:
            self._error = error
            self._changed.notify_all()

    # ------------------------------------------------------------------ the trainer's side

    async def take(self, version: int) -> Batch:
        """The next ``rollout_batch_size`` groups for the step that trains ``version``, waiting for
        them; groups beyond the staleness bound are dropped (or kept to be masked)."""
        started = self._now()
        groups: list[list[Sample]] = []
        dropped: list[list[Sample]] = []
        stale = 0
        async with self._changed:
            while len(groups) < self.batch_size:
                await self._changed.wait_for(lambda: self.buffer or self._error is not None)
                if self._error is not None:
                    raise RolloutError(
                        f"fully-async rollout failed: {type(self._error).__name__}: {self._error}"
                    ) from self._error
                group = self.buffer.pop(0)
                oldest = oldest_version(group)
                if oldest is not None and version - oldest > self.max_staleness:
                    if not (self.mask_stale or self.train_stale):
                        logger.info(
                            "group %d dropped: started under version %s, oldest token version %d, trains "
                            "version %d (--max-staleness %d)",
                            group[0].group_index,
                            group[0].metadata.get("start_version"),
                            oldest,
                            version,
                            self.max_staleness,
                        )
                        dropped.append(group)
                        for s in group:
                            s.metadata["dropped_stale"] = True
                        self._changed.notify_all()  # a slot is free: the generation task starts a group now
                        continue
                    stale += 1
                groups.append(group)
                self.trained += 1  # now, not after the loop: the wait above lets the generation task run
            self._set_idle()
            idle, self._idle_seconds = self._idle_seconds, 0.0
            filtered, self._filtered = self._filtered, []
            self._changed.notify_all()
            # trajectories run in rollout processes grow there, not here: nothing to count
            in_flight = self.tokens_in_flight() if self.ctx.rollout.rollout_num_processes == 1 else None
            counts = (self.started, len(self.running))
        return Batch(groups, dropped, stale, filtered, self._now() - started, idle, in_flight, *counts)

    async def set_version(self, version: int) -> None:
        """The engines now serve ``version``: the throttle lets more groups start."""
        async with self._changed:
            self.version = version
            self._changed.notify_all()

    async def pending(self) -> list[list[Sample]]:
        """Groups drawn and not trained: the buffer, then those in flight, in group order."""
        async with self._changed:
            return sorted(self.buffer + list(self.running.values()), key=lambda g: g[0].group_index)

    async def data_state(self) -> dict:
        """The dataset's state as a resumed run needs it: every drawn, untrained group requeued."""
        return self.data.state_dict(untrained=await self.pending())

    async def stop(self) -> None:
        """Cancel the generation task and every group in flight, and abort their requests."""
        tasks = [t for t in [self._main, *self._tasks] if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.ctx.client.abort(abort_all=True)

    # ------------------------------------------------------------------ idle time

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def _set_idle(self) -> None:
        """Account the time no group was in flight (called whenever ``running`` may have changed)."""
        now = self._now()
        if self._idle_since is not None:
            self._idle_seconds += now - self._idle_since
            self._idle_since = None
        if not self.running:
            self._idle_since = now
