"""reasoning-gym tasks (envs/reasoning_tasks.py): a dataset of two families written and loaded back
through the project's data loader, each family's own verifier as the reward, and the environment on
a real engine."""

import json
import os
import subprocess

import pytest
from train_helpers import demo_train_cmd  # noqa: E402

from envs.reasoning_tasks import main, score  # noqa: E402

TASKS = ["basic_arithmetic", "chain_sum"]


RECORDING_REWARD = """
import json
from pathlib import Path

from envs.reasoning_tasks import reward as verifier


async def reward(args, sample):
    value = await verifier(args, sample)
    row = {"step": sample.metadata["rollout_id"], "response": sample.response, "reward": value,
           "metadata": {"task": sample.metadata["task"], "entry": sample.metadata["entry"]}}
    with open(Path(args.log_dir) / "rewards.jsonl", "a") as fh:
        fh.write(json.dumps(row) + "\\n")
    return value
"""


def test_two_families_train_two_steps_with_their_verifiers_score_as_the_reward(tmp_path, smollm2_path):
    """reasoning-gym's basic_arithmetic and chain_sum, two prompts a step (one of each: no shuffle, the
    rows alternate), single-turn, the family's verifier as --custom-rm-path: every trained reward is
    the verifier's score of that response, recomputed here, and the step's reward is their mean."""
    main([str(tmp_path / "data"), "--tasks", ",".join(TASKS), "--size", "4", "--seed", "3"])
    (tmp_path / "recording.py").write_text(RECORDING_REWARD)
    run = tmp_path / "run"
    cmd = demo_train_cmd(
        smollm2_path,
        tmp_path / "data/train.jsonl",
        run,
        *["--label-key", "label", "--no-rollout-shuffle", "--rollout-interaction-env-path", ""],
        *["--custom-rm-path", f"{tmp_path}/recording.py:reward", "--max-turns", "1"],
        *["--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2"],
        *["--global-batch-size", "4", "--rollout-max-response-len", "32"],
    )
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rewards = [json.loads(line) for line in (run / "rewards.jsonl").read_text().splitlines()]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows:
        mine = [x for x in rewards if x["step"] == row["step"]]
        assert sorted(x["metadata"]["task"] for x in mine) == sorted(TASKS * 2)  # both families each step
        for x in mine:
            assert x["reward"] == score(x["response"], x["metadata"])  # the verifier's score, recomputed
        assert row["rollout/reward_mean"] == pytest.approx(sum(x["reward"] for x in mine) / 4, abs=1e-12)
        assert "rollout/status/failed" not in row and row["train/grad_norm"] >= 0
