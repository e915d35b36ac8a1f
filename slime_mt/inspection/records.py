"""What a run leaves behind to be inspected, written by its rollout role after every step: the rollout
dump (``--save-debug-rollout-data``; an evaluation's too), the turn records (``turns.jsonl``) and the
timeline (``trace.json``)."""

from __future__ import annotations

from pathlib import Path

from slime_mt.config.checkpoint import dump_path
from slime_mt.inspection.dumps import add_train_log_probs, save_dump, save_eval_dump, settings_of
from slime_mt.inspection.turn_records import TurnRecords
from slime_mt.timeline import TraceWriter


class RunRecords:
    def __init__(self, cfg, run_dir: Path) -> None:
        d = cfg.debug
        self.dump_template = d.save_debug_rollout_data
        self.settings = settings_of(cfg)
        self.turns = TurnRecords(run_dir, d.turn_records, cfg.data.rollout_seed)
        self.trace = TraceWriter(run_dir) if d.trace != "off" else None
        self.dumped: set[int] = set()  # the steps whose dump this run wrote

    def step(self, step: int, groups: list[list], batch) -> None:
        """Step ``step``'s trajectories (``groups``) and the batch made of them."""
        self.turns.write(step, groups)
        if self.dump_template:
            save_dump(dump_path(self.dump_template, step), step, groups, batch, self.settings)
            self.dumped.add(step)

    def evaluated(self, steps_trained: int, datasets: list[tuple[str, list[list]]]) -> None:
        """The evaluation after ``steps_trained`` steps (each dataset's groups, by name): its dump at the
        template's ``eval_N``, as slime names it (no training step's dump has that name)."""
        if self.dump_template:
            path = dump_path(self.dump_template, f"eval_{steps_trained}")
            save_eval_dump(path, steps_trained, datasets, self.settings)

    def trained(self, step: int, log_probs: dict[int, list[float]]) -> None:
        """The trainer's log-probs of step ``step``'s sequences (by index in its batch) into its dump."""
        if step in self.dumped and log_probs:
            add_train_log_probs(dump_path(self.dump_template, step), log_probs)

    def write_trace(self, events: list[dict]) -> None:
        if self.trace is not None:
            self.trace.write(events)

    def resume(self, step: int) -> None:
        self.turns.truncate_after(step)

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()
