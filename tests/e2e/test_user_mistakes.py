"""A researcher's usual mistakes, each through ``slime-mt train`` as a subprocess (tiny Qwen2, the
embedded engine, Megatron TP=1): the exit code, the exact lines they see, and what the run folder holds.

The tiny model's turns end at one of many stop ids (a few tokens each) and its sampling is seeded per
turn, so which samples fail is fixed by the env, not by chance."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from train_helpers import REPO

from slime_mt.assets import tiny_model_dir

SLIME_MT = str(Path(sys.executable).parent / "slime-mt")  # the console script, as users run it
STOPS = [str(t) for t in range(3, 151643, 3)] + ["151645"]  # a random model ends its turns in ~3 tokens
ROWS = [{"prompt": f"Guess the secret word number {k}.", "secret": w} for k, w in enumerate(["apple", "river"])]

ENVS = {
    # samples 0-4 raise, sample 5 returns a bare string, 6 plays on, 7's reward is NaN
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
        reward = float("nan") if self.index == 7 else float(self.index == 6)
        return {"text": "ok"}, True, {"reward": reward, "tool_ok": self.index == 6}


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
        # issue 67: a NaN reward fails its sample with the reason, and the step trains on the others
        "WARNING slime_mt.failures: step 0: sample 7 (group 1) failed at turn 1: the environment's info['reward'] "
        "gave the reward nan (not a finite number)",
        "WARNING slime_mt.failures: step 0: ... and 2 more: failed: env step raised ValueError",
    ]
    (step_line,) = lines(proc.stdout, "[step 0]")
    assert step_line.endswith(" | 7 failed: env step raised ValueError x5, bad env return x1, reward not finite x1"), (
        step_line
    )
    errors = [json.loads(line) for line in (run / "errors.jsonl").read_text().splitlines()]
    assert [(e["sample"], e["turn"], e["cause"]) for e in errors] == [
        (k, 0, "env step raised ValueError") for k in range(5)
    ] + [(5, 0, "bad env return"), (7, 1, "reward not finite")]
    assert 'raise ValueError("boom")' in errors[0]["traceback"] and errors[5]["traceback"]
    (row,) = metrics(run)
    assert row["rollout/env_failures"] == 7 and row["rollout/status/failed"] == 7
    assert row["rollout/reward_mean"] == 1.0 and "train/loss" in row  # over the samples that did not fail: 6
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
    assert dry.stdout.splitlines()[0] == (  # the plan first, then the settings (issue 67 item 6)
        "# dry run: memory plan of each train rank (TP=1 CP=1 EP=1 DP=1; 4096 tokens per micro-batch from "
        "--micro-batch-size x --rollout-max-context-len):"
    )
    assert dry.stdout.splitlines()[1 : len(plan) + 1] == plan
    assert plan[0].startswith("# dry run:   parameters ")
    assert plan[-3] == (
        "# dry run:   1 train rank from one process (--actor-num-nodes x --actor-num-gpus-per-node give more); "
        "log-probs planned for every token of a micro-batch scored (the most: fewer with long prompts)"
    )
    assert "MALLOC_MMAP_THRESHOLD_=65536" in plan[-2]
    assert plan[-1].startswith("# dry run:   fits --gpu-memory-gb 80 (")
    # the run itself refuses a plan over the device's memory before anything is written
    refused = train(cmd + ["--gpu-memory-gb", "2"], cwd=tmp_path)
    assert refused.returncode == 2 and not run.exists()
    why = refused.stderr.strip().splitlines()[-1]
    assert why.startswith("slime-mt train: error: ConfigError: --gpu-memory-gb 2: the memory plan needs "), why
    assert dry.stdout.splitlines()[-3:] == [
        "# dry run: plug-ins: imported and checked",
        f"# dry run: --prompt-data {tmp_path / 'train.jsonl'}: first row read",
        "# dry run: environment of the first row: CalcEnv built, reset and closed",
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


def _label_missing_in_row_2(tmp_path: Path, cmd: list[str]) -> tuple[list[str], str]:
    rows = [ROWS[0], {"prompt": "Guess again."}]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return cmd, (
        "slime-mt train: error: DatasetError: row 2 of train.jsonl: no key 'secret' (--label-key); the row's keys: "
        "['prompt']"
    )


def _image_key(tmp_path: Path, cmd: list[str]) -> tuple[list[str], str]:
    (tmp_path / "train.jsonl").write_text(json.dumps({"prompt": "<image> What is it?", "images": ["a.png"]}))
    return cmd + ["--multimodal-keys", '{"image": "imgs"}', "--label-key", "prompt"], (
        "slime-mt train: error: DatasetError: row 1 of train.jsonl: 1 <image> placeholders but no key 'imgs' "
        "(--multimodal-keys); the row's keys: ['images', 'prompt']"
    )


def _misspelled_flag(tmp_path: Path, cmd: list[str]) -> tuple[list[str], str]:
    cmd[cmd.index("--label-key")] = "--lable-key"
    return cmd, (
        "slime-mt train: error: unrecognized arguments: --lable-key secret (--lable-key: did you mean --label-key?)"
    )


def _slime_flag(tmp_path: Path, cmd: list[str]) -> tuple[list[str], str]:
    return cmd + ["--kl-coef", "0.05"], (
        "slime-mt train: error: ConfigError: --kl-coef=0.05: a KL penalty in the reward is not implemented here: "
        "use --use-kl-loss --kl-loss-coef (a KL term in the loss)"
    )


def _one_sample_per_prompt(tmp_path: Path, cmd: list[str]) -> tuple[list[str], str]:
    for flag, value in (("--n-samples-per-prompt", "1"), ("--global-batch-size", "2"), ("--micro-batch-size", "2")):
        cmd[cmd.index(flag) + 1] = value
    return cmd, (
        "slime-mt train: error: ConfigError: --n-samples-per-prompt 1 with --advantage-estimator grpo: the "
        "estimator's baseline is the group's other samples, so with one sample per prompt every advantage is 0 and "
        "nothing trains; use --n-samples-per-prompt 2 or more (8 is usual)"
    )


def _build_env_signature(tmp_path: Path, cmd: list[str]) -> tuple[list[str], str]:
    env = tmp_path / "calc_env.py"
    env.write_text(
        ENVS["constant_reward"].replace("def build_env(sample=None, args=None, **kw):", "def build_env(prompt, label):")
    )
    return cmd, (
        f"slime-mt train: error: TrainSetupError: --rollout-interaction-env-path {env}: build_env(prompt, label) "
        "cannot be called as build_env(sample=..., args=...) (missing a required argument: 'prompt'); define it as "
        "build_env(sample=None, args=None, **kw)"
    )


def _no_chat_template(tmp_path: Path, cmd: list[str]) -> tuple[list[str], str]:
    """The tiny model's folder without its chat template (the other files linked)."""
    model = tmp_path / "model"
    model.mkdir()
    for file in Path(cmd[cmd.index("--hf-checkpoint") + 1]).iterdir():
        if file.name != "chat_template.jinja":
            (model / file.name).symlink_to(file)
    cmd[cmd.index("--hf-checkpoint") + 1] = str(model)
    return cmd, (
        f"slime-mt train: error: ConfigError: --hf-checkpoint {model} has no chat template (no chat_template.jinja, "
        "none in tokenizer_config.json) and the prompts are rendered with one (--apply-chat-template): pass a Jinja "
        "template with --chat-template FILE, or train on text prompts as they are with --no-apply-chat-template"
    )


INPUT_MISTAKES = {
    "label missing in row 2": _label_missing_in_row_2,
    "image key": _image_key,
    "misspelled flag": _misspelled_flag,
    "slime flag": _slime_flag,
    "one sample per prompt": _one_sample_per_prompt,
    "build_env signature": _build_env_signature,
    "no chat template": _no_chat_template,
}


@pytest.mark.parametrize("case", INPUT_MISTAKES)
def test_input_mistakes_stop_before_the_run_with_one_line(tmp_path, case):
    """Each stops with exit 2 and one line naming the fix, before the model loads and before the run
    folder exists (issue 67 item 5; rows counted from 1)."""
    run, cmd = setup_run(tmp_path)
    cmd, expected = INPUT_MISTAKES[case](tmp_path, cmd)
    proc = train(cmd, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1] == expected, proc.stderr[-2000:]
    assert not run.exists()
    if case == "no chat template":  # the fix the line names: the dry run passes with a template given
        template = tmp_path / "template.jinja"
        template.write_text((Path(tiny_model_dir("qwen2")) / "chat_template.jinja").read_text())
        fixed = train(cmd + ["--chat-template", str(template), "--dry-run"], timeout=120)
        assert fixed.returncode == 0, fixed.stderr[-2000:]
        assert not run.exists()


def test_slimes_dynamic_batch_flags_are_taken_with_slimes_meaning(tmp_path):
    """--use-dynamic-batch-size --max-tokens-per-gpu 1024 pack micro-batches of 1024 tokens (x CP), as in
    slime: the dry run's memory plan is made for them."""
    run, cmd = setup_run(tmp_path)
    dry = train(cmd + ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "1024", "--dry-run"], timeout=120)
    assert dry.returncode == 0, dry.stderr[-2000:]
    assert lines(dry.stdout, "# dry run: memory plan") == [
        "# dry run: memory plan of each train rank (TP=1 CP=1 EP=1 DP=1; 1024 tokens per micro-batch from "
        "--max-tokens-per-micro-batch):"
    ]
    assert not run.exists()


def test_the_gpu_recipe_without_a_gpu_names_the_cpu_recipe(tmp_path):
    recipe = REPO / "examples/geo3k_vlm_multi_turn/run_geo3k_vlm_multi_turn.sh"
    env = dict(os.environ, MODEL=str(tiny_model_dir("qwen2")), RUN_DIR=str(tmp_path / "run"), PYTHON=sys.executable)
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(["bash", str(recipe)], capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1] == (
        "[geo3k] no GPU here (torch sees none): this recipe trains on GPUs. On CPU, run bash "
        "examples/geo3k_vlm_multi_turn/run_geo3k_vlm_multi_turn_cpu.sh; for a Ray cluster with GPUs, set "
        "RAY_ADDRESS; to see the plan without GPUs, add --dry-run"
    )
    assert not (tmp_path / "run").exists()


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


# ---------------------------------------------------------------- mistakes found once the run is on its way

FLAT_ROLLOUT = """
from slime_mt.rollout.group_rollout import generate_rollout


def flat(args, rollout_id, data_source, evaluation=False):
    return [s for group in generate_rollout(args, rollout_id, data_source, evaluation) for s in group]
"""


def assert_nothing_partial(folder: Path) -> None:
    """No half-written file (files are written as ``*.tmp`` or ``.tmp_*`` and renamed; shards as
    ``.model-part*``) and no lock naming a process."""
    partial = [p for p in folder.rglob("*") if p.name.endswith(".tmp") or p.name.startswith((".tmp_", ".model-part"))]
    assert partial == [], partial
    lock = folder / ".run.lock"
    assert not lock.exists() or lock.read_text() == "", lock.read_text()


def test_a_rollout_function_returning_a_flat_list_is_named_at_the_first_step(tmp_path):
    run, cmd = setup_run(tmp_path)
    (tmp_path / "my_rollout.py").write_text(FLAT_ROLLOUT)
    proc = train(cmd + ["--rollout-function-path", f"{tmp_path}/my_rollout.py:flat"])
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1] == (
        "slime-mt train: error: PluginError: --rollout-function-path returned a flat list: item 0 is a Sample, not "
        "a group; expected list[list[Sample]]: one list per prompt, of its samples (those sharing a group_index)"
    )
    assert not lines(proc.stdout, "[step 0]") and not (run / "metrics.jsonl").exists()
    assert proc.stderr.splitlines()[-1] in (run / "train.log").read_text()
    assert_nothing_partial(run)


def test_a_full_disk_while_saving_names_save_and_the_bytes_and_leaves_nothing_behind(tmp_path):
    """--save on a 1 MiB tmpfs (its own mount namespace): the step trains and is logged, the save fails
    on every rank as one line naming --save, the bytes the checkpoint needs (its weights and two Adam
    moments in fp32, and the model folder's other files) and the bytes free; nothing of it stays."""
    from safetensors import safe_open

    run, cmd = setup_run(tmp_path)
    save, listing = tmp_path / "ckpt", tmp_path / "listing.txt"
    save.mkdir()
    script = f'mount -t tmpfs -o size=1m tmpfs {save} && "$@"; rc=$?; ls -A {save} > {listing}; exit $rc'
    proc = train(["unshare", "-Urm", "sh", "-c", script, "sh", *cmd, "--save", str(save)])
    assert proc.returncode == 2, proc.stderr[-3000:]
    model = Path(cmd[cmd.index("--hf-checkpoint") + 1])
    with safe_open(model / "model.safetensors", "pt") as f:
        numel = sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    files = sum(p.stat().st_size for p in model.iterdir() if not p.name.endswith(".safetensors"))
    assert proc.stderr.splitlines()[-1] == (
        f"slime-mt train: error: CheckpointError: --save {save}: no space left on its disk: checkpoint iter_0000001 "
        f"needs {3 * 4 * numel + files:,} bytes and {1024**2:,} are free there; nothing of it was kept (no "
        "checkpoint was there). Free space or give --save a folder with room, then resume with --load"
    )
    assert listing.read_text() == ""
    (row,) = metrics(run)
    assert "train/loss" in row
    assert_nothing_partial(run)


def test_sigterm_finishes_the_step_saves_and_exits_143_and_a_finished_run_is_not_started_again(tmp_path):
    """SIGTERM (a scheduler's) acts as Ctrl-C: the step finishes, is saved, and the run exits 143 with the
    --load line; the lock a killed run left is taken over with a note; --load of the finished run says
    so, exits 0 and touches nothing."""
    run, cmd = setup_run(tmp_path)
    save = tmp_path / "ckpt"
    cmd[cmd.index("--num-rollout") + 1] = "4"
    cmd += ["--save", str(save), "--save-interval", "100"]
    run.mkdir()
    (run / ".run.lock").write_text("pid 4194304 on gone-host\n")  # what a killed run leaves
    err = tmp_path / "stderr.txt"
    with err.open("w") as stderr:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        child = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
        try:
            deadline = time.time() + 300
            while not (run / "metrics.jsonl").is_file() or not metrics(run):
                assert child.poll() is None and time.time() < deadline, err.read_text()[-3000:]
                time.sleep(0.05)
            child.send_signal(signal.SIGTERM)
            child.wait(timeout=300)
        finally:
            if child.poll() is None:
                child.kill()
    text = err.read_text()
    assert child.returncode == 143, text[-3000:]
    done = len(metrics(run))
    assert 1 <= done < 4 and (save / "latest").read_text() == f"iter_{done:07d}"
    assert text.strip().splitlines()[-1] == (
        f"slime-mt train: stopped by SIGTERM after step {done} of 4; resume it with the same flags and --load {save}"
    )
    assert f"slime-mt train: run folder {run}: taking over the lock of pid 4194304 on gone-host, which is gone" in text
    assert_nothing_partial(run)
    assert_nothing_partial(save)
    before = {p: p.read_bytes() for p in [*run.rglob("*"), *save.rglob("*")] if p.is_file()}
    cmd[cmd.index("--num-rollout") + 1] = str(done)
    finished = train(cmd + ["--load", str(save)], timeout=120)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert finished.stderr.splitlines()[-1] == (
        f"slime-mt train: --load {save}: the run is finished (iter_{done:07d} is after step {done}, --num-rollout "
        f"{done}); nothing to train. Raise --num-rollout to train on from step {done}"
    )
    assert {p: p.read_bytes() for p in [*run.rglob("*"), *save.rglob("*")] if p.is_file()} == before
