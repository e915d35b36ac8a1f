"""The next batch, one implementation per mode: the rollout role asks it for each step's groups.

  sync            ``SyncBatches``       the step's rollout runs, then the step trains (engines idle while it does)
  ``--async``     ``PrefetchBatches``   the rollout of step k+1 runs while step k trains and ends before
                                        the new weights reach the engines (slime's ``train_async``)
  ``--fully-async`` ``FullyAsyncBatches`` a ``RolloutManager`` generates without stopping; each step
                                        takes the next finished groups within ``--max-staleness``

Each is a ``types.BatchSource``: it answers ``take(step)`` with a ``types.Batch``.
"""

from __future__ import annotations

import concurrent.futures
import time

from slime_mt.rollout.manager import RolloutManager
from slime_mt.rollout.staleness import waste_metrics
from slime_mt.types import Batch, BatchSource


class NextBatch(BatchSource):
    """Sync: each step's rollout runs when the step asks for it."""

    def __init__(self, side) -> None:
        self.side = side

    def take(self, step: int) -> Batch:
        groups, started, seconds, _ = self.side.timed_rollout(step)
        return Batch(groups, started, seconds, {"time/trainer_idle_seconds": seconds})

    def idle_metrics(self, train_seconds: float, sync_seconds: float) -> dict[str, float]:
        """What the engines waited for this step: sync engines wait while the step trains and syncs."""
        return {"time/rollout_idle_seconds": train_seconds + sync_seconds}

    def data_state(self) -> dict:
        return self.side.data.state_dict()


SyncBatches = NextBatch


class PrefetchBatches(NextBatch):
    """``--async``: the rollout of step k+1 starts once step k's batch is prepared, runs while k trains
    and ends (``drain``) before the new weights reach the engines, so every token it generates is
    exactly one version behind the step that trains it."""

    def __init__(self, side, num_rollout: int) -> None:
        super().__init__(side)
        self.num_rollout = num_rollout
        self.pool = concurrent.futures.ThreadPoolExecutor(1, "slime-mt-async-rollout")
        self.pending: concurrent.futures.Future | None = None
        self.rollout_done: float | None = None  # when the last prefetched rollout finished (perf_counter)

    def take(self, step: int) -> Batch:
        if self.pending is None:
            return super().take(step)
        waited = time.perf_counter()
        groups, started, seconds, self.rollout_done = self.pending.result()
        self.pending = None
        return Batch(groups, started, seconds, {"time/trainer_idle_seconds": time.perf_counter() - waited})

    def prefetch(self, step: int, metrics: dict[str, float]) -> None:
        if step + 1 >= self.num_rollout:
            return
        if self.rollout_done is not None:
            metrics["time/rollout_idle_seconds"] = time.perf_counter() - self.rollout_done
        self.pending = self.pool.submit(self.side.timed_rollout, step + 1)

    def drain(self) -> float:
        if self.pending is None:
            return 0.0
        waited = time.perf_counter()
        concurrent.futures.wait([self.pending])
        return time.perf_counter() - waited

    def idle_metrics(self, train_seconds: float, sync_seconds: float) -> dict[str, float]:
        return {}

    def data_state(self) -> dict:
        # the prefetched rollout already advanced the data: the cursor from before it
        return self.side.data_state_before_prefetch if self.pending is not None else self.side.data.state_dict()

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class FullyAsyncBatches(NextBatch):
    """``--fully-async``: the manager generates without stopping; new weights reach the engines in the
    middle of generation through the client's update gate."""

    def __init__(self, side, version: int) -> None:
        super().__init__(side)
        self.manager = RolloutManager(
            side.ctx, side.data, version=version, train_stale=side.cfg.algo.use_decoupled_loss
        )
        self.manager.start()

    def take(self, step: int) -> Batch:
        batch = self.side.ctx.run_sync(self.manager.take(step))
        seconds = batch.trainer_wait_seconds
        return Batch(batch.groups, time.time() - seconds, seconds, _manager_metrics(batch))

    def weights_changed(self, version: int) -> None:
        self.side.ctx.run_sync(self.manager.set_version(version))

    def idle_metrics(self, train_seconds: float, sync_seconds: float) -> dict[str, float]:
        return {}

    def data_state(self) -> dict:
        # groups drawn and not yet trained are drawn again by a resumed run
        return self.side.ctx.run_sync(self.manager.data_state())

    def close(self) -> None:
        self.side.ctx.run_sync(self.manager.stop())


def next_batch_for(rollout_config, side, start: int) -> NextBatch:
    """The mode's batch source, from the step the run starts at."""
    if rollout_config.fully_async:
        return FullyAsyncBatches(side, start)
    if rollout_config.async_mode:
        return PrefetchBatches(side, rollout_config.num_rollout)
    return SyncBatches(side)


def _manager_metrics(batch) -> dict[str, float]:
    """What a fully-async step's wait for its groups saw."""
    samples = [s for g in batch.groups for s in g]
    return {
        "async/dropped_groups": batch.dropped_groups,
        "async/stale_groups": batch.stale_groups,
        "async/filtered_groups": len(batch.filtered),
        "async/groups_started": batch.groups_started,  # since the run (or its resume) started
        "async/groups_running": batch.groups_running,
        "async/partial_resumes": sum(s.metadata.get("partial_resumes", 0) for s in samples),
        "async/regenerated_turns": sum(s.metadata.get("regenerated_turns", 0) for s in samples),
        "time/trainer_idle_seconds": batch.trainer_wait_seconds,
        "time/rollout_idle_seconds": batch.rollout_idle_seconds,
        **waste_metrics(batch.groups, batch.dropped, batch.filtered),
        **({} if batch.tokens_in_flight is None else {"async/tokens_in_flight": batch.tokens_in_flight}),
    }
