"""``--load-debug-rollout-data`` (``--debug-train-only``): the rollout side of a run that trains on
saved rollouts. Each step's batch is the one its dump recorded (the finalized sequences and their
advantages, as trained then), no engine starts, and the exported weights go nowhere. Replayed with
the flags of the run that wrote the dumps (its ``config.yaml``), every step trains as it did then:
the same loss and gradients."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from slime_mt.errors import DumpError
from slime_mt.inspection.dumps import dump_path, load_dump, settings_of, train_batch_of
from slime_mt.inspection.records import RunRecords
from slime_mt.metrics import MetricsLogger
from slime_mt.timeline import Timeline
from slime_mt.types import BatchSource


def checked_dump(cfg, step: int) -> dict:
    """Step ``step``'s dump, checked against the run: its step, and the settings its sequences and
    advantages were made with (DumpError naming the file and the settings that differ)."""
    path = dump_path(cfg.debug.load_debug_rollout_data, step)
    data = load_dump(path)
    if data["rollout_id"] != step:
        raise DumpError(f"{path}: holds rollout {data['rollout_id']}, not step {step}")
    now = settings_of(cfg)
    changed = [f"{k}={v!r} (now {now.get(k)!r})" for k, v in data["settings"].items() if now.get(k) != v]
    if changed:
        raise DumpError(
            f"{path}: written with other settings: {', '.join(changed)}; replay with the flags of the run "
            "that wrote it (its config.yaml)"
        )
    return data


class ReplaySide:
    """The rollout side's part that a train-only run keeps: batches (from the dumps), metrics, records."""

    def __init__(self, cfg, run_dir: Path) -> None:
        self.cfg = cfg
        c = cfg.checkpoint
        self.metrics = MetricsLogger(run_dir, use_wandb=c.use_wandb, wandb_project=c.wandb_project)
        self.records = RunRecords(cfg, run_dir)
        self.timeline = Timeline("rollout side") if cfg.debug.trace != "off" else None

    def begin(self, start: int) -> BatchSource:
        """Nothing generates: the batch of a step is read in ``collect``."""
        return BatchSource()

    def resume(self, data_state: dict, step: int) -> None:
        self.metrics.truncate_after(step)
        self.records.resume(step)

    def collect(self, step: int, batches):
        """Step ``step``'s batch as its dump recorded it."""
        return train_batch_of(checked_dump(self.cfg, step))

    def push_weights(self, stream: Iterator, version: int) -> None:
        for _ in stream:  # the export is collective: every rank streams, and nobody receives
            pass

    def wake_engines(self) -> None:
        pass

    def add_trace(self, events: list[dict]) -> None:
        if self.timeline is not None:
            self.timeline.extend(events)

    def log_step(self, step: int, batch, metrics: dict[str, float]) -> None:
        self.metrics.log(step, metrics, {"trained_groups": batch.trained_groups}, note=batch.note)
        if self.timeline is not None:
            self.records.write_trace(self.timeline.drain())

    def close(self) -> None:
        self.metrics.close()
        self.records.close()
