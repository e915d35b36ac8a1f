"""``slime-mt train`` with tiny MoE models, rollout routing replay on (e2e tier): Qwen3-VL-MoE on synthetic
geo3k, two steps at EP=2 with full recompute under torchrun (~35 s) and on Ray (two ranks on two
nodes, ~60 s), and the text Qwen3-MoE on the demo's two-turn game, two steps of ``--fully-async
--partial-rollout`` in one process (~30 s). Each run's engine returns the routes of every token, the
trainer replays them (its routers agree with the fp32 engine's wherever one weight version routed the
whole trajectory), the experts' load is logged, the engine serves each update, and the checkpoint
holds every expert."""

import subprocess
import sys

import pytest
import torch
from train_helpers import (
    PLUGINS,
    RAY_TP2,
    REPO,
    TWO_SMALL_STEPS,
    demo_train_cmd,
    final_weights,
    geo3k_train_cmd,
    metrics,
    run,
)

from slime_mt.assets import tiny_model_dir
from slime_mt.safetensors_files import load_hf_state

R3 = ["--use-rollout-routing-replay", "--log-routing-replay-gap"]


# A reward that differs within every group whatever the tiny model writes, so that every step trains: the
# geo3k plugin's reward reads the response, and on a loaded machine the engine batches requests otherwise,
# so a step whose groups all drew equal rewards (grad norm 0) came up in one CI run
BY_INDEX_RM = "async def rm(args, sample):\n    return float(sample.index % 2)\n"


def _cmd(geo3k, run_dir, *flags, ranks: int = 1):
    cmd = geo3k_train_cmd(geo3k, run_dir, *R3, *flags, model="qwen3-vl-moe", ranks=ranks)
    (run_dir / "by_index.py").write_text(BY_INDEX_RM)
    cmd[cmd.index("--custom-rm-path") + 1] = f"{run_dir}/by_index.py:rm"
    return cmd


def _check_run(run_dir, steps: int, exact_routes: bool, kind: str = "qwen3-vl-moe") -> list[dict]:
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(steps))
    assert [r["rollout/weight_version"] for r in rows] == [float(k + 1) for k in range(steps)]
    for r in rows:
        assert r["train/routing_replay_routes"] > 0 and r["train/grad_norm"] > 0
        assert r["train/moe/load_max_over_mean"] >= 1.0 and "train/moe/load_max_over_mean/layer_0" in r
        # the versions that routed the trajectories' tokens are the versions that generated them
        assert r["rollout/route_version_gap_max"] == r["rollout/token_version_gap_max"], r
        gap, unreplayed = (
            r["train/train_rollout_logprob_abs_diff"],
            r["train/train_rollout_logprob_abs_diff_without_replay"],
        )
        if exact_routes:  # one weight version per step: the trainer's fp32 routers agree with the engine's
            assert r["train/routing_replay_mismatch_frac"] == 0.0
            assert abs(unreplayed - gap) < 1e-6, r  # so replay changes no log-prob
        else:
            assert 0.0 <= r["train/routing_replay_mismatch_frac"] <= 1.0 and unreplayed >= 0.0
    weights = final_weights(run_dir)
    start = load_hf_state(tiny_model_dir(kind))
    if kind == "qwen3-vl-moe":  # the published fused pair
        experts, shape = "model.language_model.layers.0.mlp.experts.gate_up_proj", (8, 64, 96)
    else:  # one tensor per expert
        experts, shape = "model.layers.0.mlp.experts.7.gate_proj.weight", (48, 64)
    assert weights.keys() == start.keys() and weights[experts].shape == shape
    assert not torch.equal(weights[experts], start[experts])  # the experts trained
    return rows


@pytest.mark.parametrize("launcher", ["torchrun", "ray"])
def test_moe_trains_at_ep2_with_routing_replay(geo3k, tmp_path, launcher, request):
    flags = ["--expert-model-parallel-size", "2"]
    # with whole layers recomputed in the backward (recompute == none: tests/integration/backends/test_recompute.py)
    flags += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    if launcher == "ray":
        cluster = request.getfixturevalue("three_nodes")
        cmd = _cmd(geo3k, tmp_path, *flags)
        cmd = [sys.executable, "-m", "slime_mt.cli", *cmd[cmd.index("train") :]]
        cmd += ["--ray", "--ray-address", cluster.address, *RAY_TP2]
    else:
        cmd = _cmd(geo3k, tmp_path, *flags, ranks=2)
    proc = run(cmd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_run(tmp_path, 2, exact_routes=True)


def test_text_moe_trains_fully_async_with_partial_rollouts_and_routing_replay(tmp_path):
    data = tmp_path / "data"
    make = [sys.executable, str(REPO / "examples/demo/make_data.py"), str(data)]
    subprocess.run(make, check=True, capture_output=True, cwd=REPO)
    (tmp_path / "plugins.py").write_text(PLUGINS)
    flags = [
        *TWO_SMALL_STEPS,
        *R3,
        "--custom-rm-path",
        f"{tmp_path}/plugins.py:rm",
        "--save",
        str(tmp_path / "run/ckpt"),
    ]
    flags += ["--fully-async", "--partial-rollout", "--max-staleness", "1", "--use-tis"]
    proc = run(demo_train_cmd(tiny_model_dir("qwen3-moe"), data / "train.jsonl", tmp_path / "run", *flags))
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_run(tmp_path / "run", 2, exact_routes=False, kind="qwen3-moe")
