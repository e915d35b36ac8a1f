"""examples/openai_agent (an agent on the plain openai client, behind the gateway) trained for two steps,
as a function in the rollout process and as a separate program. What these runs check is plumbing (every
call a turn, the answers sent back as the model's own ids, the merge, the mode), so they train the tiny
Qwen2 (random weights, the Qwen chat template and tool-call format of the recipe's parser) in place of the
recipe's SmolLM2-135M-Instruct (issue 68: about 105-120 s each on this machine before). Every session
makes two calls or more (after its first the agent either sends a tool's result or nudges)."""

import json
import os
import subprocess
import sys

import pytest
from train_helpers import REPO, TWO_SMALL_STEPS

SESSIONS = 2  # agent sessions a step: one prompt's group


@pytest.fixture(scope="module")
def agent_data(tmp_path_factory):
    data = tmp_path_factory.mktemp("agent_data")
    subprocess.run([sys.executable, str(REPO / "examples/openai_agent/make_data.py"), str(data)], check=True, cwd=REPO)
    return data / "train.jsonl"


# The ways in (a function, a program) and the modes (sync, fully-async) pairwise: the program in sync
# training, the function in fully-async training (a function agent in a sync rollout is covered,
# without training, by tests/gateway/test_agent_rollout.py); a third run would cost a minute of CI
@pytest.mark.parametrize("way", ["command", "fully-async"])
def test_the_example_agent_trains_two_steps(tmp_path, agent_data, tiny_paths, way):
    run = tmp_path / "run"
    extra = []
    if way == "command":
        extra = [
            "--agent-function-path",
            "",
            "--agent-command",
            f"{sys.executable} examples/openai_agent/command_agent.py",
        ]
    if way == "fully-async":
        extra = ["--fully-async", "--partial-rollout", "--max-staleness", "1", "--use-tis"]
    cmd = [
        sys.executable, "-m", "slime_mt.cli", "train", "--config", str(REPO / "examples/openai_agent/config.yaml"),
        "--hf-checkpoint", str(tiny_paths["qwen2"]), "--prompt-data", str(agent_data), "--log-dir", str(run),
        *TWO_SMALL_STEPS, "--n-samples-per-prompt", str(SESSIONS), "--global-batch-size", str(SESSIONS),
        "--micro-batch-size", str(SESSIONS), *extra,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows:
        assert "rollout/status/failed" not in row, proc.stderr[-3000:]
        calls = row["gateway/calls"]
        assert calls == row["rollout/turns_mean"] * SESSIONS  # every call is a turn of its sample
        assert calls >= 2 * SESSIONS  # the agent calls again after a tool call or an answer without one
        assert row["train/sequences_before_merge"] == calls  # one step-wise sample per call
        assert row["train/sequences_after_merge"] == SESSIONS  # the agent only appends: one sequence per session
        assert row["gateway/kept_messages"] == calls - SESSIONS  # every answer went back as the model's own ids
        assert 0.0 <= row["rollout/reward_mean"] <= 1.0 and "agent/good_tool_call" in row
        assert row["train/loss"] == row["train/loss"]  # a number, not NaN
    assert all(("async/dropped_groups" in r) == (way == "fully-async") for r in rows)  # the mode that ran
    if way == "fully-async":
        assert [r["rollout/weight_version"] for r in rows] == [1.0, 2.0]
        trained = [g for r in rows for g in r["trained_groups"]]
        assert len(trained) == len(set(trained)) == 2
        assert max(r["rollout/token_version_gap_max"] for r in rows) <= 1
