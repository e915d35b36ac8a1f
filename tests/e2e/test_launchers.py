"""One run, three ways in: in one process, under torchrun and on a Ray cluster of loopback nodes, the
same flags train alike (Ray equals torchrun step by step), ``--fully-async`` keeps its staleness bound,
``--colocate`` releases the engines while training, and Ctrl-C (in the same colocated run) saves
and stops."""

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
from inspection_helpers import (
    SAMPLE_FIELDS,
    TRAIN_FIELDS,
    TURN_FIELDS,
    assert_dumped_train_log_probs,
    assert_engine_calls_in_lanes,
    assert_nested,
    dump_template,
    lanes_by_name,
)
from train_helpers import (
    REPO,
    ROLLOUT_PROCESSES,
    geo3k_train_cmd,
    metrics,
    placement_lines,
    ray_cmd,
    repo_env,
    run,
)

from slime_mt.config.checkpoint import dump_path
from slime_mt.inspection.dumps import load_dump


def test_ray_run_on_three_nodes_equals_the_torchrun_run(ray_tp2, torchrun_tp2):
    """TP=2 with its ranks on two nodes and the engine on the third, weights to the engine over the
    distributed path, the trajectories in two rollout processes and their environments in two workers,
    each pair on two nodes, the rollout role in its own actor: the same rewards, losses and gradient
    norms as under torchrun with everything of the rollout in rank 0's process, step by step; every
    group trained once."""
    run_dir, stdout = ray_tp2
    nodes = placement_lines(stdout)
    roles = ["engine 0", "env worker 0", "env worker 1", "rollout process 0", "rollout process 1", "rollout role"]
    assert sorted(nodes) == [*roles, "trainer rank 0", "trainer rank 1"], stdout
    steps = [line for line in stdout.splitlines() if "[step " in line]
    assert steps and all("(RolloutActor pid=" in line for line in steps), steps  # logged in its own actor
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
    # the dumps hold the trainer's log-probs, gathered from both TP ranks (issue 44 item 14), alike
    ray_lps = assert_dumped_train_log_probs(run_dir, "token_mean")
    torchrun_lps = assert_dumped_train_log_probs(torchrun_tp2, "token_mean")
    for ray_step, torchrun_step in zip(ray_lps, torchrun_lps, strict=True):
        for a, b in zip(ray_step, torchrun_step, strict=True):
            assert a == pytest.approx(b, abs=1e-6)


def test_one_process_torchrun_and_ray_run_the_same_driver_alike(straight, torchrun_tp2, ray_tp2):
    """The three launch paths run the same driver on their ranks' roles: in one process (TP=1, the
    rollout role in the process), under torchrun and on Ray (TP=2, the rollout role in rank 0's
    process, the other rank its peer) the first 2 steps log the same rollouts and the same train
    metrics (TP=2's reductions within 1e-5 of TP=1's)."""
    runs = {"one process": metrics(straight)[:2], "torchrun": metrics(torchrun_tp2)[:2], "ray": metrics(ray_tp2[0])[:2]}
    one = runs["one process"]
    for name, rows in runs.items():
        assert [r["step"] for r in rows] == [0, 1], name
        assert [r["trained_groups"] for r in rows] == [r["trained_groups"] for r in one], name
        assert [r["rollout/weight_version"] for r in rows] == [1.0, 2.0], name
        for key in ("rollout/reward_mean", "rollout/response_tokens_mean", "rollout/turns_max"):
            assert [r[key] for r in rows] == [r[key] for r in one], (name, key)
        for key in ("train/loss", "train/pg_loss", "train/grad_norm", "train/entropy"):
            assert [r[key] for r in rows] == pytest.approx([r[key] for r in one], abs=1e-5), (name, key)


@pytest.mark.parametrize("launcher", ["torchrun", "ray"])
def test_fully_async_at_tp2_trains_within_the_bound(geo3k, tmp_path, launcher, request):
    """--fully-async at TP=2 with sequence parallelism, under torchrun and on four Ray nodes: rank 0's
    manager feeds both ranks, the weights reach the engine mid-generation (on Ray: broadcast to two
    engines on two other nodes, behind the router, while two rollout processes generate), every group
    is trained once. Under torchrun with TIS, no token is staler than S=1; on Ray with the decoupled
    objective, M2PO and --oldest-groups-first (in the rollout processes), groups beyond the bound are
    trained, none dropped."""
    flags = ["--fully-async", "--partial-rollout", "--max-staleness", "1", "--sequence-parallel"]
    if launcher == "ray":
        flags += ["--use-decoupled-loss", "--m2po-threshold", "0.04", "--oldest-groups-first"]
    else:
        flags += ["--use-tis"]
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
        proc = run(geo3k_train_cmd(geo3k, tmp_path, *flags, tp=2, steps=3))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r["rollout/weight_version"] for r in rows] == [1.0, 2.0, 3.0]
    trained = [g for r in rows for g in r["trained_groups"]]
    assert len(trained) == len(set(trained)) == 6
    assert all(r["train/grad_norm"] > 0 for r in rows)
    assert all(0.0 <= r["async/dropped_token_share"] < 1.0 and r["async/trained_turns_mean"] >= 1 for r in rows)
    if launcher == "ray":
        assert all(r["async/dropped_groups"] == 0 and r["async/trained_token_share"] == 1.0 for r in rows)
        assert all(0.0 <= r["train/m2po_masked_fraction"] < 1.0 for r in rows)
    else:
        assert max(r["rollout/token_version_gap_max"] for r in rows) <= 1
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
        layouts = {e["args"]["layout"] for e in train if e["name"] == "train step"}
        assert layouts == {"TP=2 (sequence parallel) CP=1 EP=1 DP=1"}
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


@pytest.mark.parametrize("launcher", ["single", "ray"])
def test_colocated_engines_hold_nothing_while_training_and_ctrl_c_finishes_the_step_saves_and_stops(
    geo3k, tmp_path, launcher, request
):
    """--colocate: after each rollout the engines release their weights and KV cache (they report
    holding 0 bytes while the trainer trains), then wake with the new weights (weights, update, KV
    cache). In one process (weights by handle, the trainer offloaded while the engine generates) the
    run equals the disaggregated one step by step; on Ray (TP=2 on two nodes, an engine on each rank's
    device, weights broadcast) it trains every group once from the weights of the step before.

    The same run is a 20-step run stopped by Ctrl-C once it has logged two steps (one run checks both:
    the engines asleep or awake when the signal comes): the step in hand finishes, a checkpoint of it
    is saved, the engines stop and the run exits 130 naming the step and the --load that resumes it;
    on Ray the driver's Ctrl-C reaches every rank on its node."""
    # one trajectory in flight at a time (runs that equal each other step by step); the checkpoint can
    # only come from the interrupt
    flags = ["--rollout-concurrency", "1", "--save-interval", "100", "--colocate"]
    if launcher == "ray":
        cmd = ray_cmd(geo3k, tmp_path, request.getfixturevalue("three_nodes"), *flags, steps=20)
    else:
        cmd = geo3k_train_cmd(geo3k, tmp_path, *flags, "--offload", "--weight-transport", "tensor", steps=20)
    out, err = tmp_path / "driver.out", tmp_path / "driver.err"
    with out.open("w") as stdout, err.open("w") as stderr:
        child = subprocess.Popen(cmd, cwd=REPO, env=repo_env(), stdout=stdout, stderr=stderr)
        try:
            deadline = time.time() + 300
            while len(metrics(tmp_path) if (tmp_path / "metrics.jsonl").is_file() else []) < 2:
                assert child.poll() is None and time.time() < deadline, err.read_text()[-3000:]
                time.sleep(0.05)
            child.send_signal(signal.SIGINT)
            child.wait(timeout=300)
        finally:
            if child.poll() is None:
                child.kill()
    stderr = err.read_text()
    assert child.returncode == 130, stderr[-3000:]  # issue 44 item 10: `train && next` does not go on
    rows = metrics(tmp_path)
    assert 2 <= len(rows) < 20 and [r["step"] for r in rows] == list(range(len(rows))), stderr[-3000:]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == f"iter_{len(rows):07d}"
    assert stderr.strip().splitlines()[-1] == (
        f"slime-mt train: stopped by Ctrl-C after step {len(rows)} of 20; resume it with the same flags and "
        f"--load {tmp_path / 'ckpt'}"
    )
    assert [r["colocate/engine_bytes_while_training"] for r in rows] == [0.0] * len(rows)
    assert [r["rollout/sample_weight_version_min"] for r in rows] == [float(k) for k in range(len(rows))]
    assert all(r["train/grad_norm"] > 0 and r["train/train_rollout_logprob_abs_diff"] < 1e-5 for r in rows)
    trained = [g for r in rows for g in r["trained_groups"]]
    assert len(trained) == len(set(trained)) == 2 * len(rows)
    if launcher == "ray":
        nodes = placement_lines(out.read_text())
        assert nodes["engine 0"] == nodes["trainer rank 0"] and nodes["engine 1"] == nodes["trainer rank 1"]
    else:
        assert [r["colocate/trainer_bytes_while_generating"] for r in rows] == [0.0] * len(rows)
        reference = metrics(request.getfixturevalue("straight"))[:2]
        assert [r["rollout/reward_mean"] for r in rows[:2]] == [r["rollout/reward_mean"] for r in reference]
        for key in ("train/loss", "train/grad_norm", "rollout/response_tokens_mean"):
            assert [r[key] for r in rows[:2]] == pytest.approx([r[key] for r in reference], abs=1e-6), key
