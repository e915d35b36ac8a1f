"""examples/custom_generate (the demo's game as one generate function that sets ``sample.reward``)
trained for two steps with SmolLM2-135M-Instruct, concat and step-wise: the reward the function set
is the reward trained and reported, its turns count, and step-wise training sees every turn."""

import json
import os
import subprocess
import sys

import pytest
from train_helpers import REPO, TWO_SMALL_STEPS, demo_train_cmd

RECORDING = """
import json
from pathlib import Path

from slime_mt.plugins import load_function

example = load_function("{repo}/examples/custom_generate/generate.py:generate")


async def generate(args, sample, sampling_params):
    sample = await example(args, sample, sampling_params)
    with open(Path(args.log_dir) / "returned.jsonl", "a") as fh:
        row = {{"step": sample.metadata["rollout_id"], "reward": sample.reward, "turns": len(sample.turns)}}
        fh.write(json.dumps(row) + "\\n")
    return sample
"""


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory):
    data = tmp_path_factory.mktemp("demo_data")
    subprocess.run([sys.executable, str(REPO / "examples/demo/make_data.py"), str(data)], check=True, cwd=REPO)
    (data / "recording.py").write_text(RECORDING.format(repo=REPO))
    return data


# concat and step_wise; a custom generate function trained step-wise with --merge-step-wise is
# tests/test_openai_agent.py (rollouts.agent.generate is one, its merged sequences counted there)
@pytest.mark.parametrize("sample_format", [["--sample-format", "concat"], ["--sample-format", "step_wise"]])
def test_a_custom_generate_function_trains_with_the_reward_it_set(tmp_path, demo_data, smollm2_path, sample_format):
    run = tmp_path / "run"
    cmd = demo_train_cmd(
        smollm2_path,
        demo_data / "train.jsonl",
        run,
        "--custom-generate-function-path",
        f"{demo_data}/recording.py:generate",
        *TWO_SMALL_STEPS,
        *sample_format,
    )
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-3000:]
    returned = [json.loads(line) for line in (run / "returned.jsonl").read_text().splitlines()]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows:
        mine = [x for x in returned if x["step"] == row["step"]]
        assert len(mine) == 4
        assert row["rollout/reward_mean"] == pytest.approx(sum(x["reward"] for x in mine) / 4, abs=1e-12)
        assert row["rollout/turns_mean"] == pytest.approx(sum(x["turns"] for x in mine) / 4, abs=1e-12)
        assert row["rollout/generated_tokens"] > 0 and "rollout/samples_without_turns" not in row
        assert "rollout/status/failed" not in row and "rollout/termination/error" not in row
        if "step_wise" in sample_format:
            assert row["train/sequences_before_merge"] == sum(x["turns"] for x in mine)
    rewards = {x["reward"] for x in returned}
    assert len(rewards) > 1 and any(r["train/grad_norm"] > 0 for r in rows)  # the rewards it set taught
