"""Checkpoints, the run folder and metrics sinks (``CheckpointConfig``), and inspecting a
run (``DebugConfig``: rollout dumps, rollout-only and train-only runs, turn records, the timeline), with
their rules; the syntax of a dump path template and of ``--turn-records`` lives here, read by
``inspection``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from slime_mt.config.fields import group, option, positive, require
from slime_mt.errors import ConfigError, DumpError, TurnRecordsError


@group("checkpoint")
@dataclass
class CheckpointConfig:
    """Checkpoints, metrics sinks."""

    load: str | None = option(None, "Checkpoint directory to resume from.")
    save: str | None = option(None, "Checkpoint directory to write.")
    save_interval: int | None = option(None, "Save every N steps (and at the end).")
    log_dir: str | None = option(None, "Run directory for metrics JSONL, TensorBoard and plots.")
    overwrite_run_dir: bool = option(
        False,
        "Start over in a run folder that holds an earlier run (without --load it is refused): the earlier "
        "run's files and --save checkpoints move into RUN_DIR/earlier-<time>/, nothing is deleted.",
    )
    use_wandb: bool = option(False, "Log metrics to Weights & Biases.")
    wandb_project: str | None = option(None, "W&B project.")
    wandb_group: str | None = option(
        None, "slime's flag: W&B group; the run is named after it, with a random suffix (slime's naming)."
    )
    wandb_key: str | None = option(None, "slime's flag: W&B API key to log in with (else wandb's own login).")
    disable_wandb_random_suffix: bool = option(False, "slime's flag: the W&B group and run name without the suffix.")

    def wandb_options(self) -> dict:
        """What ``MetricsLogger`` passes W&B: slime's group and run name, and the key to log in with."""
        return {"group": self.wandb_group, "key": self.wandb_key, "suffix": not self.disable_wandb_random_suffix}


@group("debug")
@dataclass
class DebugConfig:
    """Inspecting a run (docs/debugging.md): rollout dumps, rollout-only and train-only runs, turn records,
    the timeline."""

    save_debug_rollout_data: str | None = option(
        None,
        "Write each step's rollout (trajectories, turns, images, what was trained) to this path; "
        "'{rollout_id}' in it is the step (slime's flag), e.g. RUN/dumps/rollout_{rollout_id}.pt.",
    )
    load_debug_rollout_data: str | None = option(
        None,
        "Train on the dumps of --save-debug-rollout-data (the same path, with '{rollout_id}') instead of "
        "generating: no engine starts (implies --debug-train-only). Use the flags of the run that wrote them.",
    )
    debug_rollout_only: bool = option(
        False, "Roll out (metrics, dumps, turn records) without building the Megatron model or training."
    )
    debug_train_only: bool = option(False, "Train without engines, on --load-debug-rollout-data.")
    turn_records: str = option(
        "all", "RUN_DIR/turns.jsonl, one line per turn: all, off, or N (the turns of at most N samples a step)."
    )
    trace: str = option(
        "all",
        "RUN_DIR/trace.json, the run's timeline: all, steps (without the per-trajectory spans), off.",
        choices=["all", "steps", "off"],
    )

    @property
    def train_only(self) -> bool:
        """No engines: training on saved rollouts (slime: loading them implies --debug-train-only)."""
        return self.debug_train_only or self.load_debug_rollout_data is not None


def dump_path(template: str, rollout_id: int | str) -> Path:
    """The dump of step ``rollout_id`` (``{rollout_id}`` in the template, slime's placeholder; ``eval_N``
    for the evaluation after N steps, as slime writes it)."""
    try:
        return Path(template.format(rollout_id=rollout_id))
    except (KeyError, IndexError, ValueError) as e:
        raise DumpError(
            f"--save/--load-debug-rollout-data {template}: only '{{rollout_id}}' may appear in braces ({e})"
        ) from None


def parse_turn_records(value: str) -> int | None:
    """``--turn-records`` -> the samples a step to record (None: all; 0: off)."""
    if value == "all":
        return None
    if value == "off":
        return 0
    if value.isdigit() and int(value) > 0:
        return int(value)
    raise TurnRecordsError(f"--turn-records {value!r}: use all, off, or a number of samples per step (> 0)")


def validate_checkpoint(cfg) -> None:
    """The save cadence."""
    positive(cfg.checkpoint, ("save_interval",), optional=True)


def validate_debug(cfg) -> None:
    """Rollout-only and train-only exclude each other; dump paths hold only ``{rollout_id}``."""
    d = cfg.debug
    require(
        not d.debug_train_only or d.load_debug_rollout_data,
        "debug_train_only",
        True,
        "trains on saved rollouts: give them with --load-debug-rollout-data",
    )
    require(
        not (d.debug_rollout_only and d.load_debug_rollout_data),
        "debug_rollout_only",
        True,
        "rolls out without training, and --load-debug-rollout-data trains without rolling out: choose one",
    )
    require(
        not (d.debug_rollout_only and cfg.cluster.ray),
        "debug_rollout_only",
        True,
        "runs in the launching process; without --ray it starts the engines itself",
    )
    require(
        not (d.debug_rollout_only and cfg.rollout.fully_async),
        "debug_rollout_only",
        True,
        "keeps the starting weights, so --fully-async would find every group past --max-staleness; "
        "roll out in sync or --async mode",
    )
    require(
        not (d.debug_rollout_only and cfg.cluster.colocate),
        "debug_rollout_only",
        True,
        "builds no trainer for --colocate to share the devices with",
    )
    for key in ("save_debug_rollout_data", "load_debug_rollout_data"):
        template = getattr(d, key)
        if template is not None:
            try:
                dump_path(template, 0)
            except DumpError as e:
                raise ConfigError(str(e)) from None
    try:
        parse_turn_records(d.turn_records)
    except TurnRecordsError as e:
        raise ConfigError(str(e)) from None
