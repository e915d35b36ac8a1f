"""Data parallelism: DP=2 and TP=2 x DP=2 take the same update as one rank (tokens, loss, grad norm, the
step's metrics, the weights after three Adam steps), under both loss reductions and with the decoupled
objective (M2PO's cutoff taken over both ranks' tokens); the distributed
optimizer (``--use-distributed-optimizer``) takes the same steps as the replicated Adam there, each rank
holding half its state (dense and MoE, fp32 and bf16; in the dp2 and tp2dp2 worlds' ``dp`` check)."""

import pytest
import torch
from megatron_worlds import rel


@pytest.mark.parametrize("reduction", ["token_mean", "seq_mean_token_mean", "decoupled"])
@pytest.mark.parametrize("layout", ["tp1_dp2", "tp2_dp2"])
def test_data_parallel_gives_the_same_update_as_one_rank(world, megatron_dir, reduction, layout):
    world("tp1"), world({"tp1_dp2": "dp2", "tp2_dp2": "tp2dp2"}[layout])  # write the runs
    d = megatron_dir
    one = torch.load(d / f"dp_{reduction}_tp1_dp1.pt", weights_only=True)
    many = torch.load(d / f"dp_{reduction}_{layout}.pt", weights_only=True)
    assert many["tokens"] == one["tokens"]
    assert abs(many["loss"] - one["loss"]) < 1e-6
    assert abs(many["grad_norm"] - one["grad_norm"]) <= 1e-5 * one["grad_norm"], (many["grad_norm"], one["grad_norm"])
    keys = ["train/loss", "train/grad_norm", "train/tokens"]
    if reduction == "decoupled":  # M2PO's one cutoff over both ranks' tokens masks what one rank masks
        assert 0.05 < one["train"]["train/m2po_masked_fraction"] < 0.95, one["train"]
        keys += ["train/m2po_masked_fraction", "train/behav_log_weight_second_moment", "train/behav_weight_mean"]
    for key in keys:
        assert abs(many["train"][key] - one["train"][key]) <= 1e-5 * abs(one["train"][key]) + 1e-7, key
    for name, a in one["weights"].items():  # three Adam steps at lr 1e-5 (see the TP weights test)
        assert rel(many["weights"][name], a) < 1e-5 and float((many["weights"][name] - a).abs().max()) <= 6e-5, name


@pytest.mark.parametrize("layout", ["tp1_dp2", "tp2_dp2"])
def test_the_distributed_optimizer_takes_adams_steps_holding_half_its_state(world, layout):
    which = {"tp1_dp2": "dp2", "tp2_dp2": "tp2dp2"}[layout]
    results = world(which)[f"distributed_optimizer_{layout}"]
    assert sorted(results) == ["qwen3-moe_bf16", "qwen3-moe_fp32", "qwen3_bf16", "qwen3_fp32"]
    for case, r in results.items():
        (plain, sharded) = r["norms"]  # three steps, gradients clipped to norm 1
        assert all(abs(a - b) <= 1e-6 * a for a, b in zip(plain, sharded)), (case, r["norms"])
        if case.endswith("fp32"):
            assert r["max_abs"] <= 1e-6, (case, r["max_abs"])
        else:  # the bf16 weights round fp32 main copies that agree to 1e-9
            assert r["within_a_rounding_step"] and r["max_abs"] <= 1e-4, (case, r["max_abs"])
        for plain_bytes, sharded_bytes in r["optimizer_bytes"]:  # every rank: half, to a shard boundary
            assert abs(sharded_bytes - plain_bytes / 2) <= 4096, (case, r["optimizer_bytes"])
