"""The recipes users start from, run as shipped: the geo3k VLM multi-turn CPU recipe (its shell script,
with evaluation), its long-trajectory variant (LONG=1: 20 turns, context parallelism, recompute) and
the context-management example (the demo game, ``window:1``, step-wise, merged)."""

import json
import re
import subprocess
import sys
from pathlib import Path

from inspection_helpers import (
    SAMPLE_FIELDS,
    SEQUENCE_FIELDS,
    TRAIN_FIELDS,
    TURN_FIELDS,
    dump_template,
)
from train_helpers import PLUGINS, REPO, demo_train_cmd, metrics, repo_env, run

from slime_mt.config.checkpoint import dump_path
from slime_mt.inspection.dumps import load_dump
from slime_mt.metrics import read_evals


def test_cpu_recipe_runs(tmp_path):
    proc = subprocess.run(
        [
            "bash",
            str(REPO / "examples/geo3k_vlm_multi_turn/run_geo3k_vlm_multi_turn_cpu.sh"),
            "1",
            "--n-samples-per-eval-prompt",
            "2",
            "--eval-temperature",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
        env=repo_env(RUN_DIR=str(tmp_path), PYTHON=sys.executable),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(tmp_path)
    assert len(rows) == 3 and not any(k.startswith("eval/") for r in rows for k in r)
    # the baseline and the evaluation after step 1 (--eval-interval 2), of the dataset named after its file
    evals = read_evals(tmp_path)
    assert [e["step"] for e in evals] == [0, 2] and [e["eval/weight_version"] for e in evals] == [0.0, 2.0]
    held_out = (tmp_path / "data" / "test.jsonl").read_text().splitlines()
    for e in evals:
        assert e["eval/test/samples"] == 2 * len(held_out)  # --n-samples-per-eval-prompt 2
        assert e["eval/test/failed_rate"] == 0.0 and {"eval/test/pass@1", "eval/test/pass@2"} <= set(e)
    # what a random model's run shows (the recipe's header says so): the pipeline, not learning. The
    # env's tool turns (more than one turn a trajectory), no failure, and no reward to learn from
    for row in rows:
        assert row["rollout/turns_mean"] > 1 and "rollout/status/failed" not in row
        assert row["rollout/reward_mean"] == 0.0 and row["train/grad_norm"] == 0.0


def test_cpu_long_trajectory_recipe_runs(tmp_path):
    """LONG=1: 20-turn trajectories of over a thousand tokens, each packed row split over two CP ranks
    with every layer recomputed, for a step of four trajectories (~50 s)."""
    proc = subprocess.run(
        ["bash", str(REPO / "examples/geo3k_vlm_multi_turn/run_geo3k_vlm_multi_turn_cpu.sh"), "2"]
        + ["--num-rollout", "1", "--skip-eval-before-train", "--n-samples-per-prompt", "2", "--global-batch-size", "4"],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
        env=repo_env(RUN_DIR=str(tmp_path), PYTHON=sys.executable, LONG="1"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = (tmp_path / "config.yaml").read_text()
    assert "context_parallel_size: 2" in config and "recompute_granularity: full" in config
    (row,) = metrics(tmp_path)
    # every trajectory ran its 20 turns, over a thousand tokens each, and trained
    assert row["rollout/turns_mean"] == 20 and "rollout/status/failed" not in row
    assert row["rollout/response_tokens_mean"] > 800 and row["train/tokens"] > 0


FAILING_ENV = """
from slime_mt.plugins import load_module

hint_env = load_module("{path}")


def build_env(sample=None, args=None, **kw):
    if sample.label == "unbuildable":
        raise RuntimeError("no env can be built for this row")
    return hint_env.build_env(sample=sample, args=args)
"""


def test_context_management_example_trains_step_wise(tmp_path):
    """examples/context_management (the demo game with a hint turn, window:1, step-wise, merged) for
    two steps. The first step's batch also holds a group whose env cannot be built (FAILED before
    the first turn, counted); a row whose prompt fills the context is left out when the data loads
    (one warning naming it): it trains."""
    from slime_mt.assets import smollm2_dir

    data = tmp_path / "data"
    subprocess.run(
        [sys.executable, str(REPO / "examples/demo/make_data.py"), str(data)], check=True, capture_output=True, cwd=REPO
    )
    rows = data.joinpath("train.jsonl").read_text()
    special = [
        {"prompt": "Guess the secret word.", "secret": "unbuildable"},
        {"prompt": "word " * 600 + "Guess the secret word.", "secret": "apple"},
    ]
    data.joinpath("train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in special) + rows)
    (tmp_path / "env.py").write_text(FAILING_ENV.format(path=REPO / "examples/context_management/hint_env.py"))
    (tmp_path / "plugins.py").write_text(PLUGINS)  # varied rewards: every group has an advantage
    proc = run(
        demo_train_cmd(
            smollm2_dir(),
            data / "train.jsonl",
            tmp_path / "run",
            "--config",
            str(REPO / "examples/context_management/config.yaml"),
            "--rollout-interaction-env-path",
            str(tmp_path / "env.py"),
            "--no-rollout-shuffle",
            "--num-rollout",
            "2",
            "--n-samples-per-prompt",
            "4",
            "--rollout-batch-size",
            "3",
            "--global-batch-size",
            "12",
            "--eval-interval",
            "100",
            "--custom-rm-path",
            f"{tmp_path}/plugins.py:rm",
            "--save-debug-rollout-data",
            dump_template(tmp_path / "run"),
        ),
        timeout=1500,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(tmp_path / "run")
    check_step_wise_dumps(tmp_path / "run", rows)
    assert [r["step"] for r in rows] == [0, 1]
    first = rows[0]
    assert first["train/samples_without_turns"] == 4  # the unbuildable group; the long prompt never came
    assert first["rollout/status/failed"] == 4 and "rollout/termination/context_exhausted" not in first
    assert re.search(  # left out at load (issue 44 item 11), never a 0-reward sample
        r"train\.jsonl: 1 of 18 prompts are longer than \d+ tokens \(no room left in --rollout-max-context-len "
        r"\d+\) and are left out \(rows 1\)",
        proc.stderr,
    ), proc.stderr[-3000:]
    for r in rows:
        assert r["train/grad_norm"] > 0 and r["train/loss"] == r["train/loss"]
        assert r["train/sequences_after_merge"] <= r["train/sequences_before_merge"]
    # the model rarely guesses a word it cannot know: trajectories reach the third turn, whose
    # window drops the first turn, and that step does not merge with the second
    assert sum(r["rollout/rewritten_context_turns"] for r in rows) > 0
    assert sum(r["train/sequences_before_merge"] - r["train/sequences_after_merge"] for r in rows) > 0
    assert any(
        r["train/sequences_after_merge"] > r["rollout/samples"] - r.get("train/samples_without_turns", 0) for r in rows
    )


def check_step_wise_dumps(run_dir: Path, rows: list[dict]) -> None:
    """The dumps of a step-wise, merged, window:1 run hold every field: the rewritten contexts, the
    sequences each trajectory became (merged turns named), a FAILED trajectory with none trained."""
    dumps = [load_dump(dump_path(dump_template(run_dir), k)) for k in range(2)]
    for d, row in zip(dumps, rows):
        assert set(d["train"]) == TRAIN_FIELDS and d["settings"]["sample_format"] == "step_wise"
        assert len(d["train"]["samples"]) == row["train/sequences_after_merge"]
        for s in d["samples"]:
            assert set(s) == SAMPLE_FIELDS and all(set(t) == TURN_FIELDS for t in s["turns"])
        for seq in d["train"]["samples"]:
            assert set(seq) == SEQUENCE_FIELDS
            assert seq["turns"] == sorted(seq["turns"]) and seq["turns"]
    samples = [s for d in dumps for s in d["samples"]]
    sequences = [seq for d in dumps for seq in d["train"]["samples"]]
    assert sum(t["context_ids"] is not None for s in samples for t in s["turns"]) == sum(
        r["rollout/rewritten_context_turns"] for r in rows
    )
    assert any(len(seq["turns"]) > 1 for seq in sequences)  # where merges happened
    failed = [s for s in samples if s["status"] == "failed"]
    assert len(failed) == 4 and all("error" in s["metadata"] for s in failed)
    failed_ids = {f"{s['group_index']}/{s['index']}" for s in failed}
    assert not any(any(seq["loss_mask"]) for seq in sequences if seq["trajectory_id"] in failed_ids)
