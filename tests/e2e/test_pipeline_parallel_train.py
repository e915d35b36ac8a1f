"""``slime-mt train --pipeline-model-parallel-size 2`` (e2e tier): the demo's two-turn game with the tiny
text Qwen3 (tied embeddings), two steps of two micro-batches, split over two pipeline stages under
torchrun (~35 s) and on Ray (a stage on each of two nodes, ~60 s, with the uneven split's flag), trains
as the one-process run (~25 s) does: the same rollouts and rewards in both steps (the engine was served
the whole model, every stage's layers, after the first update), the same losses, entropies and grad
norms to 1e-6, and a checkpoint with every tensor of the model (PP=2 equals PP=1 per gradient:
tests/integration/backends/test_pipeline_parallel.py)."""

import json
import subprocess
import sys

import pytest
import torch
from inspection_helpers import lanes_by_name
from train_helpers import (
    DETERMINISTIC,
    PLUGINS,
    RAY_TP2,
    REPO,
    TWO_SMALL_STEPS,
    demo_train_cmd,
    final_weights,
    metrics,
    run,
)

from slime_mt.assets import tiny_model_dir
from slime_mt.safetensors_files import load_hf_state

FLAGS = [*TWO_SMALL_STEPS, *DETERMINISTIC, "--micro-batch-size", "2", "--lr", "1e-4"]


def _cmd(data, run_dir, *extra: str) -> list[str]:
    flags = [*FLAGS, "--custom-rm-path", f"{data.parent}/plugins.py:rm", "--save", str(run_dir / "ckpt"), *extra]
    return demo_train_cmd(tiny_model_dir("qwen3"), data / "train.jsonl", run_dir, *flags)


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("pp_demo")
    subprocess.run([sys.executable, str(REPO / "examples/demo/make_data.py"), str(root / "data")], check=True, cwd=REPO)
    (root / "plugins.py").write_text(PLUGINS)
    return root / "data"


@pytest.fixture(scope="module")
def one_stage(demo_data, tmp_path_factory):
    """The same run in one process (PP=1)."""
    run_dir = tmp_path_factory.mktemp("pp1")
    proc = run(_cmd(demo_data, run_dir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


@pytest.mark.parametrize("launcher", ["torchrun", "ray"])
def test_two_pipeline_stages_train_as_one_process_does(demo_data, one_stage, tmp_path, launcher, request):
    cmd = _cmd(demo_data, tmp_path, "--pipeline-model-parallel-size", "2")
    if launcher == "ray":
        cluster = request.getfixturevalue("three_nodes")
        # Megatron's uneven split named (one of the two layers on the first stage, as the even split has
        # it): the flag reaches every rank's Megatron config
        cmd += ["--ray", "--ray-address", cluster.address, *RAY_TP2, "--decoder-first-pipeline-num-layers", "1"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *cmd[1:]]
    proc = run(cmd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows, one = metrics(tmp_path), metrics(one_stage)
    assert [r["step"] for r in rows] == [0, 1]
    lanes = lanes_by_name(json.loads((tmp_path / "trace.json").read_text()))
    for rank in (0, 1):  # both ranks trained as the two stages of one pipeline
        steps = [e for e in lanes[(f"trainer rank {rank}", "train")] if e["name"] == "train step"]
        assert [e["args"]["layout"] for e in steps] == ["TP=1 CP=1 EP=1 PP=2 DP=1"] * 2
    assert [r["rollout/weight_version"] for r in rows] == [r["rollout/weight_version"] for r in one]
    # step 1 was sampled from the first update's weights: the engine had every stage's layers
    for key in ("rollout/reward_mean", "rollout/response_tokens_mean"):
        assert [r[key] for r in rows] == [r[key] for r in one], key
    for key in (
        "train/loss",
        "train/pg_loss",
        "train/entropy",
        "train/grad_norm",
        "train/train_rollout_logprob_abs_diff",
    ):
        assert [r[key] for r in rows] == pytest.approx([r[key] for r in one], abs=1e-6), key
    weights, start, single = final_weights(tmp_path), load_hf_state(tiny_model_dir("qwen3")), final_weights(one_stage)
    assert weights.keys() == start.keys() == single.keys()  # both stages' tensors, the embedding once
    for name, want in single.items():
        assert float((weights[name] - want).abs().max()) <= 1e-6, name
    assert not torch.equal(weights["model.layers.1.mlp.down_proj.weight"], start["model.layers.1.mlp.down_proj.weight"])
