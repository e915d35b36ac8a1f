"""What the driver asks of a rollout role each step, whatever makes its batches (``RolloutRole``: the
engines and the rollout function; ``ReplayRole``: a train-only run's dumps). Every method takes and
returns plain data, so that the role answers the same in the host rank's process and as its own Ray
actor (``launch/ray``):

  resume(step, data_state)       a resumed run: the data cursor, metrics and records from its step
  begin(start, split)            the mode's batch source; ``split`` deals a batch into DP shares
  shares(step)                   generate: the step's batch, split by DP rank (or the failure that stops the run)
  trained(step, log_probs)       what the ranks trained, into the step's dump
  drain()                        the step has trained: what still generates for it finishes
  begin_update / end_update      around a weight update sent from elsewhere (``push_weights`` in-process)
  close_gate / open_gate         the update gate, held while the weights change
  wake_engines()                 ``--colocate``: the engines' memory back once the weights are in
  weights_changed(version)       the engines now serve ``version``
  log_step(step, times, ...)     the step's metrics, with every rank's spans
  data_state()                   the data cursor a checkpoint saves
  close()
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from slime_mt.algo.batching import RankShare
from slime_mt.errors import RolloutFailedError
from slime_mt.types import BatchSource, TrainBatch


def drain_weights(stream: Iterator, version: int) -> None:
    """Where no engine takes the export (a rank that reaches no engine, a train-only run): it is
    collective, so every rank still streams its shards, and they go nowhere."""
    for _ in stream:
        pass


@dataclass
class StepTimes:
    """What the driver measured of a step, for its log line."""

    step_seconds: float  # the step until its log
    train_metrics: dict[str, float]
    train_started: float  # wall clock
    train_finished: float
    sync_seconds: float
    drained_seconds: float
    colocate: dict[str, float] = field(default_factory=dict)


class RolloutSteps:
    """The per-step part every rollout role shares; a role gives ``batch_source``, ``collect`` and
    ``write_step`` (and, where engines are, the weight update)."""

    cfg = None
    records = None
    batches: BatchSource | None = None
    split: Callable | None = None
    batch: TrainBatch | None = None  # the step's batch, until it is logged

    def batch_source(self, start: int) -> BatchSource:
        raise NotImplementedError

    def collect(self, step: int, batches: BatchSource) -> TrainBatch | RolloutFailedError:
        raise NotImplementedError

    def write_step(self, step: int, batch: TrainBatch, metrics: dict[str, float]) -> None:
        raise NotImplementedError

    def add_trace(self, events: list[dict]) -> None:
        raise NotImplementedError

    def begin(self, start: int, split: Callable) -> None:
        """The run starts at step ``start``; ``split(samples, advantages, prompts_per_step)`` deals a
        batch into one share per DP rank (``algo.batching.split_by_dp`` with the trainer's reduction)."""
        self.split = split
        self.batches = self.batch_source(start)

    def shares(self, step: int) -> list[RankShare] | RolloutFailedError:
        """Generate: the step's batch, one share per DP rank, or the error that stops the run (every
        sample failed ``--max-failed-steps`` steps in a row)."""
        batch = self.collect(step, self.batches)
        if isinstance(batch, RolloutFailedError):
            return batch
        self.batch = batch
        r = self.cfg.rollout
        return self.split(batch.samples, batch.advantages, self.cfg.train.global_batch_size // r.n_samples_per_prompt)

    def trained(self, step: int, log_probs: dict[int, list[float]]) -> None:
        """``--save-debug-rollout-data``: every rank's trained log-probs, by sample index, into the dump."""
        self.records.trained(step, log_probs)

    def drain(self) -> float:
        return self.batches.drain()

    def data_state(self) -> dict:
        return self.batches.data_state()

    def weights_changed(self, version: int) -> None:
        self.batches.weights_changed(version)

    def push_weights(self, stream: Iterator, version: int) -> None:
        drain_weights(stream, version)  # no engines

    def wake_engines(self) -> None:
        pass

    def log_step(self, step: int, times: StepTimes, events: list[dict], sent: dict[str, float]) -> None:
        """The step's metrics (the rollout's, the train step's and what its batch cost to send, the
        driver's times) and every rank's spans (``events``)."""
        batch, t = self.batch, times
        train_seconds = t.train_metrics["train/seconds"]
        metrics = {
            **batch.rollout_metrics,
            **t.train_metrics,
            **sent,
            **batch.merge_metrics,
            **batch.metrics,
            "rollout/weight_version": float(step + 1),
            "time/rollout_seconds": batch.rollout_seconds,
            "time/train_seconds": train_seconds,
            "time/sync_seconds": t.sync_seconds,
            "time/step_seconds": t.step_seconds,
            "time/rollout_started": batch.rollout_started,
            "time/train_started": t.train_started,
            "time/train_finished": t.train_finished,
            **self.batches.idle_metrics(train_seconds, t.sync_seconds),
            **t.colocate,
        }
        if t.drained_seconds:
            metrics["time/trainer_idle_seconds"] = metrics.get("time/trainer_idle_seconds", 0.0) + t.drained_seconds
        self.add_trace(events)
        self.write_step(step, batch, metrics)
        self.batch = None

    def close_batches(self) -> None:
        if self.batches is not None:
            self.batches.close()
            self.batches = None
