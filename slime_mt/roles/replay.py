"""``--load-debug-rollout-data`` (``--debug-train-only``): the rollout role of a run that trains on
saved rollouts. Each step's batch is the one its dump recorded (the finalized sequences and their
advantages, as trained then), no engine starts, and the exported weights go nowhere. Replayed with
the flags of the run that wrote the dumps (its ``config.yaml``), every step trains as it did then:
the same loss and gradients."""

from __future__ import annotations

from pathlib import Path

from slime_mt.inspection.dumps import train_batch_of
from slime_mt.inspection.records import RunRecords
from slime_mt.inspection.replay import checked_dump
from slime_mt.metrics import MetricsLogger
from slime_mt.roles.steps import RolloutSteps
from slime_mt.timeline import Timeline
from slime_mt.types import BatchSource


class ReplayRole(RolloutSteps):
    """The rollout role's part that a train-only run keeps: batches (from the dumps), metrics, records."""

    def __init__(self, cfg, run_dir: Path) -> None:
        self.cfg = cfg
        c = cfg.checkpoint
        self.metrics = MetricsLogger(
            run_dir, use_wandb=c.use_wandb, wandb_project=c.wandb_project, wandb_options=c.wandb_options()
        )
        self.records = RunRecords(cfg, run_dir)
        self.timeline = Timeline("rollout side") if cfg.debug.trace != "off" else None

    def batch_source(self, start: int) -> BatchSource:
        """Nothing generates: the batch of a step is read in ``collect``."""
        return BatchSource()

    def resume(self, step: int, data_state: dict) -> None:
        self.metrics.truncate_after(step)
        self.records.resume(step)

    def collect(self, step: int, batches):
        """Step ``step``'s batch as its dump recorded it."""
        return train_batch_of(checked_dump(self.cfg, step))

    def add_trace(self, events: list[dict]) -> None:
        if self.timeline is not None:
            self.timeline.extend(events)

    def write_step(self, step: int, batch, metrics: dict[str, float]) -> None:
        self.metrics.log(step, metrics, {"trained_groups": batch.trained_groups}, note=batch.note)
        if self.timeline is not None:
            self.records.write_trace(self.timeline.drain())

    def close(self) -> None:
        self.close_batches()
        self.metrics.close()
        self.records.close()
