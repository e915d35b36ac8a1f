"""What the end-to-end tests share, once per session: the synthetic geo3k data, the reference runs that
several modules check or compare against (TP=1 in one process, TP=2 under torchrun, TP=2 on Ray), and
the Ray cluster of three loopback nodes."""

import pytest
from inspection_helpers import dump_template
from train_helpers import DETERMINISTIC, ENV_WORKERS, ROLLOUT_PROCESSES, geo3k_train_cmd, make_geo3k, ray_cmd, run


@pytest.fixture(scope="session")
def geo3k(session_dir):
    """16 synthetic geo3k problems and the ``rm`` plug-in (``make_geo3k``)."""
    return make_geo3k(session_dir("geo3k"))


@pytest.fixture(scope="session")
def straight(geo3k, session_dir):
    """A 4-step run at TP=1 with one trajectory in flight at a time and a checkpoint every step: the
    end-to-end checks at TP=1 read it, and the kill-and-resume test compares against it."""
    run_dir = session_dir("straight")
    proc = run(geo3k_train_cmd(geo3k, run_dir, *DETERMINISTIC, "--turn-records", "2", "--trace", "steps", steps=4))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="session")
def torchrun_tp2(geo3k, session_dir):
    """A 3-step run at TP=2 under torchrun, one trajectory in flight at a time, its steps dumped: the
    end-to-end checks at TP=2 read it, and the same run on Ray must equal it."""
    run_dir = session_dir("torchrun_tp2")
    dumps = ["--save-debug-rollout-data", dump_template(run_dir)]
    proc = run(geo3k_train_cmd(geo3k, run_dir, *DETERMINISTIC, *dumps, tp=2, steps=3))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="session")
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


@pytest.fixture(scope="session")
def ray_tp2(geo3k, three_nodes, session_dir):
    """``torchrun_tp2`` on Ray (ranks on two nodes, the engine on the third), with two environment
    workers and two rollout processes -> (run folder, the driver's output)."""
    run_dir = session_dir("ray_tp2")
    flags = [*DETERMINISTIC, "--rollout-num-gpus", "1", *ENV_WORKERS, *ROLLOUT_PROCESSES]
    flags += ["--save-debug-rollout-data", dump_template(run_dir)]
    proc = run(ray_cmd(geo3k, run_dir, three_nodes, *flags))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir, proc.stdout
