"""The RL loop end to end on CPU: tiny Qwen2.5-VL, synthetic geo3k, embedded engine, Megatron, in one
process (TP=1) and under torchrun (TP=2): the metrics of a run, its checkpoints and weights, a run
killed and resumed, ``--async``, an engine given by URL, ``--fully-async`` killed and resumed, and bad
input stopped before anything is written. Each test launches ``slime-mt train`` as real processes."""

import json

import pytest
import torch
from inspection_helpers import (
    assert_nested,
    dump_template,
    lanes_by_name,
)
from train_helpers import (
    DETERMINISTIC,
    final_weights,
    geo3k_train_cmd,
    initial_decoder,
    kill_after_two_steps,
    metrics,
    run,
)

from slime_mt.config.checkpoint import dump_path
from slime_mt.engine.clients.priority import EVALUATION
from slime_mt.engine.launch import free_port
from slime_mt.inspection.dumps import load_dump
from slime_mt.metrics import read_evals

REQUIRED = [
    "rollout/reward_mean",
    "rollout/reward_std",
    "rollout/pass_rate",
    "rollout/turns_mean",
    "rollout/env_retries",
    "rollout/env_failures",
    "rollout/response_tokens_mean",
    "rollout/observation_tokens",
    "rollout/engine_seconds",
    "rollout/env_seconds",
    "time/train_seconds",
    "time/sync_seconds",
    "time/rollout_seconds",
    "train/loss",
    "train/pg_loss",
    "train/entropy",
    "train/clip_fraction",
    "train/grad_norm",
    "train/approx_kl",
    "train/train_rollout_logprob_abs_diff",
    "train/sequences_before_merge",
    "train/sequences_after_merge",
    "rollout/weight_version_gap",
]


@pytest.mark.parametrize("tp", [1, 2])
def test_end_to_end(tp, request):
    if tp == 1:
        run_dir, steps = request.getfixturevalue("straight"), 4
    else:
        run_dir, steps = request.getfixturevalue("torchrun_tp2"), 3
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(steps))
    for key in REQUIRED:
        assert all(key in r for r in rows), key
    assert max(r["rollout/turns_max"] for r in rows) >= 2  # multi-turn rollouts happened
    assert rows[0]["train/grad_norm"] > 0
    # the engine's weight version advanced and each later rollout's samples were generated with the step's version
    assert [r["rollout/weight_version"] for r in rows] == [float(k + 1) for k in range(steps)]
    assert [r["rollout/sample_weight_version_min"] for r in rows[1:]] == [float(k) for k in range(1, steps)]
    # weights changed, and the checkpoint exists
    assert (run_dir / "ckpt" / "latest").read_text() == f"iter_{steps:07d}"
    state = final_weights(run_dir)
    norm = state["model.norm.weight"]
    assert not torch.equal(norm, initial_decoder("model.norm.weight"))


def test_turn_records_and_the_trace_can_be_bounded(straight):
    """--turn-records 2 keeps one whole group (of 2) a step; --trace steps keeps no trajectory's lane."""
    lines = [json.loads(line) for line in (straight / "turns.jsonl").read_text().splitlines()]
    for step in range(4):
        mine = [line for line in lines if line["step"] == step]
        assert len({line["group"] for line in mine}) == 1 and len({line["sample"] for line in mine}) == 2
    lanes = lanes_by_name(json.loads((straight / "trace.json").read_text()))
    assert not any(lane.startswith("sample ") for _, lane in lanes)
    assert not any(e["name"] == "generate" for spans in lanes.values() for e in spans)
    assert [e["args"]["version"] for e in lanes[("rollout side", "weights")]] == [1, 2, 3, 4]


def test_kill_during_step_3_and_resume_matches_uninterrupted(geo3k, tmp_path, straight):
    deterministic = DETERMINISTIC
    killed = tmp_path / "killed"
    kill_after_two_steps(geo3k_train_cmd(geo3k, killed, *deterministic, steps=4), killed)
    assert (killed / "ckpt" / "latest").read_text() == "iter_0000002"
    resumed = run(geo3k_train_cmd(geo3k, killed, *deterministic, "--load", str(killed / "ckpt"), steps=4))
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    a, b = metrics(straight), metrics(killed)
    assert [r["step"] for r in b] == [0, 1, 2, 3]
    for key in (
        "rollout/reward_mean",
        "rollout/generated_tokens",
        "rollout/observation_tokens",
        "rollout/turns_mean",
        "train/loss",
        "train/grad_norm",
    ):
        assert [r[key] for r in a] == pytest.approx([r[key] for r in b], abs=1e-6), key
    wa, wb = final_weights(straight), final_weights(killed)
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # the turn records hold each step once; the trace, continued by the resumed run, closes as JSON:
    # the killed run's updates 1 and 2, the resumed run's starting weights (2) and its updates 3 and 4
    lines = [json.loads(line) for line in (killed / "turns.jsonl").read_text().splitlines()]
    keys = [(line["step"], line["sample"], line["turn"]) for line in lines]
    assert sorted({k[0] for k in keys}) == [0, 1, 2, 3] and len(keys) == len(set(keys))
    events = json.loads((killed / "trace.json").read_text())
    assert_nested(events)
    assert [e["args"]["version"] for e in lanes_by_name(events)[("rollout side", "weights")]] == [1, 2, 2, 3, 4]


def held_out(geo3k) -> list[str]:
    """An evaluation every step of the held-out geo3k problem, two trajectories each."""
    return ["--eval-prompt-data", "geo3k_test", str(geo3k / "test.jsonl"), "--eval-interval", "1"] + [
        "--n-samples-per-eval-prompt",
        "2",
    ]


def assert_each_evaluation_saw_its_weights(run_dir, steps: int) -> None:
    """One evaluation of the weights after each of 0..``steps`` steps, every turn of it generated by
    those weights (the version the engine answered with), and the weight update after it waited for it."""
    evals = read_evals(run_dir)
    assert [e["step"] for e in evals] == list(range(steps + 1))
    for e in evals:
        assert e["eval/weight_version"] == e["step"] and "eval/weight_version_max" not in e
        assert e["eval/geo3k_test/samples"] == 2.0 and "eval/update_wait_seconds" in e


def test_async_overlaps_rollout_and_training(geo3k, tmp_path):
    """--async (slime's train_async): the rollout of step k+1 starts before step k has trained and
    finishes before the weights change, so every trained token is exactly one version old (the
    first step's are on-policy): none was generated by weights that changed in the middle of it.
    An evaluation every step runs beside the rollout and training (issue 69): it starts once the
    weights it evaluates reach the engines, the trainer does not wait for it, and the next weight
    update does; no evaluated sample reaches a training batch."""
    dumps = ["--save-debug-rollout-data", dump_template(tmp_path)]
    proc = run(geo3k_train_cmd(geo3k, tmp_path, "--async", "--use-tis", *dumps, *held_out(geo3k), steps=3))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(tmp_path)
    for step in range(3):  # the dumps agree: step k trains tokens of version k - 1 (step 0: of 0)
        dumped = load_dump(dump_path(dump_template(tmp_path), step))
        versions = {v for s in dumped["samples"] for v, m in zip(s["token_versions"], s["loss_mask"]) if m}
        assert versions == {max(step - 1, 0)}
        assert {s["metadata"]["rollout_id"] for s in dumped["samples"]} == {step}  # no evaluated sample
    assert_each_evaluation_saw_its_weights(tmp_path, 3)
    lanes = {
        lane: spans for (_, lane), spans in lanes_by_name(json.loads((tmp_path / "trace.json").read_text())).items()
    }
    evaluations = {e["args"]["step"]: e for e in lanes["eval"] if e["name"] == "evaluate"}
    trained = {e["args"]["step"]: e for e in lanes["train"] if e["name"] == "train step"}
    updates = {e["args"]["version"]: e for e in lanes["weights"] if e["name"] == "weight update"}
    end = lambda e: e["ts"] + e["dur"]  # noqa: E731
    for k, e in evaluations.items():
        if k in updates:  # the weights after k steps were in the engines before it began
            assert end(updates[k]) <= e["ts"]
        if k + 1 in updates:  # and the next update waited for it
            assert end(e) <= updates[k + 1]["ts"]

    # the evaluations' requests last in the engine's queue, the rollout's before them (SGLang's order)
    def priorities(prefix: str) -> set:
        calls = (c for lane, spans in lanes.items() if lane.startswith(prefix) for c in spans)
        return {c["args"].get("priority") for c in calls if c["name"] == "generate"}

    assert priorities("eval sample") == {-EVALUATION} and priorities("sample") == {0}
    # beside, not before: an evaluation went on while the next step trained
    assert any(e["ts"] < end(trained[k]) and trained[k]["ts"] < end(e) for k, e in evaluations.items() if k in trained)
    for previous, current in zip(rows, rows[1:]):
        # the rollout of step k+1 started before step k finished training
        assert current["time/rollout_started"] < previous["time/train_finished"]
        assert current["rollout/weight_version_gap"] == 1.0
        assert current["rollout/version_gap_tokens/1"] == 1.0
    assert rows[0]["rollout/weight_version_gap"] == 0.0
    assert rows[0]["rollout/version_gap_tokens/0"] == 1.0


def test_an_engine_by_url_serves_the_runs_starting_weights_and_its_folders_are_bounded(geo3k, tmp_path):
    """An engine the run did not start (--engine-url) that an earlier run left serving other weights
    under version 7: the run pushes its starting weights as version 0 before the first rollout, so
    step 0's tokens are version 0's; each step's weights reach it through a folder, and after 5
    steps only the one it serves and --keep-weight-versions (1) older one are left on disk."""
    from slime_mt.assets import tiny_model_dir
    from slime_mt.engine.embedded.server import LocalEngine
    from slime_mt.safetensors_files import load_hf_state

    path = tiny_model_dir("qwen2.5-vl")
    earlier = {k: v * 1.5 if v.dim() == 2 else v for k, v in load_hf_state(path).items()}
    (tmp_path / "weights" / "v3").mkdir(parents=True)  # an earlier run's folder in this run directory
    with LocalEngine(path, max_batch_size=8) as engine:
        engine.update_weights_from_tensors(earlier, weight_version="7")
        proc = run(geo3k_train_cmd(geo3k, tmp_path, "--engine-url", engine.url, steps=5))
        assert proc.returncode == 0, proc.stderr[-3000:]
        served = engine.weight_version
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert rows[0]["rollout/sample_weight_version_min"] == rows[0]["rollout/sample_weight_version_max"] == 0.0
    assert rows[0]["rollout/version_gap_tokens/0"] == 1.0
    assert all(r["rollout/sample_weight_version_min"] == r["step"] for r in rows)
    assert served == "5"
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v4", "v5"]


def test_fully_async_killed_and_resumed_trains_every_step_once_and_no_group_twice(geo3k, tmp_path):
    """--fully-async with --partial-rollout: SIGKILL after the second step, then --load. The resumed
        run trains the remaining steps; the groups that were buffered or in flight at the checkpoint are
        drawn again (same group indices), none is trained twice, no trained token is staler than S=1. Each
    evaluation (one every step, beside the rollout) is in eval.jsonl once, of the weights it names."""
    flags = ["--fully-async", "--partial-rollout", "--max-staleness", "1", "--use-tis", "--save-interval", "1"]
    flags += held_out(geo3k)  # an evaluation every step, beside the rollout: each once, the one in flight
    # at the kill done again by the resumed run
    kill_after_two_steps(geo3k_train_cmd(geo3k, tmp_path, *flags, steps=5), tmp_path)
    killed_at = len(metrics(tmp_path))
    saved = int((tmp_path / "ckpt" / "latest").read_text().removeprefix("iter_"))
    assert 2 <= saved <= killed_at < 5
    resumed = run(geo3k_train_cmd(geo3k, tmp_path, *flags, "--load", str(tmp_path / "ckpt"), steps=5))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    trained = [g for r in rows for g in r["trained_groups"]]
    assert len(trained) == len(set(trained)) == 10
    assert max(r["rollout/token_version_gap_max"] for r in rows) <= 1
    assert rows[saved]["rollout/weight_version"] == saved + 1
    assert_each_evaluation_saw_its_weights(tmp_path, 5)


@pytest.mark.parametrize("case", ["missing model", "bad row", "env import", "dead engine"])
def test_bad_input_fails_fast_with_a_clear_error(geo3k, tmp_path, case):
    save = tmp_path / "save"
    cmd = geo3k_train_cmd(geo3k, tmp_path / "logs", steps=1)
    cmd[cmd.index("--save") + 1] = str(save)
    if case == "missing model":
        cmd[cmd.index("--hf-checkpoint") + 1] = str(tmp_path / "no_model")
        expected = "no_model: model folder not found"
    elif case == "bad row":
        bad = tmp_path / "bad.jsonl"
        first, second = [json.loads(line) for line in (geo3k / "train.jsonl").read_text().splitlines()[:2]]
        first["images"] = [str(geo3k / p) for p in first["images"]]
        second["images"] = [str(geo3k / p) for p in second["images"]] * 2
        bad.write_text(json.dumps(first) + "\n" + json.dumps(second) + "\n")
        cmd[cmd.index("--prompt-data") + 1] = str(bad)
        expected = "row 2 of bad.jsonl: 1 <image> placeholders but 2 images"
    elif case == "env import":
        env_file = tmp_path / "broken_env.py"
        env_file.write_text("import no_such_module_anywhere\n")
        cmd[cmd.index("--rollout-interaction-env-path") + 1] = str(env_file)
        expected = "broken_env.py raised while importing: ModuleNotFoundError"
    else:
        cmd += ["--engine-url", f"http://127.0.0.1:{free_port()}"]
        expected = "does not answer"
    proc = run(cmd, timeout=120)
    assert proc.returncode != 0
    error_lines = [line for line in proc.stderr.splitlines() if line.startswith("slime-mt train: error:")]
    assert len(error_lines) == 1 and expected in error_lines[0], proc.stderr[-2000:]
    assert not save.exists()
