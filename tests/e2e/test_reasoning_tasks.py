"""reasoning-gym tasks (envs/reasoning_tasks.py): a dataset of two families written and loaded back
through the project's data loader, each family's own verifier as the reward, and the environment on
a real engine."""

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "rollout"))
from rollout_helpers import make_ctx  # noqa: E402
from train_helpers import demo_train_cmd  # noqa: E402

from envs.reasoning_tasks import ReasoningTaskEnv, main, make_rows, reward, score  # noqa: E402
from slime_mt.config import DataConfig  # noqa: E402
from slime_mt.data import load_rows  # noqa: E402
from slime_mt.rollout.multi_turn import run_episode  # noqa: E402
from slime_mt.types import Sample, Status  # noqa: E402

TASKS = ["basic_arithmetic", "chain_sum"]


def test_two_families_are_written_loaded_and_graded_by_their_own_verifiers(tmp_path, capsys):
    main([str(tmp_path), "--tasks", ",".join(TASKS), "--size", "4", "--seed", "3"])
    assert "wrote 8 rows" in capsys.readouterr().out
    rows = load_rows(tmp_path / "train.jsonl", DataConfig(apply_chat_template=True))
    assert [r.metadata["task"] for r in rows] == TASKS * 4
    assert make_rows(TASKS, 4, 3)[0]["prompt"] == rows[0].prompt  # the same seed, the same tasks
    for row in rows:  # after a JSON round trip the verifier still reads its entry
        assert row.prompt[1]["content"] == row.metadata["entry"]["question"]
        assert score(f"Reasoning... <answer>{row.label}</answer>", row.metadata) == 1.0
        assert score(f"<answer>{int(row.label) + 1}</answer>", row.metadata) == 0.0
        assert score(row.label, row.metadata) == 1.0  # no tags: the whole response is the answer
    sample = Sample(response=f"<answer>1</answer> then <answer>{rows[1].label}</answer>", metadata=rows[1].metadata)
    assert asyncio.run(reward(None, sample)) == 1.0  # the last answer counts


def test_bad_families_and_rows_are_named():
    with pytest.raises(ValueError, match=r"unknown reasoning-gym families \['no_such_task'\]"):
        make_rows(["basic_arithmetic", "no_such_task"], 2, 1)
    with pytest.raises(KeyError, match=r"metadata\['task'\]"):
        score("<answer>1</answer>", {})


def test_the_env_grades_each_turn_and_tells_a_wrong_answer(farm, tiny_paths):
    row = make_rows(["basic_arithmetic"], 1, 5)[0]
    env = ReasoningTaskEnv(row["metadata"])
    observation, done, info = env.step(f"<answer>{row['label']}</answer>")
    assert done and info == {"reward": 1.0}
    observation, done, info = env.step("<answer>not a number</answer>")
    assert not done and info == {"reward": 0.0} and "incorrect" in observation["text"]
    target = farm.target("q2rg-direct", tiny_paths["qwen2"])
    ctx = make_ctx(target.url, target.model_path, max_turns=2, rollout_max_response_len=8)
    sample = Sample(index=0, prompt=row["prompt"], label=row["label"], metadata=row["metadata"])
    stops = list(range(3, 151643, 4)) + [151645]
    params = {"temperature": 1.0, "sampling_seed": 2, "stop_token_ids": stops, "max_new_tokens": 8}
    asyncio.run(run_episode(ctx, sample, params, env=ReasoningTaskEnv(row["metadata"])))
    sample.validate()
    assert sample.status in (Status.COMPLETED, Status.TRUNCATED)
    texts = [ctx.tokenizer.decode(sample.tokens[t.output_start : t.output_end]) for t in sample.turns]
    assert [t.reward for t in sample.turns] == [score(text, row["metadata"]) for text in texts]


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


@pytest.mark.slow
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
