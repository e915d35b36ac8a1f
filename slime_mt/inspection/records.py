"""What a run leaves behind to be inspected, written by its rollout side after every step: the rollout
dump (``--save-debug-rollout-data``), the turn records (``turns.jsonl``) and the timeline
(``trace.json``)."""

from __future__ import annotations

from pathlib import Path

from slime_mt.inspection.dumps import dump_path, save_dump, settings_of
from slime_mt.inspection.turn_records import TurnRecords
from slime_mt.timeline import TraceWriter


class RunRecords:
    def __init__(self, cfg, run_dir: Path) -> None:
        d = cfg.debug
        self.dump_template = d.save_debug_rollout_data
        self.settings = settings_of(cfg)
        self.turns = TurnRecords(run_dir, d.turn_records, cfg.data.rollout_seed)
        self.trace = TraceWriter(run_dir) if d.trace != "off" else None

    def step(self, step: int, groups: list[list], batch) -> None:
        """Step ``step``'s trajectories (``groups``) and the batch made of them."""
        self.turns.write(step, groups)
        if self.dump_template:
            save_dump(dump_path(self.dump_template, step), step, groups, batch, self.settings)

    def write_trace(self, events: list[dict]) -> None:
        if self.trace is not None:
            self.trace.write(events)

    def resume(self, step: int) -> None:
        self.turns.truncate_after(step)

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()
