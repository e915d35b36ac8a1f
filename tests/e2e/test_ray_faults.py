"""On Ray: the placement a dry run prints, weights that reach an engine on another node exactly, and
faults survived: a lost trainer node (the run stops naming it; ``--load`` resumes), and in one run
(``faults``, issue 68: three runs before) an environment worker killed mid-step and an engine killed
mid-rollout (both restarted; the run trains as without), then a rollout role that raises (the run stops
naming it and the step). The environment worker's fault ran under the one-process launcher with workers
on Ray and compared with ``straight``; it now runs under ``--ray`` and the run compares with
``torchrun_tp2``, the reference of the Ray run (the pool and its restarts are the same code)."""

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import ray
from inspection_helpers import (
    assert_nested,
    lanes_by_name,
)
from train_helpers import (
    DETERMINISTIC,
    ENV_WORKERS,
    HELPERS,
    REPO,
    metrics,
    placement_lines,
    ray_cmd,
    repo_env,
    run,
)


def test_ray_dry_run_prints_the_placement_and_releases_it(geo3k, three_nodes, tmp_path):
    proc = run(ray_cmd(geo3k, tmp_path, three_nodes, "--rollout-num-gpus", "1", "--dry-run"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    nodes = placement_lines(proc.stdout)
    assert sorted(nodes) == ["engine 0", "trainer rank 0", "trainer rank 1"] and len(set(nodes.values())) == 3
    # the cluster cannot hold a fourth device: the error names what was asked and what there is
    proc = run(ray_cmd(geo3k, tmp_path, three_nodes, "--rollout-num-gpus", "2", "--dry-run"), timeout=900)
    assert proc.returncode != 0 and "cannot hold 4 bundles" in proc.stderr, proc.stderr[-2000:]


def test_weights_reach_an_engine_on_another_node_exactly_after_each_step(ray_tp2, three_nodes, tiny_paths):
    """Rank 0's end of the distributed path on one node, an engine on another, nothing shared on disk:
    after each of the Ray run's 3 steps, the engine serves exactly the weights the trainer exported
    (its checkpoint of that step): greedy tokens and log-probs equal an engine loaded from that folder."""
    from slime_mt.config import EngineConfig
    from slime_mt.engine.embedded.server import LocalEngine
    from slime_mt.launch.ray.actors import EngineActor

    run_dir, stdout = ray_tp2
    ray.init(
        address=three_nodes.address,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": f"{REPO}:{HELPERS}"}},
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


@pytest.fixture(scope="module")
def lost_node(geo3k, session_dir):
    """On a cluster of its own (a head without devices, three nodes with one each), a 3-step run whose
    trainer rank 1 loses its node once the first checkpoint is written -> (cluster, run folder, the
    run's command, its stderr, rank 1's node as its placement line names it)."""
    from ray.cluster_utils import Cluster

    run_dir = session_dir("lost_node")
    cluster = Cluster(initialize_head=True, connect=False, head_node_args={"num_cpus": 2, "num_gpus": 0})
    try:
        nodes = [cluster.add_node(num_cpus=2, num_gpus=1) for _ in range(3)]
        cluster.wait_for_nodes()
        cmd = ray_cmd(geo3k, run_dir, cluster, *DETERMINISTIC, "--rollout-num-gpus", "1")
        out, err = run_dir / "driver.out", run_dir / "driver.err"
        with out.open("w") as stdout, err.open("w") as stderr:
            child = subprocess.Popen(cmd, cwd=REPO, env=repo_env(), stdout=stdout, stderr=stderr)
            try:
                deadline = time.time() + 300
                while not (run_dir / "ckpt" / "latest").is_file() and child.poll() is None:
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
        node = where.split("placement: trainer rank 1: ", 1)[1].rsplit(" GPU", 1)[0]  # node ADDRESS (id)
        yield cluster, run_dir, cmd, err.read_text(), node
    finally:
        cluster.shutdown()


def test_a_lost_trainer_node_stops_the_run_naming_it(lost_node):
    """The run stops with one line naming the rank, its node and --load; no traceback."""
    _, run_dir, _, message, node = lost_node
    assert f"TrainerRankLost: trainer rank 1 on {node} was lost" in message, message[-3000:]
    assert "the node has left the cluster" in message
    assert f"the run stops; resume from the last checkpoint with --load {run_dir / 'ckpt'}" in message
    assert "Traceback" not in message


def test_load_resumes_the_run_of_the_lost_node_and_every_group_trains_once(lost_node):
    """With a node added back, --load resumes the stopped run: each step once, each group once."""
    cluster, run_dir, cmd, _, _ = lost_node
    cluster.add_node(num_cpus=2, num_gpus=1)
    cluster.wait_for_nodes()
    resumed = run(cmd + ["--load", str(run_dir / "ckpt")])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    trained = [g for r in rows for g in r["trained_groups"]]
    assert len(trained) == len(set(trained)) == 6


def engine_processes(cluster) -> list[int]:
    """PIDs of the processes Ray runs EngineActors in on ``cluster``'s nodes (their title is
    ``ray::EngineActor...``, their parent a raylet of the cluster: another cluster on the machine, as
    another pytest-xdist worker's, has its own)."""
    raylets = {p.process.pid for node in cluster.list_all_nodes() for p in node.all_processes.get("raylet", [])}
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and (proc / "cmdline").read_bytes().startswith(b"ray::EngineActor"):
                parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if parent in raylets:
                    found.append(int(proc.name))
        except OSError:  # gone meanwhile
            pass
    return found


FLAKY_ROLLOUT = """
from slime_mt.rollout.group_rollout import generate_rollout


def generate_rollout_then_fail(args, rollout_id, data_source, evaluation=False):
    if rollout_id == {step}:
        raise ValueError("the reward server is gone")
    return generate_rollout(args, rollout_id, data_source, evaluation)
"""

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


@pytest.fixture(scope="module")
def faults(geo3k, three_nodes, tmp_path_factory):
    """One Ray run with three faults: TP=2 on two nodes, two engines on two more behind the router, two
    environment workers, 7 steps. An environment worker's process is killed in the middle of step 0, one
    engine's process in the middle of step 1's rollout, and the rollout function raises in step 6 ->
    (run folder, the driver's stdout, its stderr, its exit code)."""
    run_dir = tmp_path_factory.mktemp("faults")
    (run_dir / "flaky_rollout.py").write_text(FLAKY_ROLLOUT.format(step=6))
    env_file = run_dir / "dies_once.py"
    env_file.write_text(DIES_ONCE_ENV.format(path=REPO / "envs/geo3k.py", marker=run_dir / "killed"))
    flags = [*DETERMINISTIC, "--rollout-num-gpus", "2", "--rollout-interaction-env-path", str(env_file), *ENV_WORKERS]
    flags += ["--rollout-function-path", f"{run_dir / 'flaky_rollout.py'}:generate_rollout_then_fail"]
    fourth = three_nodes.add_node(num_cpus=2, num_gpus=1)
    three_nodes.wait_for_nodes()
    try:
        out = run_dir / "driver.out"
        with out.open("w") as stdout:
            cmd = ray_cmd(geo3k, run_dir, three_nodes, *flags, steps=7)
            child = subprocess.Popen(cmd, cwd=REPO, env=repo_env(), stdout=stdout, stderr=subprocess.PIPE, text=True)
            deadline = time.time() + 300
            while not (run_dir / "metrics.jsonl").is_file() and child.poll() is None:
                assert time.time() < deadline, "no step was logged"
                time.sleep(0.05)
            (victim, _) = engine_processes(three_nodes)
            os.kill(victim, signal.SIGKILL)
            _, stderr = child.communicate(timeout=600)
    finally:
        three_nodes.remove_node(fourth)
    return run_dir, out.read_text(), stderr, child.returncode


def test_a_rollout_role_that_raises_ends_the_run_naming_itself_and_the_step(faults):
    """The rollout role runs in its own actor: a rollout function that raises in step 6 ends the run
    (exit 1) with one line naming the rollout role, the step and the cause, once both trainer ranks have
    stopped with it (their tasks ended with that error: none was killed or lost); steps 0-5 are logged."""
    run_dir, _, stderr, code = faults
    assert code == 1, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == (
        "slime-mt train: error: RolloutRoleFailed: the rollout role failed at step 6: ValueError: the reward "
        "server is gone; trainer ranks 0, 1 of 2 stopped with it"
    ), stderr[-3000:]
    assert [r["step"] for r in metrics(run_dir)] == list(range(6))


def test_an_engine_killed_mid_rollout_is_started_again_and_the_run_trains_as_without(faults, torchrun_tp2):
    """The engine killed in step 1: its requests fail over to the other engine (each is the same request
    again), Ray restarts its actor, the engine starts again outside the rotation and joins it at the
    next weight update with the current weights: nothing fails, no token comes from weights the run did
    not mean, every group is trained once, the restart is counted, and the run trains as the same run
    under torchrun (its 3 steps)."""
    run_dir, stdout, _, _ = faults
    assert "(started again)" in stdout and "is back in the rotation" in stdout
    rows, reference = metrics(run_dir), metrics(torchrun_tp2)
    assert sum(r["engine/restarts"] for r in rows) == 1
    assert all(r["rollout/env_failures"] == 0 for r in rows)
    assert [r["rollout/sample_weight_version_min"] for r in rows] == [float(step) for step in range(6)]
    trained = [g for r in rows for g in r["trained_groups"]]
    assert len(trained) == len(set(trained)) == 12
    assert [r["rollout/reward_mean"] for r in rows[:3]] == [r["rollout/reward_mean"] for r in reference]
    for key in ("train/loss", "train/grad_norm", "rollout/response_tokens_mean", "rollout/turns_mean"):
        assert [r[key] for r in rows[:3]] == pytest.approx([r[key] for r in reference], abs=1e-6), key


def test_an_env_worker_killed_mid_step_is_restarted_and_the_run_trains_as_without(faults):
    """The environment worker killed in step 0: Ray restarts it, the episode is rebuilt there and its
    earlier steps replayed, the step is tried again; nothing fails, the restart is counted (the run
    trains as without: the test above), and the workers' calls are in the trace."""
    run_dir, _, _, _ = faults
    rows = metrics(run_dir)
    assert (run_dir / "killed").exists()
    assert sum(r["env/worker_restarts"] for r in rows) == 1
    # the killed step is tried again (RetryableEnvError: the worker died during it); an episode of the
    # same group held by that worker retries its own call too, as that one did or EpisodeLost, when it
    # had one more to make: how many did depends on the timing, and each at most once
    causes = {k.rsplit("/", 1)[1]: v for k, v in rows[0].items() if k.startswith("rollout/env_retries_by/")}
    assert set(causes) <= {"RetryableEnvError", "EpisodeLost"} and causes.get("RetryableEnvError", 0) >= 1
    assert 1 <= sum(r["rollout/env_retries"] for r in rows) == sum(causes.values()) <= 4  # a step's samples
    # the workers' calls in the trace: each worker a process, each episode's calls on its trajectory's lane
    events = json.loads((run_dir / "trace.json").read_text())
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

        from slime_mt.engine.weights.sync import DistributedWeights

        self.side = LoopSide(url)
        self.weights = DistributedWeights(self.side, [1], buffer_bytes=1 << 20)

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def push(self, folder: str, version: int) -> None:
        from slime_mt.safetensors_files import load_hf_state

        self.weights.push(iter(load_hf_state(folder).items()), version, contextlib.nullcontext)

    def close(self) -> None:
        self.weights.close()
        self.side.close()
