"""The environment examples (examples/search_agent, code_agent, judge_feedback), each trained for two
steps with SmolLM2-135M-Instruct from its own make_data.py and config.yaml, as its README says: the
run trains, no sample fails, and the metrics show the environment at work (searches answered, code
run in the sandbox, the judge's scores and cache)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from train_helpers import REPO, TWO_SMALL_STEPS


def train_example(name: str, model: Path, tmp_path: Path, *extra: str) -> list[dict]:
    """make_data.py, then ``slime-mt train`` with the example's config for two small steps -> the
    metrics rows."""
    data, run = tmp_path / "data", tmp_path / "run"
    subprocess.run([sys.executable, str(REPO / f"examples/{name}/make_data.py"), str(data)], check=True, cwd=REPO)
    cmd = [
        sys.executable,
        "-m",
        "slime_mt.cli",
        "train",
        "--config",
        str(REPO / f"examples/{name}/config.yaml"),
        "--hf-checkpoint",
        str(model),
        "--prompt-data",
        str(data / "train.jsonl"),
        "--log-dir",
        str(run),
        *TWO_SMALL_STEPS,
        *extra,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows:
        assert "rollout/status/failed" not in row and "rollout/termination/error" not in row
        assert row["rollout/generated_tokens"] > 0 and row["train/grad_norm"] >= 0
    return rows


# one prompt's group of two samples a step (the recipe's sizes, set small for CI's time)
SMALL = ["--n-samples-per-prompt", "2", "--global-batch-size", "2", "--micro-batch-size", "2"]


def test_the_search_agent_example_trains_two_steps(tmp_path, smollm2_path):
    rows = train_example("search_agent", smollm2_path, tmp_path, "--max-turns", "3")  # four samples a step
    # what the first steps of a 135M model show (README): turns that counted toward --max-turns, the env's
    # observations (passages, or the feedback on an invalid action), and invalid actions told so; a
    # reward is an exact match (1), the format's 0.1 or 0
    assert sum(r["rollout/valid_turns_mean"] for r in rows) > 0
    assert all(r["rollout/observation_tokens"] > 0 for r in rows)
    assert all("rollout/invalid_actions_per_turn" in r for r in rows)
    assert all(0.0 <= r["rollout/reward_mean"] <= 1.0 for r in rows)


def test_the_code_agent_example_trains_two_steps(tmp_path, smollm2_path):
    from envs.python_sandbox import sandbox_mode

    # the sandbox refuses model code without namespaces unless told (then env/isolated says 0)
    unisolated = ["--sandbox-allow-unisolated"] if sandbox_mode() != "isolated" else []
    rows = train_example("code_agent", smollm2_path, tmp_path, *SMALL, "--max-turns", "2", *unisolated)
    assert all(r["env/isolated"] == float(not unisolated) for r in rows if "env/isolated" in r)
    assert any("env/exit_code" in r for r in rows)  # the model's code ran in the sandbox
    assert all(r["rollout/finish_reason/stop"] > 0 for r in rows)  # turns ended at the code's closing fence


def test_the_judge_feedback_example_trains_two_steps(tmp_path, smollm2_path):
    rows = train_example("judge_feedback", smollm2_path, tmp_path, *SMALL)
    judged = [r for r in rows if "judge/calls" in r]  # a step whose turns all hit the length limit asks none
    assert judged and all(r["judge/calls"] > 0 and "judge/cache_hit_rate" in r for r in judged)
    scored = [r for r in rows if "env/judge_score" in r]
    assert scored  # the example's parser read the judge's verdicts
    assert all(0.0 <= r["rollout/reward_mean"] <= 1.0 for r in rows)  # the score over --judge-max-score
