"""Metrics sinks: one JSONL line per step (always), TensorBoard when installed, W&B when asked, a
console summary line; each evaluation one line of ``eval.jsonl`` (its ``step``: the steps trained
before it, 0 for the baseline), the same sinks against that count (W&B: ``eval/step``, as slime logs it);
and ``slime-mt plot RUN_DIR`` curves (reward with each eval dataset's, turns, lengths, timings)."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

logger = logging.getLogger(__name__)

SUMMARY_KEYS = [
    ("rollout/reward_mean", "reward"),
    ("rollout/turns_mean", "turns"),
    ("train/loss", "loss"),
    ("train/grad_norm", "gnorm"),
    ("train/entropy", "entropy"),
    ("time/step_seconds", "s"),
]


def _wandb_names(options: dict | None) -> dict:
    """slime's W&B naming: ``--wandb-group`` (plus ``_`` and a random id unless the suffix is off) as the
    group and the run's name; ``--wandb-key`` logs in first."""
    import wandb

    options = options or {}
    if options.get("key"):
        wandb.login(key=options["key"])
    if not options.get("group"):
        return {}
    group = options["group"] + ("_" + wandb.util.generate_id() if options.get("suffix", True) else "")
    return {"group": group, "name": group}


class MetricsLogger:
    def __init__(
        self,
        run_dir: str | Path,
        use_tensorboard: bool = True,
        use_wandb: bool = False,
        wandb_project: str | None = None,
        config: dict | None = None,
        wandb_options: dict | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self.eval_path = self.run_dir / EVAL_FILE
        self._tb = None
        self._wandb = None
        if use_tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
            except ImportError:
                logger.info("tensorboard not installed; metrics go to %s only", self.path)
        if use_wandb:
            try:
                import wandb
            except ImportError as e:
                raise RuntimeError("--use-wandb needs the wandb package: pip install wandb") from e
            self._wandb = wandb.init(
                project=wandb_project or "slime_mt",
                config=config or {},
                dir=str(self.run_dir),
                **_wandb_names(wandb_options),
            )
            self._wandb.define_metric("eval/step")
            self._wandb.define_metric("eval/*", step_metric="eval/step")

    def truncate_after(self, step: int) -> None:
        """Drop lines of steps >= ``step`` and the evaluations after more than ``step`` steps trained (a
        resumed run rewrites them)."""
        for path, keep in ((self.path, lambda s: s < step), (self.eval_path, lambda s: s <= step)):
            if not path.is_file():
                continue
            lines = [line for line in path.read_text().splitlines() if line and keep(json.loads(line)["step"])]
            tmp = path.with_suffix(".tmp")
            tmp.write_text("".join(line + "\n" for line in lines))
            tmp.replace(path)

    def log_eval(self, steps_trained: int, metrics: dict[str, float]) -> None:
        """One evaluation, of the weights after ``steps_trained`` steps, to every sink."""
        clean = {k: float(v) for k, v in metrics.items()}
        with open(self.eval_path, "a") as fh:
            fh.write(json.dumps({"step": steps_trained, **clean}) + "\n")
        if self._tb is not None:
            for k, v in clean.items():
                if math.isfinite(v):
                    self._tb.add_scalar(k, v, steps_trained)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({**clean, "eval/step": steps_trained})
        names = sorted({k.split("/")[1] for k in clean if k.count("/") >= 2})
        parts = []
        for name in names:
            shown = [("reward_mean", "reward"), ("pass@1", "pass@1")]
            parts.append(
                f"{name} "
                + " ".join(
                    f"{label} {clean[f'eval/{name}/{key}']:.4g}"
                    for key, label in shown
                    if f"eval/{name}/{key}" in clean
                )
            )
        print(f"[eval after {steps_trained} steps] " + " | ".join(parts), flush=True)

    def log(self, step: int, metrics: dict[str, float], records: dict | None = None, note: str = "") -> None:
        """One step's metrics to every sink; ``records`` (lists, ids) to the JSONL line only; ``note``
        ends the console line (the step's failures)."""
        clean = {k: (float(v) if isinstance(v, (int, float)) else v) for k, v in metrics.items()}
        with open(self.path, "a") as fh:
            fh.write(json.dumps({"step": step, **clean, **(records or {})}) + "\n")
        if self._tb is not None:
            for k, v in clean.items():
                if isinstance(v, float) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(clean, step=step)
        parts = [f"{label} {clean[key]:.4g}" for key, label in SUMMARY_KEYS if key in clean] + ([note] if note else [])
        print(f"[step {step}] " + " | ".join(parts), flush=True)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


EVAL_FILE = "eval.jsonl"


def read_evals(run_dir: str | Path) -> list[dict]:
    """A run's evaluations (``eval.jsonl``; none when it evaluated nothing)."""
    path = Path(run_dir) / EVAL_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl (is this a slime-mt run directory?)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


PLOTS = {
    "reward.png": ["rollout/reward_mean", "rollout/pass_rate"],  # and each eval dataset's (eval.jsonl)
    "turns.png": ["rollout/turns_mean", "rollout/turns_max"],
    "lengths.png": ["rollout/response_tokens_mean", "rollout/tokens_per_turn", "rollout/observation_share"],
    "timings.png": ["time/rollout_seconds", "time/train_seconds", "time/sync_seconds", "time/step_seconds"],
    "train.png": ["train/loss", "train/grad_norm", "train/entropy", "train/clip_fraction"],
    "async.png": [
        "rollout/token_version_gap_mean",
        "time/trainer_idle_seconds",
        "time/rollout_idle_seconds",
        "async/dropped_groups",
        "async/dropped_token_share",
        "async/length_bias_tokens",
        "async/partial_resumes",
    ],
}


def is_async(rows: list[dict]) -> bool:
    """A run that trained tokens of older weights (``--async``, ``--fully-async``)."""
    return any(r.get("rollout/token_version_gap_max", 0) > 0 or "async/dropped_groups" in r for r in rows)


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write PNG curves of a run's metrics into ``run_dir/plots`` -> the files written (``async.png``
    only for a run that trained older weights' tokens)."""
    plt = _pyplot()
    rows, evals = read_metrics(run_dir), read_evals(run_dir)
    eval_keys = sorted({k for e in evals for k in e if k.endswith(("/reward_mean", "/pass@1"))})
    out_dir = Path(run_dir) / "plots"
    out_dir.mkdir(exist_ok=True)
    written = []
    for name, keys in PLOTS.items():
        if name == "async.png" and not is_async(rows):
            continue
        data = rows
        if name == "reward.png":  # an evaluation's step: the steps trained before it (0: the baseline)
            keys, data = [*keys, *eval_keys], rows + evals
        fig = figure(data, keys)
        if fig is None:
            continue
        fig.savefig(out_dir / name, dpi=90)
        plt.close(fig)
        written.append(out_dir / name)
    return written


def figure(rows: list[dict], keys: list[str]):
    """One panel per key present in ``rows``, against the integer step (None: no key present)."""
    from matplotlib.ticker import MaxNLocator

    plt = _pyplot()
    present = [k for k in keys if any(k in r for r in rows)]
    if not present:
        return None
    fig, axes = plt.subplots(len(present), 1, figsize=(7, 2.4 * len(present)), squeeze=False)
    for ax, key in zip(axes[:, 0], present):
        points = [(r["step"], r[key]) for r in rows if key in r]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def _pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
