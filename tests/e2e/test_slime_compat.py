"""``--slime-compat``: plug-ins written against slime's API (tests/slime_plugins, in the style of slime's
Search-R1, geo3k VLM multi-turn and custom-rollout examples) train through ``slime-mt train``; slime's
names, ``append_response_tokens``, turns rebuilt from loss-mask runs, the drift of text sent to the
engine, and the built-in graders of ``--rm-type``."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image
from train_helpers import HELPERS

from slime_mt.compat import install

PLUGINS = HELPERS / "slime_plugins"
STOPS = [str(t) for t in range(3, 151643, 3)] + ["151645"]  # a random model ends its turns in ~3 tokens
DRIFT_WARNING = "WARNING slime_mt.compat: a plug-in sent text to the engine (POST /generate with 'text') instead"

install()

# ---------------------------------------------------------------- slime plug-ins, two steps each


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("slime_data")
    rows = [
        {"prompt": "What is the capital of France? Search, then answer in <answer></answer>.", "label": "Paris"},
        {"prompt": "Which is the tallest mountain? Search, then answer in <answer></answer>.", "label": "Everest"},
    ]
    (folder / "search.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    Image.new("RGB", (64, 64), (200, 30, 30)).save(folder / "figure.png")
    figures = [
        {"messages": [{"role": "user", "content": "<image>What is x? Answer in \\boxed{}."}], "label": "3"},
        {"messages": [{"role": "user", "content": "<image>Find the angle y."}], "label": "45"},
    ]
    (folder / "figures.jsonl").write_text("".join(json.dumps({**r, "images": ["figure.png"]}) + "\n" for r in figures))
    return folder


def train(model: Path, run: Path, *flags: str) -> subprocess.CompletedProcess:
    """``slime-mt train --slime-compat`` from the plug-ins' folder (module-form paths, as slime runs them)."""
    cmd = [
        *(sys.executable, "-m", "slime_mt.cli", "train", "--slime-compat", "--hf-checkpoint", str(model)),
        *("--apply-chat-template", "--rollout-max-context-len", "1024", "--rollout-stop-token-ids", *STOPS),
        *("--n-samples-per-prompt", "4", "--micro-batch-size", "4", "--num-rollout", "2", "--log-dir", str(run)),
        *flags,
    ]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=PLUGINS, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def rows_of(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    return rows


def test_a_search_agent_that_sends_text_trains_with_its_reward_and_the_drift_counted(tmp_path, data, tiny_paths):
    run = tmp_path / "run"
    proc = train(
        tiny_paths["qwen2"],
        run,
        *("--prompt-data", str(data / "search.jsonl"), "--rollout-max-response-len", "24"),
        *("--custom-generate-function-path", "search_generate.generate"),
        *("--custom-rm-path", "search_generate.reward_func"),
        *("--rollout-batch-size", "2", "--global-batch-size", "8"),
    )
    for text in (proc.stderr, (run / "train.log").read_text()):
        assert len([line for line in text.splitlines() if line.startswith(DRIFT_WARNING)]) == 1  # once per run
    rows = rows_of(run)
    rewards = [json.loads(line) for line in (run / "rewards.jsonl").read_text().splitlines()]
    for row in rows:
        mine = [r["reward"] for r in rewards if r["step"] == row["step"]]
        assert len(mine) == 8 and row["rollout/reward_mean"] == pytest.approx(sum(mine) / 8, abs=1e-12)
        assert row["rollout/samples_with_rebuilt_turns"] == 8 and row["rollout/turns_mean"] >= 1
        assert row["rollout/generated_tokens"] > 0 and "rollout/status/failed" not in row
        assert 0 <= row["rollout/text_drift_samples"] <= 8
    assert sum(r["rollout/text_drift_tokens"] for r in rows) > 0  # the observation glued to the model's last word
    assert any(r["train/grad_norm"] > 0 for r in rows)


def test_a_vlm_multi_turn_rollout_with_an_env_module_trains_step_wise_on_rebuilt_turns(tmp_path, data, tiny_paths):
    run = tmp_path / "run"
    proc = train(
        tiny_paths["qwen2.5-vl"],
        run,
        *("--prompt-data", str(data / "figures.jsonl"), "--input-key", "messages"),
        *("--multimodal-keys", '{"image": "images"}', "--rollout-max-response-len", "24"),
        *("--custom-generate-function-path", "vlm_rollout.generate", "--rollout-interaction-env-path", "vlm_env.py"),
        *("--max-turns", "2", "--rm-type", "random", "--sample-format", "step_wise"),
        *("--rollout-batch-size", "1", "--global-batch-size", "4"),
    )
    assert DRIFT_WARNING not in proc.stderr  # token ids in, no drift
    rows = rows_of(run)
    returned = [json.loads(line) for line in (run / "returned.jsonl").read_text().splitlines()]
    assert len(returned) == 8 and any(r["images"] == 2 for r in returned)  # turn 2 saw the env's second figure
    for row in rows:
        turns = row["rollout/turns_mean"] * 4
        assert row["rollout/samples_with_rebuilt_turns"] == 4 and row["train/sequences_before_merge"] == turns
        assert "rollout/status/failed" not in row and "rollout/text_drift_tokens" not in row
    assert any(r["train/grad_norm"] > 0 for r in rows)


def test_a_rollout_function_returning_rollout_fn_train_output_trains_and_logs_its_metrics(tmp_path, data, tiny_paths):
    run = tmp_path / "run"
    proc = train(
        tiny_paths["qwen2"],
        run,
        *("--prompt-data", str(data / "search.jsonl"), "--rollout-max-response-len", "24"),
        *("--rollout-function-path", "rollout_fn.generate_rollout"),
        *("--custom-generate-function-path", "rollout_fn.generate", "--rm-type", "random"),
        *("--sample-format", "step_wise", "--rollout-batch-size", "1", "--global-batch-size", "4"),
    )
    assert DRIFT_WARNING not in proc.stderr
    for row in rows_of(run):
        assert row["custom/response_length_max"] >= 1
        assert row["rollout/samples_with_rebuilt_turns"] == 4 and row["train/sequences_before_merge"] == 4
        assert "rollout/status/failed" not in row


def test_a_slime_plugin_without_the_flag_is_caught_before_the_run_with_the_hint(tmp_path, data, tiny_paths):
    """``--dry-run`` imports every plug-in: without ``--slime-compat`` the error names the flag; with it
    the same command passes."""
    cmd = [
        *(sys.executable, "-m", "slime_mt.cli", "train", "--dry-run", "--hf-checkpoint", str(tiny_paths["qwen2"])),
        *("--prompt-data", str(data / "search.jsonl"), "--custom-generate-function-path", "search_generate.generate"),
    ]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=PLUGINS, env=env)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "slime-mt train: error: PluginError: --custom-generate-function-path: plug-in module 'search_generate' "
        "raised while importing: ModuleNotFoundError: No module named 'slime' (a plug-in written against slime's "
        "API: add --slime-compat)"
    )
    proc = subprocess.run([*cmd, "--slime-compat"], capture_output=True, text=True, timeout=120, cwd=PLUGINS, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "# dry run: plug-ins: imported and checked" in proc.stdout


def test_images_under_compat_with_the_frameworks_own_generate_are_refused_before_the_run(tmp_path, data, tiny_paths):
    """Issue 44 item 13: --slime-compat hands rollouts.multi_turn the rendered text prompt, so a dataset of
    images would reach the engine without them (an HTTP 400 per sample after the model loaded): --dry-run
    (and preflight) refuse it naming the combination; slime's own VLM generate function is accepted."""
    cmd = [
        *(sys.executable, "-m", "slime_mt.cli", "train", "--dry-run", "--slime-compat"),
        *("--hf-checkpoint", str(tiny_paths["qwen2.5-vl"]), "--prompt-data", str(data / "figures.jsonl")),
        *("--input-key", "messages", "--multimodal-keys", '{"image": "images"}'),
    ]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=PLUGINS, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "slime-mt train: error: TrainSetupError: --slime-compat with images (--multimodal-keys) and this project's "
        "own generate function (--custom-generate-function-path rollouts.multi_turn.generate)"
    ), last
    proc = subprocess.run(
        [*cmd, "--custom-generate-function-path", "vlm_rollout.generate"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=PLUGINS,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
