"""Metrics sinks and plots."""

import json
import subprocess
import sys

from slime_mt.metrics import MetricsLogger, read_metrics


def test_jsonl_lines_truncate_and_plots(tmp_path, capsys):
    logger = MetricsLogger(tmp_path, use_tensorboard=False)
    for step in range(4):
        logger.log(
            step,
            {
                "rollout/reward_mean": step / 4,
                "rollout/turns_mean": 2.0,
                "train/loss": 1.0 - step / 10,
                "time/step_seconds": 3.0,
                "rollout/response_tokens_mean": 40 + step,
            },
        )
    assert "[step 3] reward 0.75 | turns 2 | loss 0.7 | s 3" in capsys.readouterr().out
    logger.truncate_after(2)  # a resumed run rewrites steps 2 and 3
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1]
    proc = subprocess.run([sys.executable, "-m", "slime_mt.cli", "plot", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    written = proc.stdout.split()
    assert any(p.endswith("reward.png") for p in written) and any(p.endswith("timings.png") for p in written)
    assert all((tmp_path / "plots" / name).stat().st_size > 1000 for name in ("reward.png", "turns.png"))
    json.dumps(read_metrics(tmp_path))


def test_plot_of_a_folder_without_metrics(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "slime_mt.cli", "plot", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 2 and "no metrics.jsonl" in proc.stderr


def test_plots_count_steps_in_integers_and_draw_async_only_for_async_runs(tmp_path):
    from slime_mt.metrics import PLOTS, figure, plot_run

    sync_rows = [
        {
            "step": k,
            "rollout/reward_mean": k / 4,
            "rollout/token_version_gap_max": 0.0,
            "rollout/token_version_gap_mean": 0.0,
        }
        for k in range(5)
    ]
    fig = figure(sync_rows, PLOTS["reward.png"])
    ticks = fig.axes[0].get_xticks()
    assert len(ticks) > 1 and all(float(t).is_integer() for t in ticks), ticks  # not 0.2, 0.4, ...
    for rows, folder, drawn in (
        (sync_rows, tmp_path / "sync", False),
        (
            [{**r, "rollout/token_version_gap_max": 1.0, "rollout/token_version_gap_mean": 0.5} for r in sync_rows],
            tmp_path / "async",
            True,
        ),
    ):
        folder.mkdir()
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        names = [p.name for p in plot_run(folder)]
        assert ("async.png" in names) == drawn and "reward.png" in names
