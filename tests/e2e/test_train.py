"""The RL loop end to end on CPU: tiny Qwen2.5-VL, synthetic geo3k, embedded engine, Megatron.

Each test launches ``slime-mt train`` as real processes (TP=1, or TP=2 under torchrun)."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
import torch
from inspection_helpers import (
    SAMPLE_FIELDS,
    SEQUENCE_FIELDS,
    TRAIN_FIELDS,
    TURN_FIELDS,
    assert_engine_calls_in_lanes,
    assert_nested,
    dump_template,
    lanes_by_name,
)
from train_helpers import PLUGINS, TWO_SMALL_STEPS, demo_train_cmd, geo3k_train_cmd, make_geo3k, repo_env

from slime_mt.engine.launch import free_port
from slime_mt.inspection.dumps import dump_path, load_dump

REPO = Path(__file__).resolve().parents[1]
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


@pytest.fixture(scope="module")
def geo3k(tmp_path_factory):
    return make_geo3k(tmp_path_factory.mktemp("geo3k"))


train_cmd = geo3k_train_cmd


def run(cmd, timeout=600, **kw):
    env = repo_env()
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO, **kw)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def kill_after_two_steps(cmd, run_dir: Path) -> None:
    """Start a run and SIGKILL it half a second after its second metrics line (the third step runs)."""
    child = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=repo_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.time() + 300
    while time.time() < deadline and child.poll() is None:
        if (run_dir / "metrics.jsonl").is_file() and len((run_dir / "metrics.jsonl").read_text().splitlines()) >= 2:
            break
        time.sleep(0.2)
    time.sleep(0.5)
    os.killpg(child.pid, signal.SIGKILL)
    child.wait()


def final_weights(run_dir: Path) -> dict:
    """The last checkpoint's weights (an HF-layout folder)."""
    from slime_mt.backends.megatron.convert import load_hf_state

    ckpt = run_dir / "ckpt"
    return load_hf_state(ckpt / (ckpt / "latest").read_text())


def initial_decoder(name: str) -> torch.Tensor:
    from slime_mt.assets import tiny_model_dir
    from slime_mt.backends.megatron.convert import load_hf_state

    return load_hf_state(tiny_model_dir("qwen2.5-vl"))[name]


DETERMINISTIC = ["--rollout-concurrency", "1", "--save-interval", "1"]


@pytest.fixture(scope="module")
def straight(geo3k, tmp_path_factory):
    """A 4-step run at TP=1 with one trajectory in flight at a time and a checkpoint every step: the
    end-to-end checks at TP=1 read it, and the kill-and-resume test compares against it."""
    run_dir = tmp_path_factory.mktemp("straight")
    proc = run(train_cmd(geo3k, run_dir, *DETERMINISTIC, "--turn-records", "2", "--trace", "steps", steps=4))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def torchrun_tp2(geo3k, tmp_path_factory):
    """A 3-step run at TP=2 under torchrun, one trajectory in flight at a time: the end-to-end checks
    at TP=2 read it, and the same run on Ray must equal it."""
    run_dir = tmp_path_factory.mktemp("torchrun_tp2")
    proc = run(train_cmd(geo3k, run_dir, *DETERMINISTIC, tp=2, steps=3))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


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
    kill_after_two_steps(train_cmd(geo3k, killed, *deterministic, steps=4), killed)
    assert (killed / "ckpt" / "latest").read_text() == "iter_0000002"
    resumed = run(train_cmd(geo3k, killed, *deterministic, "--load", str(killed / "ckpt"), steps=4))
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


def test_async_overlaps_rollout_and_training(geo3k, tmp_path):
    """--async (slime's train_async): the rollout of step k+1 starts before step k has trained and
    finishes before the weights change, so every trained token is exactly one version old (the
    first step's are on-policy): none was generated by weights that changed in the middle of it."""
    dumps = ["--save-debug-rollout-data", dump_template(tmp_path)]
    proc = run(train_cmd(geo3k, tmp_path, "--async", "--use-tis", *dumps, steps=3))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(tmp_path)
    for step in range(3):  # the dumps agree: step k trains tokens of version k - 1 (step 0: of 0)
        dumped = load_dump(dump_path(dump_template(tmp_path), step))
        versions = {v for s in dumped["samples"] for v, m in zip(s["token_versions"], s["loss_mask"]) if m}
        assert versions == {max(step - 1, 0)}
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
    from slime_mt.backends.megatron.convert import load_hf_state
    from slime_mt.engine.server import LocalEngine

    path = tiny_model_dir("qwen2.5-vl")
    earlier = {k: v * 1.5 if v.dim() == 2 else v for k, v in load_hf_state(path).items()}
    (tmp_path / "weights" / "v3").mkdir(parents=True)  # an earlier run's folder in this run directory
    with LocalEngine(path, max_batch_size=8) as engine:
        engine.update_weights_from_tensors(earlier, weight_version="7")
        proc = run(train_cmd(geo3k, tmp_path, "--engine-url", engine.url, steps=5))
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
    drawn again (same group indices), none is trained twice, no trained token is staler than S=1."""
    flags = ["--fully-async", "--partial-rollout", "--max-staleness", "1", "--use-tis", "--save-interval", "1"]
    kill_after_two_steps(train_cmd(geo3k, tmp_path, *flags, steps=5), tmp_path)
    killed_at = len(metrics(tmp_path))
    saved = int((tmp_path / "ckpt" / "latest").read_text().removeprefix("iter_"))
    assert 2 <= saved <= killed_at < 5
    resumed = run(train_cmd(geo3k, tmp_path, *flags, "--load", str(tmp_path / "ckpt"), steps=5))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    trained = [g for r in rows for g in r["trained_groups"]]
    assert len(trained) == len(set(trained)) == 10
    assert max(r["rollout/token_version_gap_max"] for r in rows) <= 1
    assert rows[saved]["rollout/weight_version"] == saved + 1


@pytest.mark.slow
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
    assert len(rows) == 3 and "eval/reward_mean" in rows[1]
    held_out = (tmp_path / "data" / "test.jsonl").read_text().splitlines()
    assert rows[1]["eval/samples"] == 2 * len(held_out)  # --n-samples-per-eval-prompt 2, none failed


@pytest.mark.parametrize("case", ["missing model", "bad row", "env import", "dead engine"])
def test_bad_input_fails_fast_with_a_clear_error(geo3k, tmp_path, case):
    save = tmp_path / "save"
    cmd = train_cmd(geo3k, tmp_path / "logs", steps=1)
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
        expected = "row 1 of bad.jsonl: 1 <image> placeholders but 2 images"
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


FAILING_ENV = """
from slime_mt.plugins import load_module

hint_env = load_module("{path}")


def build_env(sample=None, args=None, **kw):
    if sample.label == "unbuildable":
        raise RuntimeError("no env can be built for this row")
    return hint_env.build_env(sample=sample, args=args)
"""


@pytest.mark.slow
def test_context_management_example_trains_step_wise(tmp_path):
    """examples/context_management (the demo game with a hint turn, window:1, step-wise, merged) for
    two steps. The first step's batch also holds a group whose env cannot be built (FAILED before
    the first turn) and one whose prompt fills the context (TRUNCATED before it): it trains, and
    both are counted."""
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
    assert first["train/samples_without_turns"] == 8
    assert first["rollout/status/failed"] == 4 and first["rollout/termination/context_exhausted"] == 4
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


# ---------------------------------------------------------------- on a Ray cluster of three nodes

RAY_TP2 = ["--actor-num-nodes", "2", "--actor-num-gpus-per-node", "1", "--num-gpus-per-node", "1"]


@pytest.fixture(scope="module")
def three_nodes():
    """A Ray cluster of three nodes with their own raylets on loopback, one declared GPU each (Ray hands
    out device ids without physical GPUs; the ranks find no CUDA and train on CPU with gloo)."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, connect=False, head_node_args={"num_cpus": 2, "num_gpus": 1})
    for _ in range(2):
        cluster.add_node(num_cpus=2, num_gpus=1)
    cluster.wait_for_nodes()
    try:
        yield cluster
    finally:
        cluster.shutdown()


def ray_cmd(geo3k: Path, run_dir: Path, cluster, *extra: str, steps: int = 3) -> list[str]:
    """``train_cmd`` at TP=2, launched by ``--ray`` on ``cluster`` (two ranks on two nodes, one engine)."""
    cmd = train_cmd(geo3k, run_dir, *extra, tp=2, steps=steps)
    flags = cmd[cmd.index("train") :]
    return [sys.executable, "-m", "slime_mt.cli", *flags, "--ray", "--ray-address", cluster.address, *RAY_TP2]


@pytest.fixture(scope="module")
def ray_tp2(geo3k, three_nodes, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ray_tp2")
    flags = [*DETERMINISTIC, "--rollout-num-gpus", "1", *ENV_WORKERS, *ROLLOUT_PROCESSES]
    proc = run(ray_cmd(geo3k, run_dir, three_nodes, *flags))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir, proc.stdout


ENV_WORKERS = ["--env-num-workers", "2", "--env-worker-num-cpus", "0.5"]
ROLLOUT_PROCESSES = ["--rollout-num-processes", "2", "--rollout-process-num-cpus", "0.25"]


def placement_lines(text: str) -> dict[str, str]:
    """'trainer rank 0' / 'engine 0' / 'env worker 0' -> the node id its placement line names (rank 0's
    lines come through Ray's log forwarding, after the actor's prefix)."""
    found = {}
    for line in text.splitlines():
        if "placement: " in line and ": node " in line:
            role, where = line.split("placement: ", 1)[1].split(": ", 1)
            found[role] = where.split("(", 1)[1].split(")", 1)[0]
    return found


def test_ray_run_on_three_nodes_equals_the_torchrun_run(ray_tp2, torchrun_tp2):
    """TP=2 with its ranks on two nodes and the engine on the third, weights to the engine over the
    distributed path, the trajectories in two rollout processes and their environments in two workers,
    each pair on two nodes: the same rewards, losses and gradient norms as under torchrun with
    everything of the rollout in rank 0's process, step by step; every group trained once."""
    run_dir, stdout = ray_tp2
    nodes = placement_lines(stdout)
    roles = ["engine 0", "env worker 0", "env worker 1", "rollout process 0", "rollout process 1"]
    assert sorted(nodes) == [*roles, "trainer rank 0", "trainer rank 1"], stdout
    assert len({nodes[role] for role in ("engine 0", "trainer rank 0", "trainer rank 1")}) == 3
    assert nodes["env worker 0"] != nodes["env worker 1"]  # two workers, two nodes
    assert nodes["rollout process 0"] != nodes["rollout process 1"]
    ray_rows, torchrun_rows = metrics(run_dir), metrics(torchrun_tp2)
    assert [r["step"] for r in ray_rows] == [0, 1, 2]
    assert [r["rollout/reward_mean"] for r in ray_rows] == [r["rollout/reward_mean"] for r in torchrun_rows]
    for key in ("train/loss", "train/pg_loss", "train/grad_norm", "train/entropy", "rollout/response_tokens_mean"):
        assert [r[key] for r in ray_rows] == pytest.approx([r[key] for r in torchrun_rows], abs=1e-6), key
    # each step's rollout came from the weights of the step before, as the engine served them
    assert [r["rollout/sample_weight_version_min"] for r in ray_rows] == [0.0, 1.0, 2.0]
    assert all(r["train/train_rollout_logprob_abs_diff"] < 1e-5 for r in ray_rows)
    assert not (run_dir / "weights").exists()  # nothing went through a folder
    assert [r["env/worker_restarts"] for r in ray_rows] == [0, 0, 0]
    assert [r["rollout/process_restarts"] for r in ray_rows] == [0, 0, 0]
    assert all(r["rollout/env_seconds"] > 0 for r in ray_rows)  # the environments did step, remotely
    trained = [g for r in ray_rows for g in r["trained_groups"]]
    assert trained == [g for r in torchrun_rows for g in r["trained_groups"]]
    assert len(trained) == len(set(trained)) == 6


def test_ray_dry_run_prints_the_placement_and_releases_it(geo3k, three_nodes, tmp_path):
    proc = run(ray_cmd(geo3k, tmp_path, three_nodes, "--rollout-num-gpus", "1", "--dry-run"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    nodes = placement_lines(proc.stdout)
    assert sorted(nodes) == ["engine 0", "trainer rank 0", "trainer rank 1"] and len(set(nodes.values())) == 3
    # the cluster cannot hold a fourth device: the error names what was asked and what there is
    proc = run(ray_cmd(geo3k, tmp_path, three_nodes, "--rollout-num-gpus", "2", "--dry-run"), timeout=900)
    assert proc.returncode != 0 and "cannot hold 4 bundles" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("launcher", ["torchrun", "ray"])
def test_fully_async_at_tp2_trains_within_the_bound(geo3k, tmp_path, launcher, request):
    """--fully-async at TP=2, under torchrun and on four Ray nodes: rank 0's manager feeds both ranks,
    the weights reach the engine mid-generation (on Ray: broadcast to two engines on two other nodes,
    behind the router, while two rollout processes generate), every group is trained once and no
    token is staler than S=1."""
    flags = ["--fully-async", "--partial-rollout", "--max-staleness", "1", "--use-tis"]
    flags += ["--save-debug-rollout-data", dump_template(tmp_path)]
    if launcher == "ray":
        cluster = request.getfixturevalue("three_nodes")
        fourth = cluster.add_node(num_cpus=2, num_gpus=1)  # two engines, on two nodes, behind the router
        cluster.wait_for_nodes()
        try:
            proc = run(ray_cmd(geo3k, tmp_path, cluster, *flags, "--rollout-num-gpus", "2", *ROLLOUT_PROCESSES))
        finally:
            cluster.remove_node(fourth)
        nodes = placement_lines(proc.stdout)
        assert len({nodes.get("engine 0"), nodes.get("engine 1")} - {None}) == 2, proc.stdout[-2000:]
        assert len(set(nodes.values())) == 4
        assert {"rollout process 0", "rollout process 1"} <= set(nodes)
    else:
        proc = run(train_cmd(geo3k, tmp_path, *flags, tp=2, steps=3))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r["rollout/weight_version"] for r in rows] == [1.0, 2.0, 3.0]
    trained = [g for r in rows for g in r["trained_groups"]]
    assert len(trained) == len(set(trained)) == 6
    assert max(r["rollout/token_version_gap_max"] for r in rows) <= 1
    assert all(r["train/grad_norm"] > 0 for r in rows)
    assert all(0.0 <= r["async/dropped_token_share"] < 1.0 and r["async/trained_turns_mean"] >= 1 for r in rows)
    check_fully_async_records(tmp_path, rows)


def check_fully_async_records(run_dir: Path, rows: list[dict]) -> None:
    """The run's trace (plain JSON, spans nested in every lane) holds each step's weight update (a gate
    pause inside it), both trainer ranks' train steps and weight exports, and every engine call of the
    trained trajectories (made in rank 0's process, or in the rollout processes); the dumps hold what
    each step trained, every token with its version."""
    events = json.loads((run_dir / "trace.json").read_text())
    assert_nested(events)
    lanes = lanes_by_name(events)
    updates = lanes[("rollout side", "weights")]
    assert [e["args"]["version"] for e in updates] == [1, 2, 3]
    pauses = lanes[("rollout side", "update gate")]
    for u in updates:
        assert any(u["ts"] <= p["ts"] and p["ts"] + p["dur"] <= u["ts"] + u["dur"] for p in pauses)
    for rank in (0, 1):
        train = lanes[(f"trainer rank {rank}", "train")]
        assert [e["args"]["step"] for e in train if e["name"] == "train step"] == [0, 1, 2]
        assert [e["args"]["version"] for e in train if e["name"] == "export weights"] == [1, 2, 3]
    dumps = [load_dump(dump_path(dump_template(run_dir), k)) for k in range(3)]
    assert [sorted({s["group_index"] for s in d["samples"]}) for d in dumps] == [r["trained_groups"] for r in rows]
    for d in dumps:
        assert set(d["train"]) == TRAIN_FIELDS
        for s in d["samples"]:
            assert set(s) == SAMPLE_FIELDS and all(set(t) == TURN_FIELDS for t in s["turns"])
            assert len(s["token_versions"]) == s["response_length"]
            generated = [v for v, m in zip(s["token_versions"], s["loss_mask"]) if m]
            assert generated and all(v >= 0 for v in generated)
        assert_engine_calls_in_lanes(lanes, d["samples"])


def test_weights_reach_an_engine_on_another_node_exactly_after_each_step(ray_tp2, three_nodes, tiny_paths):
    """Rank 0's end of the distributed path on one node, an engine on another, nothing shared on disk:
    after each of the Ray run's 3 steps, the engine serves exactly the weights the trainer exported
    (its checkpoint of that step): greedy tokens and log-probs equal an engine loaded from that folder."""
    from slime_mt.config import EngineConfig
    from slime_mt.engine.server import LocalEngine
    from slime_mt.launch.ray.actors import EngineActor

    run_dir, stdout = ray_tp2
    ray.init(
        address=three_nodes.address,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": f"{REPO}:{REPO / 'tests'}:{REPO / 'tests' / 'engine'}"}},
    )
    try:
        nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
        on = {n: ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(n, soft=False) for n in nodes}
        engine = EngineActor.options(num_cpus=0, scheduling_strategy=on[nodes[2]]).remote(
            str(REPO), [], [], EngineConfig(), str(tiny_paths["qwen2.5-vl"]), 0, str(run_dir)
        )
        url = ray.get(engine.start.remote())
        sender = RankZero.options(num_cpus=0, scheduling_strategy=on[nodes[0]]).remote(url)
        assert ray.get(sender.node.remote()) != ray.get(engine.where.remote())["node_id"]
        for step in (1, 2, 3):
            folder = run_dir / "ckpt" / f"iter_{step:07d}"
            ray.get(sender.push.remote(str(folder), step))
            with LocalEngine(folder) as reference:
                expected = greedy(reference.url)
            served = greedy(url)
            assert served[2] == str(step)
            assert served[0] == expected[0]
            assert served[1] == pytest.approx(expected[1], abs=1e-5)
        ray.get(sender.close.remote())
        ray.get(engine.stop.remote())
    finally:
        ray.shutdown()


@pytest.mark.parametrize("launcher", ["single", "ray"])
def test_colocated_engines_hold_nothing_while_training_and_the_run_trains_as_disaggregated(
    geo3k, tmp_path, launcher, request
):
    """--colocate: after each rollout the engines release their weights and KV cache (they report
    holding 0 bytes while the trainer trains), then wake with the new weights (weights, update, KV
    cache). In one process (weights by handle, the trainer offloaded while the engine generates) the
    run equals the disaggregated one step by step; on Ray (TP=2 on two nodes, an engine on each rank's
    device, weights broadcast) it trains every group once from the weights of the step before."""
    flags = [*DETERMINISTIC, "--colocate"]
    if launcher == "ray":
        cluster = request.getfixturevalue("three_nodes")
        proc = run(ray_cmd(geo3k, tmp_path, cluster, *flags, steps=2))
        nodes = placement_lines(proc.stdout)
        assert nodes["engine 0"] == nodes["trainer rank 0"] and nodes["engine 1"] == nodes["trainer rank 1"]
    else:
        proc = run(train_cmd(geo3k, tmp_path, *flags, "--offload", "--weight-transport", "tensor"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1]
    assert [r["colocate/engine_bytes_while_training"] for r in rows] == [0.0, 0.0]
    assert [r["rollout/sample_weight_version_min"] for r in rows] == [0.0, 1.0]
    assert all(r["train/grad_norm"] > 0 and r["train/train_rollout_logprob_abs_diff"] < 1e-5 for r in rows)
    trained = [g for r in rows for g in r["trained_groups"]]
    assert len(trained) == len(set(trained)) == 4
    if launcher == "single":
        assert [r["colocate/trainer_bytes_while_generating"] for r in rows] == [0.0, 0.0]
        reference = metrics(request.getfixturevalue("straight"))[:2]
        assert [r["rollout/reward_mean"] for r in rows] == [r["rollout/reward_mean"] for r in reference]
        for key in ("train/loss", "train/grad_norm", "rollout/response_tokens_mean"):
            assert [r[key] for r in rows] == pytest.approx([r[key] for r in reference], abs=1e-6), key


def test_a_lost_trainer_node_stops_the_run_naming_it_and_load_resumes_it(geo3k, tmp_path):
    """On a cluster of its own (a head without devices, three nodes with one each), the node of
    trainer rank 1 is removed once the first checkpoint is written: the run stops with one line
    naming the rank, its node and --load; with a node added back, --load resumes it and every group
    is trained once."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, connect=False, head_node_args={"num_cpus": 2, "num_gpus": 0})
    nodes = [cluster.add_node(num_cpus=2, num_gpus=1) for _ in range(3)]
    cluster.wait_for_nodes()
    try:
        cmd = ray_cmd(geo3k, tmp_path, cluster, *DETERMINISTIC, "--rollout-num-gpus", "1")
        out, err = tmp_path / "driver.out", tmp_path / "driver.err"
        with out.open("w") as stdout, err.open("w") as stderr:
            env = repo_env()
            child = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=stdout, stderr=stderr)
            try:
                deadline = time.time() + 300
                while not (tmp_path / "ckpt" / "latest").is_file() and child.poll() is None:
                    assert time.time() < deadline, "no checkpoint was written"
                    time.sleep(0.2)
                rank1 = placement_lines(out.read_text())["trainer rank 1"]
                (where,) = [line for line in out.read_text().splitlines() if "placement: trainer rank 1:" in line]
                (lost,) = [n for n in nodes if n.node_id.startswith(rank1)]
                cluster.remove_node(lost)
                assert child.wait(timeout=300) == 1
            finally:
                if child.poll() is None:
                    child.kill()
        message = err.read_text()
        node = where.split("placement: trainer rank 1: ", 1)[1].rsplit(" GPU", 1)[0]  # node ADDRESS (id)
        assert f"TrainerRankLost: trainer rank 1 on {node} was lost" in message, message[-3000:]
        assert "the node has left the cluster" in message
        assert f"the run stops; resume from the last checkpoint with --load {tmp_path / 'ckpt'}" in message
        assert "Traceback" not in message
        cluster.add_node(num_cpus=2, num_gpus=1)
        cluster.wait_for_nodes()
        resumed = run(cmd + ["--load", str(tmp_path / "ckpt")])
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        rows = metrics(tmp_path)
        assert [r["step"] for r in rows] == [0, 1, 2]
        trained = [g for r in rows for g in r["trained_groups"]]
        assert len(trained) == len(set(trained)) == 6
    finally:
        cluster.shutdown()


@pytest.mark.parametrize("launcher", ["single", "ray"])
def test_ctrl_c_finishes_the_step_saves_and_stops(geo3k, tmp_path, launcher, request):
    """Ctrl-C in the middle of a 20-step run: the step in hand finishes, a checkpoint of it is saved,
    the engines stop and the run exits 0; on Ray the driver's Ctrl-C reaches every rank on its node."""
    flags = ["--save-interval", "100"]  # the checkpoint can only come from the interrupt
    if launcher == "ray":
        cluster = request.getfixturevalue("three_nodes")
        cmd = ray_cmd(geo3k, tmp_path, cluster, *flags, "--rollout-num-gpus", "1", steps=20)
    else:
        cmd = train_cmd(geo3k, tmp_path, *flags, steps=20)
    env = repo_env()
    child = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while len(metrics(tmp_path) if (tmp_path / "metrics.jsonl").is_file() else []) < 2:
            assert child.poll() is None and time.time() < deadline, "the run did not log two steps"
            time.sleep(0.05)
        child.send_signal(signal.SIGINT)
        _, stderr = child.communicate(timeout=300)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 0, stderr[-3000:]
    rows = metrics(tmp_path)
    assert 2 <= len(rows) < 20 and [r["step"] for r in rows] == list(range(len(rows))), stderr[-3000:]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == f"iter_{len(rows):07d}"


def engine_processes() -> list[int]:
    """PIDs of the processes Ray runs EngineActors in (their title is ``ray::EngineActor...``)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and (proc / "cmdline").read_bytes().startswith(b"ray::EngineActor"):
                found.append(int(proc.name))
        except OSError:  # gone meanwhile
            pass
    return found


def test_an_engine_killed_mid_rollout_is_started_again_and_the_run_trains_as_without(
    geo3k, three_nodes, torchrun_tp2, tmp_path
):
    """TP=2 on two nodes, two engines on two more behind the router, 6 steps: one engine's process is
    killed in the middle of step 1's rollout. Its requests fail over to the other engine (each is the same
    request again), Ray restarts its actor, the engine starts again outside the rotation and joins it
    at the next weight update with the current weights: nothing fails, no token comes from weights
    the run did not mean, every group is trained once, the restart is counted, and the run trains as
    the same run under torchrun (its 3 steps)."""
    fourth = three_nodes.add_node(num_cpus=2, num_gpus=1)
    three_nodes.wait_for_nodes()
    try:
        cmd = ray_cmd(geo3k, tmp_path, three_nodes, *DETERMINISTIC, "--rollout-num-gpus", "2", steps=6)
        out = tmp_path / "driver.out"
        with out.open("w") as stdout:
            env = repo_env()
            child = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=stdout, stderr=subprocess.PIPE, text=True)
            deadline = time.time() + 300
            while not (tmp_path / "metrics.jsonl").is_file() and child.poll() is None:
                assert time.time() < deadline, "no step was logged"
                time.sleep(0.05)
            (victim, _) = engine_processes()
            os.kill(victim, signal.SIGKILL)
            _, stderr = child.communicate(timeout=600)
        assert child.returncode == 0, stderr[-3000:]
    finally:
        three_nodes.remove_node(fourth)
    assert "(started again)" in out.read_text() and "is back in the rotation" in out.read_text()
    rows, reference = metrics(tmp_path), metrics(torchrun_tp2)
    assert [r["step"] for r in rows] == list(range(6))
    assert sum(r["engine/restarts"] for r in rows) == 1
    assert all(r["rollout/env_failures"] == 0 for r in rows)
    assert [r["rollout/sample_weight_version_min"] for r in rows] == [float(step) for step in range(6)]
    trained = [g for r in rows for g in r["trained_groups"]]
    assert len(trained) == len(set(trained)) == 12
    assert [r["rollout/reward_mean"] for r in rows[:3]] == [r["rollout/reward_mean"] for r in reference]
    for key in ("train/loss", "train/grad_norm", "rollout/response_tokens_mean"):
        assert [r[key] for r in rows[:3]] == pytest.approx([r[key] for r in reference], abs=1e-6), key


DIES_ONCE_ENV = """
import os
import signal

from slime_mt.plugins import load_module

geo3k = load_module("{path}")


class DiesOnce(geo3k.Geo3kEnv):
    \"\"\"geo3k, whose worker process is killed in the middle of the run's first step (once: the first
    step to create the marker file).\"\"\"

    def step(self, response_text):
        try:
            os.close(os.open("{marker}", os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return super().step(response_text)
        os.kill(os.getpid(), signal.SIGKILL)


def build_env(sample=None, args=None, **kw):
    return DiesOnce(sample.label)
"""


def test_an_env_worker_killed_mid_step_is_restarted_and_the_run_trains_as_without(
    geo3k, three_nodes, straight, tmp_path
):
    """One environment worker's process is killed in the middle of a step, on the three-node cluster:
    Ray restarts it, the episode is rebuilt there and its earlier steps replayed, the step is tried
    again; nothing fails, every group is trained once, the restart is counted, and the run trains
    exactly as the in-process run with the same seed."""
    marker = tmp_path / "killed"
    env_file = tmp_path / "dies_once.py"
    env_file.write_text(DIES_ONCE_ENV.format(path=REPO / "envs/geo3k.py", marker=marker))
    flags = ["--rollout-interaction-env-path", str(env_file), *ENV_WORKERS, "--ray-address", three_nodes.address]
    proc = run(train_cmd(geo3k, tmp_path, *DETERMINISTIC, *flags))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert marker.exists()
    rows, reference = metrics(tmp_path), metrics(straight)[:2]
    assert [r["step"] for r in rows] == [0, 1]
    assert sum(r["env/worker_restarts"] for r in rows) == 1
    assert sum(r["rollout/env_retries"] for r in rows) == 1  # the killed step, tried again
    assert all(r["rollout/env_failures"] == 0 for r in rows)
    trained = [g for r in rows for g in r["trained_groups"]]
    assert len(trained) == len(set(trained)) == 4
    assert [r["rollout/reward_mean"] for r in rows] == [r["rollout/reward_mean"] for r in reference]
    for key in ("train/loss", "train/grad_norm", "rollout/response_tokens_mean", "rollout/turns_mean"):
        assert [r[key] for r in rows] == pytest.approx([r[key] for r in reference], abs=1e-6), key
    # the workers' calls in the trace: each worker a process, each episode's calls on its trajectory's lane
    events = json.loads((tmp_path / "trace.json").read_text())
    assert_nested(events)
    workers = {process for process, _ in lanes_by_name(events) if process.startswith("env worker ")}
    assert workers == {"env worker 0", "env worker 1"}
    lanes = lanes_by_name(events)
    calls = [(lane, e) for (process, lane), spans in lanes.items() if process in workers for e in spans]
    assert {e["name"] for _, e in calls} >= {"env.build", "env.reset", "env.step"}
    for lane, call in calls:  # a worker's step lies inside the trajectory's env.step that asked for it
        if call["name"] == "env.step":
            outer = [e for e in lanes[("rollout side", lane)] if e["name"] == "env.step"]
            assert any(o["ts"] <= call["ts"] and call["ts"] + call["dur"] <= o["ts"] + o["dur"] for o in outer)


def greedy(url: str) -> tuple[list[int], list[float], str]:
    """Eight greedy tokens after a fixed prompt -> (tokens, log-probs, the weight version that served them)."""
    import httpx

    body = {
        "input_ids": [3, 17, 29, 101, 7, 64],
        "sampling_params": {"max_new_tokens": 8, "temperature": 0.0},
        "return_logprob": True,
    }
    meta = httpx.post(url + "/generate", json=body, timeout=60).json()["meta_info"]
    return (
        [t[1] for t in meta["output_token_logprobs"]],
        [t[0] for t in meta["output_token_logprobs"]],
        meta["weight_version"],
    )


@ray.remote
class RankZero:
    """Trainer rank 0's end of the weight transport, alone on its node: it reads a step's exported
    weights and broadcasts them to the engine through ``DistributedWeights``."""

    def __init__(self, url: str) -> None:
        from engine_helpers import LoopSide

        from slime_mt.engine.weight_sync import DistributedWeights

        self.side = LoopSide(url)
        self.weights = DistributedWeights(self.side, [1], buffer_bytes=1 << 20)

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def push(self, folder: str, version: int) -> None:
        from slime_mt.backends.megatron.convert import load_hf_state

        self.weights.push(iter(load_hf_state(folder).items()), version, contextlib.nullcontext)

    def close(self) -> None:
        self.weights.close()
        self.side.close()


@pytest.mark.parametrize("mode", ["sync", "fully-async", "ray"])
def test_trains_on_vllm(mode, tmp_path, request):
    """``slime-mt train --engine vllm`` on the demo's recipe (the tiny Qwen2 at head size 64): sync, the
    run launching its own vLLM server, two steps, the weights broadcast from rank 0 over the weight
    group; ``--fully-async --partial-rollout``, on the shared server by ``--engine-url``, three steps
    with every token within the staleness bound, the weights from disk; ``--ray`` on three loopback
    nodes, the vLLM server started by its engine actor on a node of its own, two steps, the weights
    over the group (the default on Ray). The weights reach vLLM after every step (its version is the
    step's) and the trainer's log-probs are vLLM's: at every step of the synchronous runs, so the
    weights vLLM serves are exactly the trainer's."""
    from safetensors.torch import load_file, save_file
    from vllm_helpers import VLLM_ARGS, vllm_python

    from slime_mt.assets import VLLM_TINY_KIND, tiny_model_dir
    from slime_mt.engine.vllm import VLLMClient

    model = tiny_model_dir(VLLM_TINY_KIND)
    data = tmp_path / "data"
    subprocess.run(
        [sys.executable, str(REPO / "examples/demo/make_data.py"), str(data)], check=True, capture_output=True, cwd=REPO
    )
    (tmp_path / "plugins.py").write_text(PLUGINS)
    flags = [*TWO_SMALL_STEPS, "--custom-rm-path", f"{tmp_path}/plugins.py:rm", "--engine", "vllm"]
    flags += ["--save-debug-rollout-data", dump_template(tmp_path / "run")]
    if mode == "sync":
        flags += ["--vllm-python", vllm_python(), "--vllm-extra-args", VLLM_ARGS, "--weight-transport", "distributed"]
        steps = 2
    elif mode == "ray":
        cluster = request.getfixturevalue("three_nodes")
        flags += ["--vllm-python", vllm_python(), "--vllm-extra-args", VLLM_ARGS, "--ray", "--ray-address"]
        flags += [cluster.address, "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1"]
        flags += ["--num-gpus-per-node", "1", "--rollout-num-gpus", "1"]
        steps = 2
    else:
        target = request.getfixturevalue("vllm_target")
        flags += ["--engine-url", target.url, "--fully-async", "--partial-rollout", "--max-staleness", "1"]
        flags += ["--use-tis", "--num-rollout", "3"]
        steps = 3
        (tmp_path / "v0").mkdir()
        save_file(load_file(str(model / "model.safetensors")), str(tmp_path / "v0" / "model.safetensors"))
    try:
        proc = run(demo_train_cmd(model, data / "train.jsonl", tmp_path / "run", *flags), timeout=900)
    finally:
        if mode == "fully-async":  # the shared server back at the starting weights
            import asyncio

            asyncio.run(VLLMClient(target.url).update_weights_from_disk(str(tmp_path / "v0"), weight_version="0"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(steps))
    assert [r["rollout/weight_version"] for r in rows] == [float(k + 1) for k in range(steps)]
    assert any(r["train/grad_norm"] > 0 for r in rows)
    assert rows[0]["train/train_rollout_logprob_abs_diff"] < 1e-3  # step 0: the trainer's weights are vLLM's
    if mode != "fully-async":
        assert [r["rollout/sample_weight_version_min"] for r in rows[1:]] == [1.0]
        assert all(r["train/train_rollout_logprob_abs_diff"] < 1e-3 for r in rows), rows
    if mode == "ray":  # the engine on a node of its own
        where = placement_lines(proc.stdout + proc.stderr)
        assert where["engine 0"] != where["trainer rank 0"], where
    elif mode == "fully-async":
        assert max(r["rollout/token_version_gap_max"] for r in rows) <= 1
        trained = [g for r in rows for g in r["trained_groups"]]
        assert len(trained) == len(set(trained)) == steps
    # the dumps and the trace of a vLLM run: every turn an engine call to the vLLM server (the client
    # picks it: no router), nested in its trajectory's span
    events = json.loads((tmp_path / "run" / "trace.json").read_text())
    assert_nested(events)
    lanes = lanes_by_name(events)
    for k in range(steps):
        dumped = load_dump(dump_path(dump_template(tmp_path / "run"), k))
        assert all(set(s) == SAMPLE_FIELDS for s in dumped["samples"])
        assert_engine_calls_in_lanes(lanes, dumped["samples"])
    engines = {e["args"]["engine"] for spans in lanes.values() for e in spans if e["name"] == "generate"}
    assert len(engines) == 1 and (mode != "fully-async" or engines == {target.url})
