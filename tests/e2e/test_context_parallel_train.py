"""``slime-mt train --context-parallel-size 2`` (e2e tier): the geo3k VLM run split over two CP ranks under
torchrun (~35 s) and on Ray (a rank on each of two nodes, ~60 s; there with ``--use-distributed-optimizer``,
which shards Adam's state over the two CP ranks) trains its first two steps as the one-process run
does: the same rollouts and rewards (the engine served each step's weights), and the losses,
entropies and grad norms of one process to 1e-6 (CP=2 equals CP=1 per gradient:
tests/integration/backends/test_context_parallel.py)."""

import sys

import pytest
from train_helpers import DETERMINISTIC, RAY_TP2, geo3k_train_cmd, metrics, run


@pytest.mark.parametrize("launcher", ["torchrun", "ray"])
def test_context_parallel_trains_as_one_process_does(geo3k, straight, tmp_path, launcher, request):
    flags = [*DETERMINISTIC, "--context-parallel-size", "2"]
    if launcher == "ray":
        cluster = request.getfixturevalue("three_nodes")
        cmd = geo3k_train_cmd(geo3k, tmp_path, *flags, steps=2)
        cmd = [sys.executable, "-m", "slime_mt.cli", *cmd[cmd.index("train") :]]
        cmd += ["--ray", "--ray-address", cluster.address, *RAY_TP2, "--use-distributed-optimizer"]
    else:
        cmd = geo3k_train_cmd(geo3k, tmp_path, *flags, steps=2, ranks=2)
    proc = run(cmd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows, one = metrics(tmp_path), metrics(straight)[:2]
    assert [r["step"] for r in rows] == [0, 1]
    assert [r["rollout/reward_mean"] for r in rows] == [r["rollout/reward_mean"] for r in one]
    assert [r["rollout/response_tokens_mean"] for r in rows] == [r["rollout/response_tokens_mean"] for r in one]
    for key in ("train/loss", "train/pg_loss", "train/entropy", "train/grad_norm"):
        assert [r[key] for r in rows] == pytest.approx([r[key] for r in one], abs=1e-6), key
