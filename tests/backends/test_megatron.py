"""Megatron backend on CPU: HF parity per family, TP=2 vs TP=1, engine fidelity, checkpoints.

The checks run in spawned processes (``megatron_worker.py``): one TP=1 process and one 2-process
``torchrun`` TP group, each running many checks, so megatron is imported twice, not per test."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("megatron_worker.py")
REPO = Path(__file__).resolve().parents[2]


def launch(tp: int, checks: str, out: Path) -> dict:
    if tp == 1:
        cmd = [sys.executable, str(WORKER)]
    else:
        from slime_mt.engine.launch import free_port

        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tp), "--master-addr",
               "127.0.0.1", "--master-port", str(free_port())
               , str(WORKER)]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(cmd + ["--tp", str(tp), "--checks", checks, "--out", str(out)], capture_output=True,
                          text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / f"results_tp{tp}.json").read_text())


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("megatron")
    return {"tp1": launch(1, "families,tp,engine_fidelity,checkpoint", out), "tp2": launch(2, "tp", out), "dir": out}


@pytest.mark.parametrize("kind", ["smollm2", "qwen2", "qwen3", "qwen2.5-vl", "qwen3-vl"])
def test_logits_match_transformers_and_export_round_trips(results, kind):
    r = results["tp1"]["families"][kind]
    assert max(r["logit_max_abs_diff"]) < 1e-4, r  # text, and for VLMs a prompt with two images
    assert r["export_mismatched"] == [] and r["export_extra"] == []
    if kind.endswith("-vl"):
        assert len(r["logit_max_abs_diff"]) == 2


@pytest.mark.parametrize("kind", ["qwen2", "qwen2.5-vl"])
def test_tp2_equals_tp1(results, kind):
    a = torch.load(results["dir"] / f"tp1_{kind}.pt", weights_only=True)
    b = torch.load(results["dir"] / f"tp2_{kind}.pt", weights_only=True)
    for x, y in zip(a["logprobs"], b["logprobs"]):
        assert max(abs(u - v) for u, v in zip(x, y)) < 1e-5
    assert max(abs(u - v) for u, v in zip(a["entropy"], b["entropy"])) < 1e-5
    assert abs(a["loss"] - b["loss"]) < 1e-5
    assert a["grads"].keys() == b["grads"].keys()
    for k in a["grads"]:
        assert torch.allclose(a["grads"][k], b["grads"][k], atol=1e-5), k
    for k in a["weights"]:
        assert torch.allclose(a["weights"][k], b["weights"][k], atol=1e-5), k


@pytest.mark.parametrize("kind", ["smollm2", "qwen2.5-vl"])
def test_engine_logprobs_match_megatron_recomputation(results, kind):
    assert results["tp1"]["engine_fidelity"][kind]["mean_abs_diff"] < 1e-3


def test_checkpoint_resume_is_bitwise_and_survives_a_killed_save(results):
    r = results["tp1"]["checkpoint"]
    assert r["bitwise_equal"] is True
    assert r["extra"] == {"data_cursor": 2}
    assert r["latest"] == "iter_0000004" and r["after_killed_save"] == {"data_cursor": 2} and r["step"] == 4
