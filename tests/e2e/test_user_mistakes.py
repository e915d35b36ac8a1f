"""A researcher's usual mistakes, each through ``slime-mt train`` as a subprocess (tiny Qwen2, the
embedded engine, Megatron TP=1): the exit code, the exact lines they see, and what the run folder holds.

The tiny model's turns end at one of many stop ids (a few tokens each) and its sampling is seeded per
turn, so which samples fail is fixed by the env, not by chance."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from train_helpers import REPO

SLIME_MT = str(Path(sys.executable).parent / "slime-mt")  # the console script, as users run it
STOPS = [str(t) for t in range(3, 151643, 3)] + ["151645"]  # a random model ends its turns in ~3 tokens
ROWS = [{"prompt": f"Guess the secret word number {k}.", "secret": w} for k, w in enumerate(["apple", "river"])]

ENVS = {
    # samples 0-4 raise, sample 5 returns a bare string, 6 and 7 play on
    "some_fail": """
from envs.base import BaseInteractionEnv


class Env(BaseInteractionEnv):
    def __init__(self, index):
        self.index = index

    def step(self, response_text):
        if self.index <= 4:
            raise ValueError("boom")
        if self.index == 5:
            return "not a tuple"
        return {"text": "ok"}, True, {"reward": float(self.index == 6), "tool_ok": self.index == 6}


def build_env(sample=None, args=None, **kw):
    return Env(sample.index)
""",
    "all_fail": """
from envs.base import BaseInteractionEnv


class Env(BaseInteractionEnv):
    def step(self, response_text):
        raise ValueError("boom")


def build_env(sample=None, args=None, **kw):
    return Env()
""",
    "constant_reward": """
from envs.base import BaseInteractionEnv


class CalcEnv(BaseInteractionEnv):
    def step(self, response_text):
        return {"text": "ok"}, True, {"reward": 0.5, "tool_ok": True}


def build_env(sample=None, args=None, **kw):
    return CalcEnv()
""",
    "raising_generate": """
from rollouts.multi_turn import generate as multi_turn


async def generate(args, sample, sampling_params):
    if sample.index % 2:
        raise RuntimeError(f"my generate broke on sample {sample.index}")
    return await multi_turn(args, sample, sampling_params)
""",
}


def setup_run(tmp_path: Path, env: str = "constant_reward") -> tuple[Path, list[str]]:
    """Data, env module and the base command; -> (run folder, command)."""
    from slime_mt.assets import tiny_model_dir

    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / "calc_env.py").write_text(ENVS[env])
    run = tmp_path / "run"
    cmd = [
        SLIME_MT,
        "train",
        "--hf-checkpoint",
        str(tiny_model_dir("qwen2")),
        "--prompt-data",
        str(tmp_path / "train.jsonl"),
        "--label-key",
        "secret",
        "--apply-chat-template",
        "--rollout-interaction-env-path",
        str(tmp_path / "calc_env.py"),
        "--max-turns",
        "2",
        "--rollout-max-response-len",
        "48",
        "--rollout-max-context-len",
        "512",
        "--rollout-stop-token-ids",
        *STOPS,
        "--n-samples-per-prompt",
        "4",
        "--rollout-batch-size",
        "2",
        "--global-batch-size",
        "8",
        "--micro-batch-size",
        "8",
        "--num-rollout",
        "1",
        "--log-dir",
        str(run),
    ]
    return run, cmd


def train(cmd: list[str], cwd: Path = REPO, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)


def lines(text: str, start: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(start)]


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_env_failures_of_some_samples_are_logged_summed_up_and_kept(tmp_path):
    run, cmd = setup_run(tmp_path, "some_fail")
    proc = train(cmd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    failed = lines(proc.stderr, "WARNING slime_mt.failures: step 0: ")
    assert failed == [
        "WARNING slime_mt.failures: step 0: sample 0 (group 0) failed at turn 0: env step raised ValueError: boom",
        "WARNING slime_mt.failures: step 0: sample 1 (group 0) failed at turn 0: env step raised ValueError: boom",
        "WARNING slime_mt.failures: step 0: sample 2 (group 0) failed at turn 0: env step raised ValueError: boom",
        "WARNING slime_mt.failures: step 0: sample 5 (group 1) failed at turn 0: env step must return "
        "(observation: dict, done: bool, info: dict), got 'not a tuple'",
        "WARNING slime_mt.failures: step 0: ... and 2 more: failed: env step raised ValueError",
    ]
    (step_line,) = lines(proc.stdout, "[step 0]")
    assert step_line.endswith(" | 6 failed: env step raised ValueError x5, bad env return x1"), step_line
    errors = [json.loads(line) for line in (run / "errors.jsonl").read_text().splitlines()]
    assert [(e["sample"], e["turn"], e["cause"]) for e in errors] == [
        (k, 0, "env step raised ValueError") for k in range(5)
    ] + [(5, 0, "bad env return")]
    assert 'raise ValueError("boom")' in errors[0]["traceback"] and errors[5]["traceback"]
    (row,) = metrics(run)
    assert row["rollout/env_failures"] == 6 and row["rollout/status/failed"] == 6
    assert row["env/tool_ok"] == 0.5  # info numbers: samples 6 (True) and 7 (False), one turn each
    log = (run / "train.log").read_text()
    assert step_line in log and failed[0].split(": ", 1)[1] in log
    assert "env step raised ValueError" in log and (run / "config.yaml").is_file()


def test_steps_where_every_sample_fails_are_skipped_then_stop_the_run_with_the_summary(tmp_path):
    """With --max-failed-steps 2 the first such step is skipped (nothing trained) and the second stops
    the run: one line, exit 1, never an autograd error."""
    run, cmd = setup_run(tmp_path, "all_fail")
    cmd[cmd.index("--num-rollout") + 1] = "3"
    proc = train(cmd + ["--max-failed-steps", "2"])
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1] == (
        "slime-mt train: error: RolloutFailedError: step 1: every sample failed (8 failed: env step raised "
        "ValueError x8), 2 step(s) in a row (--max-failed-steps 2); nothing to train on. First: sample 8: "
        f"env step raised ValueError: boom. Every failure with its traceback: {run / 'errors.jsonl'}"
    )
    assert "does not require grad" not in proc.stderr and "Traceback" not in proc.stderr
    assert "WARNING slime_mt.roles.train: step 0: no trainable token in the batch; the step is skipped" in proc.stderr
    (step_line,) = lines(proc.stdout, "[step 0]")
    assert step_line.endswith(" | 8 failed: env step raised ValueError x8"), step_line
    assert len((run / "errors.jsonl").read_text().splitlines()) == 16
    (row,) = metrics(run)
    assert row["train/skipped_steps"] == 1 and "train/loss" not in row
    assert proc.stderr.splitlines()[-1] in (run / "train.log").read_text()


def test_a_generate_function_that_raises_fails_its_samples_and_the_others_train(tmp_path):
    run, cmd = setup_run(tmp_path)
    (tmp_path / "my_generate.py").write_text(ENVS["raising_generate"])
    proc = train(cmd + ["--custom-generate-function-path", f"{tmp_path}/my_generate.py:generate"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert lines(proc.stderr, "WARNING slime_mt.failures: step 0: sample 1 ") == [
        "WARNING slime_mt.failures: step 0: sample 1 (group 0) failed at turn 0: generate raised RuntimeError: "
        "my generate broke on sample 1"
    ]
    (step_line,) = lines(proc.stdout, "[step 0]")
    assert step_line.endswith(" | 4 failed: generate raised RuntimeError x4"), step_line
    (row,) = metrics(run)
    assert row["rollout/status/failed"] == 4 and row["rollout/status/completed"] == 4
    assert row["rollout/termination/error"] == 4 and row["rollout/termination/env_done"] == 4
    assert "train/loss" in row and row.get("train/skipped_steps") is None


def test_a_module_env_path_resolves_from_the_working_directory_and_equal_rewards_warn(tmp_path):
    run, cmd = setup_run(tmp_path)
    cmd[cmd.index("--rollout-interaction-env-path") + 1] = "calc_env"
    dry = train(cmd + ["--dry-run", "--gpu-memory-gb", "80"], cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr[-3000:]
    plan = lines(dry.stdout, "# dry run:   ")
    assert lines(dry.stdout, "# dry run: memory plan") == [
        "# dry run: memory plan of each train rank (TP=1 CP=1 EP=1 DP=1; 4096 tokens per micro-batch from "
        "--micro-batch-size x --rollout-max-context-len):"
    ]
    assert plan[0].startswith("# dry run:   parameters ")
    assert plan[-1].startswith("# dry run:   fits --gpu-memory-gb 80 (")
    # the run itself refuses a plan over the device's memory before anything is written
    refused = train(cmd + ["--gpu-memory-gb", "2"], cwd=tmp_path)
    assert refused.returncode == 2 and not run.exists()
    why = refused.stderr.strip().splitlines()[-1]
    assert why.startswith("slime-mt train: error: ConfigError: --gpu-memory-gb 2: the memory plan needs "), why
    assert dry.stdout.splitlines()[-3:] == [
        "# dry run: plug-ins: imported and checked",
        f"# dry run: --prompt-data {tmp_path / 'train.jsonl'}: row 0 read",
        "# dry run: environment of row 0: CalcEnv built, reset and closed",
    ]
    proc = train(cmd, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert lines(proc.stderr, "WARNING slime_mt.failures:") == [
        "WARNING slime_mt.failures: step 0: every group's rewards are equal within the group (0.5): the "
        "advantages are 0, so the loss and the grad norm are 0 and nothing is learned from this step; check "
        "the reward (--custom-rm-path, the env's info['reward'], --label-key) or the task's difficulty"
    ]
    (row,) = metrics(run)
    assert row["train/loss"] == 0.0 and row["env/tool_ok"] == 1.0 and row["rollout/reward_mean"] == 0.5


def test_every_turn_cut_at_the_length_limit_names_the_flag(tmp_path):
    run, cmd = setup_run(tmp_path)
    cmd[cmd.index("--rollout-max-response-len") + 1] = "1"
    cmd = cmd[: cmd.index("--rollout-stop-token-ids")] + cmd[cmd.index("--n-samples-per-prompt") :]
    proc = train(cmd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = lines(proc.stderr, "WARNING slime_mt.failures:")
    assert warnings[0] == (
        "WARNING slime_mt.failures: step 0: 8 of 8 turns ended at the length limit (finish_reason length), so "
        "the env saw few finished answers: raise --rollout-max-response-len or check the stop tokens "
        "(--rollout-stop, --rollout-stop-token-ids)"
    )
    assert "every group's rewards are equal within the group (0)" in warnings[1]  # the env was never asked
    assert lines(proc.stderr, "INFO slime_mt.failures:") == [
        f"INFO slime_mt.failures: step 0: sample {k} (group 0) truncated at turn 0: turn hit the length limit "
        "(--rollout-max-response-len, or what --rollout-max-context-len left)"
        for k in range(3)
    ] + [
        "INFO slime_mt.failures: step 0: ... and 5 more: truncated: turn hit the length limit "
        "(--rollout-max-response-len, or what --rollout-max-context-len left)"
    ]
    (step_line,) = lines(proc.stdout, "[step 0]")
    assert step_line.endswith(" | 8 truncated: turn hit the length limit x8"), step_line
    assert not (run / "errors.jsonl").exists()


@pytest.mark.parametrize("case", ["label key", "image key", "misspelled flag"])
def test_input_mistakes_stop_before_the_run_with_one_line(tmp_path, case):
    run, cmd = setup_run(tmp_path)
    if case == "label key":
        cmd[cmd.index("--label-key") + 1] = "answer"
        expected = (
            "slime-mt train: error: DatasetError: row 0 of train.jsonl: no key 'answer' (--label-key); the "
            "row's keys: ['prompt', 'secret']"
        )
    elif case == "image key":
        (tmp_path / "train.jsonl").write_text(json.dumps({"prompt": "<image> What is it?", "images": ["a.png"]}))
        cmd += ["--multimodal-keys", '{"image": "imgs"}', "--label-key", "prompt"]
        expected = (
            "slime-mt train: error: DatasetError: row 0 of train.jsonl: 1 <image> placeholders but no key 'imgs' "
            "(--multimodal-keys); the row's keys: ['images', 'prompt']"
        )
    else:
        cmd[cmd.index("--label-key")] = "--lable-key"
        expected = (
            "slime-mt train: error: unrecognized arguments: --lable-key secret (--lable-key: did you mean --label-key?)"
        )
    proc = train(cmd, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1] == expected, proc.stderr[-2000:]
    assert not run.exists()


def test_the_run_folder_explains_and_reproduces_the_run(tmp_path):
    """A 2-step run's folder: config.yaml runs the same settings again with --config (same rewards,
    tokens and losses), train.log holds what the terminal showed, and a second run into it is refused."""
    run, cmd = setup_run(tmp_path, "some_fail")
    cmd[cmd.index("--num-rollout") + 1] = "2"
    first = train(cmd + ["--rollout-concurrency", "1"])
    assert first.returncode == 0, first.stderr[-3000:]
    log = (run / "train.log").read_text()
    assert log.splitlines()[0] == f"slime-mt train: run folder {run}"
    assert all(line in log for line in lines(first.stdout, "[step "))
    again = train([SLIME_MT, "train", "--config", str(run / "config.yaml"), "--log-dir", str(tmp_path / "again")])
    assert again.returncode == 0, again.stderr[-3000:]
    keys = ("rollout/reward_mean", "rollout/generated_tokens", "rollout/env_failures", "train/loss", "train/grad_norm")
    for a, b in zip(metrics(run), metrics(tmp_path / "again"), strict=True):
        assert [a[k] for k in keys] == pytest.approx([b[k] for k in keys], rel=1e-6, abs=1e-9)
    # issue 44 item 9: the same command again into the same folder is refused before anything is written
    names = ("metrics.jsonl", "config.yaml", "train.log", "turns.jsonl", "errors.jsonl", "trace.json")
    before = {name: (run / name).read_bytes() for name in names}
    mixed = train(cmd + ["--rollout-concurrency", "1"])
    assert mixed.returncode == 2, mixed.stderr[-3000:]
    assert lines(mixed.stderr, "slime-mt train: error:") == [
        f"slime-mt train: error: RunDirError: run folder {run} holds an earlier run (config.yaml, train.log, "
        "errors.jsonl, metrics.jsonl, turns.jsonl, trace.json): resume it with --load <its --save folder>, start "
        f"over with --overwrite-run-dir (its files move to {run}/earlier-<time>/, nothing is deleted), or give this "
        "run another --log-dir"
    ]
    assert {name: (run / name).read_bytes() for name in before} == before
