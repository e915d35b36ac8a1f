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
