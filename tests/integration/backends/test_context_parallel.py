"""Context-parallel attention over real CP ranks (integration tier, torchrun over gloo: ~10 s at CP=2, ~20 s
at CP=4): each rank holds its zigzag share of a packed row and runs it through the fused core
attention, which gathers the keys and values of the whole row; its output and the gradients of its
queries, keys and values (summed over the ranks whose queries saw them) equal one process's causal
SDPA per sequence. Grouped-query heads. Their peak memory on a 32k-token row (~15 s) stays near the
fused SDPA's at CP=1: no [S/cp, S] tensor. And the trainer: CP=2 (every family, MoE also replaying random
routes; one launch, ~45 s) and TP=2 x CP=2 with sequence parallelism on 4 ranks (dense, ~45 s) equal TP=1 on log-probs,
entropies, loss, every gradient, the grad norm and the weights after a step."""

import json
import subprocess
import sys

import pytest
import torch
from megatron_worlds import DENSE_FAMILIES, FAMILIES, MOE_FAMILIES, assert_close
from train_helpers import HELPERS, repo_env

# the row's log-probs come from another split of the same sums: one float32 ulp at |log p| of 8-16
LOGPROB_ULPS = 2e-6


@pytest.mark.parametrize("cp", [2, 4])
def test_every_cp_rank_attends_its_share_as_one_process_attends_the_row(cp, tmp_path):
    out = tmp_path / "cp.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(cp)]
    cmd += [str(HELPERS / "cp_attention_worker.py"), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=repo_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["cp"] == cp
    for name in ("output", "grad_query", "grad_key", "grad_value"):
        assert r[name] < 2e-6, r


TOKENS = 32768


def _attention_peak(tmp_path, cp: int) -> float:
    out = tmp_path / f"memory_cp{cp}.json"
    launch = [sys.executable]
    if cp > 1:
        launch += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(cp)]
    cmd = [*launch, str(HELPERS / "cp_memory_worker.py"), str(out), str(TOKENS)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=repo_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())["peak_rise_bytes"]


def test_attention_of_a_32k_row_at_cp2_holds_no_row_sized_tensor(tmp_path):
    """Forward and backward over one 32k-token sequence: the rise of each CP rank's peak memory stays
    near the fused SDPA's at CP=1 (tens of MB, tiles and per-token buffers), where one [S/cp, S] boolean
    mask alone would be 512 MB (and its fp32 scores 4 GB per head). Figures of two runs: CP=1 28-29 MB,
    CP=2 47-54 MB per rank."""
    one, split = _attention_peak(tmp_path, 1), _attention_peak(tmp_path, 2)
    row_mask = TOKENS // 2 * TOKENS  # bytes of a [S/2, S] bool tensor
    print(f"attention peak rise at {TOKENS} tokens: CP=1 {one / 2**20:.0f} MB, CP=2 {split / 2**20:.0f} MB per rank")
    assert split < one + 64 * 2**20 and split < row_mask / 4, (one, split)


CASES = [("cp2", "tp1_cp2", k, "") for k in FAMILIES] + [("cp2", "tp1_cp2", k, "_r3") for k in MOE_FAMILIES]
CASES += [("tp2cp2sp", "tp2_cp2_sp", k, "") for k in DENSE_FAMILIES]  # with sequence parallelism


@pytest.mark.parametrize("which,tag,kind,replay", CASES)  # replay "_r3": random routes replayed in every MoE layer
def test_context_parallel_trains_as_one_rank_does(world, megatron_dir, which, tag, kind, replay):
    world("tp1", kind), world(which, kind)
    one, split = (torch.load(megatron_dir / f"matrix_{t}_{kind}{replay}.pt", weights_only=True) for t in ("tp1", tag))
    assert split["replayed_routes"] == one["replayed_routes"] and (one["replayed_routes"] > 0) == bool(replay)
    for got, want in zip(split["logprobs"] + split["entropy"], one["logprobs"] + one["entropy"]):
        assert len(got) == len(want) and max(abs(u - v) for u, v in zip(got, want)) <= LOGPROB_ULPS, (got, want)
    assert abs(split["loss"] - one["loss"]) <= 1e-6
    assert split["grads"].keys() == one["grads"].keys()
    for name, want in one["grads"].items():
        assert_close(split["grads"][name], want, name)
    assert abs(split["grad_norm"] - one["grad_norm"]) <= 1e-6 * max(1.0, one["grad_norm"])
    assert split["weights"].keys() == one["weights"].keys()
    for name, want in one["weights"].items():
        assert float((split["weights"][name] - want).abs().max()) <= 1e-5, name  # one lr: Adam's step of noise


@pytest.mark.parametrize("which,tag", [("tp2_moe", "tp2"), ("cp2", "tp1_cp2")])
def test_the_load_balancing_loss_splits_over_tp_and_cp_ranks_as_its_tokens_do(world, megatron_dir, which, tag):
    """With the load-balancing loss on, TP=2 (the MoE layer's tokens sharded over TP) and CP=2 give the
    gradients and router metrics of one rank: the loss, its gradient and the logged value are each
    rank's share of the row's, summed."""
    world("tp1_moe"), world(which)
    one, split = (torch.load(megatron_dir / f"aux_{t}.pt", weights_only=True) for t in ("tp1", tag))
    assert one["metrics"]["moe/load_balancing_loss"] > 0
    assert split["metrics"].keys() == one["metrics"].keys()
    for key, want in one["metrics"].items():
        assert abs(split["metrics"][key] - want) <= 1e-6 * max(1.0, abs(want)), (key, split["metrics"][key], want)
    for name, want in one["grads"].items():
        assert_close(split["grads"][name], want, name)
