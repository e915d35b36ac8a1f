"""Expert parallelism (integration tier; the worlds ep2 ~25 s, tp2ep2sp ~90 s, tp2ep2_etp1 ~20 s,
ep1_resume ~10 s): EP=2, TP=2 x EP=2 with sequence parallelism and TP=2 x EP=2 folded (ETP=1) equal
EP=1 for the MoE families (log-probs, loss, gradients in HF layout, grad norm, the weights after a
step; with the routers' own routes and replaying random ones), both token dispatchers agree (at EP=2
and at TP=2 x EP=2 with SP), exports gather every expert to rank 0 only, and a checkpoint saved at
EP=2 resumes at EP=1 bit for bit. TP=2 and the transformers parity of these families are in the family matrix
(test_tensor_parallel.py, test_parity.py)."""

import json

import pytest
import torch
from megatron_worlds import MOE_FAMILIES, assert_close

from slime_mt.safetensors_files import load_hf_state

# One float32 ulp at |log p| of 8-16 is 9.5e-7: an expert's GEMM over another set of rows (the tokens
# every data-parallel rank sends it under EP) may round its last bit differently on the CPU.
LOGPROB_ULPS = 2e-6
LR = 1e-5


def _runs(root, kind, tag, suffix=""):
    return [torch.load(root / f"matrix_{t}_{kind}{suffix}.pt", weights_only=True) for t in ("tp1", tag)]


@pytest.mark.parametrize("replay", ["", "_r3"])  # the router's own routes; random routes replayed (R3)
@pytest.mark.parametrize("kind", MOE_FAMILIES)
@pytest.mark.parametrize("which,tag", [("ep2", "tp1_ep2"), ("tp2ep2sp", "tp2_ep2_sp"), ("tp2ep2_etp1", "tp2_ep2_etp1")])
def test_expert_parallel_equals_ep1(world, megatron_dir, kind, which, tag, replay):
    world("tp1_moe")  # writes the EP=1 matrix
    world(which)
    ep1, ep2 = _runs(megatron_dir, kind, tag, replay)
    assert ep2["replayed_routes"] == ep1["replayed_routes"] and (ep1["replayed_routes"] > 0) == bool(replay)
    for got, want in zip(ep2["logprobs"] + ep2["entropy"], ep1["logprobs"] + ep1["entropy"]):
        assert max(abs(u - v) for u, v in zip(got, want)) <= LOGPROB_ULPS, (got, want)
    assert abs(ep2["loss"] - ep1["loss"]) <= 1e-6
    assert ep2["grads"].keys() == ep1["grads"].keys()
    assert any(".experts.7." in name or name.endswith("experts.gate_up_proj") for name in ep1["grads"])
    for name, want in ep1["grads"].items():
        assert_close(ep2["grads"][name], want, name)
    assert abs(ep2["grad_norm"] - ep1["grad_norm"]) <= 1e-6 * max(1.0, ep1["grad_norm"])
    assert ep2["replicated_spread"] == 0.0
    assert ep2["weights"].keys() == ep1["weights"].keys()
    for name, want in ep1["weights"].items():
        assert float((ep2["weights"][name] - want).abs().max()) <= 1e-5 * max(1.0, float(want.abs().max())), name


@pytest.mark.parametrize("which", ["ep2", "tp2ep2sp"])
@pytest.mark.parametrize("kind", MOE_FAMILIES)
def test_the_allgather_dispatcher_equals_the_alltoall_one(world, which, kind):
    """With a load-balancing loss (coefficient 0.01): the same gradients, and the router metrics users
    watch (per-layer expert load, the load-balancing loss) the same from either dispatcher; under TP=2 x
    EP=2 with sequence parallelism the all-gather one pads each rank's slice to the group's longest."""
    r = world(which)["dispatchers"][kind]
    assert r["logprobs"] <= LOGPROB_ULPS and r["entropy"] <= LOGPROB_ULPS and r["loss"] <= 1e-6, r
    assert r["grads"] <= 1e-6 * max(1.0, r["max_grad"]), r
    gathered, exchanged = r["router"]["allgather"], r["router"]["alltoall"]
    assert (
        gathered.keys()
        == exchanged.keys()
        == {
            "moe/load_max_over_mean",
            "moe/load_max_over_mean/layer_0",
            "moe/load_balancing_loss",
        }
    )
    assert gathered["moe/load_max_over_mean"] == exchanged["moe/load_max_over_mean"] >= 1.0
    assert 0.5 < exchanged["moe/load_balancing_loss"] < 8.0  # about 1 when balanced (E / topk at worst)
    assert abs(gathered["moe/load_balancing_loss"] - exchanged["moe/load_balancing_loss"]) <= 1e-6


def test_experts_export_to_rank_zero_only(world):
    """Rank 1 lends its experts (4 of 8 in the sparse layer: 12 tensors) and holds no full tensor."""
    full, lent = world("ep2")["export_ranks"]
    assert full["none"] == 0 and full["full"] > 0
    assert lent == {"full": 0, "none": 12}


def test_a_checkpoint_saved_at_ep2_resumes_at_ep1_bit_for_bit(world, megatron_dir):
    resumed = world("ep1_resume")["moe_reshard_load"]  # saves b from the a that ep2 saved
    root = megatron_dir / "reshard_moe"
    a, b = (root / x / (root / x / "latest").read_text() for x in "ab")
    for sub in ("", "optimizer/exp_avg", "optimizer/exp_avg_sq"):
        saved, resaved = load_hf_state(a / sub), load_hf_state(b / sub)
        assert saved.keys() == resaved.keys() and any(".experts.7." in n for n in saved)
        for name in saved:
            assert torch.equal(saved[name], resaved[name]), (sub, name)
    layouts = [json.loads((x / "trainer_state.json").read_text())["layout"] for x in (a, b)]
    assert layouts == [{"tp": 1, "dp": 2, "ep": 2, "etp": 1}, {"tp": 1, "dp": 1}]
    assert resumed == {"step": 3, "extra": {"layout": "tp1_ep2"}}  # 2 + the step
    ep2 = torch.load(megatron_dir / "reshard_moe_continued_tp1_ep2.pt", weights_only=True)
    ep1 = torch.load(megatron_dir / "reshard_moe_continued_tp1.pt", weights_only=True)
    assert ep1.keys() == ep2.keys()
    for name in ep1:  # one more step at lr 1e-3 from the same state
        assert torch.allclose(ep1[name], ep2[name], rtol=0, atol=1e-5), name


def test_ranks_with_fewer_micro_batches_run_idle_passes_and_the_step_equals_ep1(world, megatron_dir):
    """At EP=2 x DP=2 the ranks pack different numbers of rows; every MoE layer's exchange is
    collective, so the rank with fewer runs idle passes that train nothing: the step equals EP=1's."""
    ep2, ep1 = world("ep2")["ep_rows"], world("ep1_resume")["ep_rows"]
    assert len(set(ep2["rows"])) == 2, ep2["rows"]  # the ranks differ
    # the expert load counts every real token once, whichever rank routed it (idle passes do not count)
    load = "train/moe/load_max_over_mean/layer_0"
    assert ep2[load] == ep1[load] >= 1.0 and ep2["train/moe/load_max_over_mean"] == ep1[load]
    assert abs(ep2["loss"] - ep1["loss"]) <= 1e-6 and abs(ep2["grad_norm"] - ep1["grad_norm"]) <= 1e-6
    a = torch.load(megatron_dir / "ep_rows_tp1_ep2.pt", weights_only=True)
    b = torch.load(megatron_dir / "ep_rows_tp1.pt", weights_only=True)
    assert a.keys() == b.keys()
    for name in a:
        assert float((a[name] - b[name]).abs().max()) <= 1e-5 * max(1.0, float(b[name].abs().max())), name
