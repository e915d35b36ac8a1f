"""Activation recompute (``--recompute-granularity full|selective``, ``--recompute-method
uniform|block``, ``--recompute-num-layers``, ``--recompute-modules``) equals none, bit for bit, and
keeps fewer activations for the backward pass (integration tier; three Megatron worlds of ~20-60 s:
TP=1, TP=2 with sequence parallelism and, for MoE, EP=2). Each world trains one step of a text and a
VLM model of each kind (dense, MoE) with every recompute case on fresh actors; the MoE ones replay
random routes (R3), which a recomputed layer must replay again."""

import pytest
from megatron_worlds import MOE_FAMILIES

RECOMPUTED = ("full_uniform", "full_block", "selective", "selective_mlp")


@pytest.mark.parametrize("which", ["tp1_state", "tp2_state", "ep2"])
def test_recompute_changes_no_number_and_keeps_fewer_activations(world, which):
    world_results = world(which)
    results = world_results["recompute"]
    # without Transformer Engine (every CPU run), what Megatron recomputes through it is refused by name
    assert world_results["recompute_refused"] == "--recompute-modules layernorm: needs Transformer Engine (a GPU)"
    kinds = ("qwen3-moe", "qwen3-vl-moe") if which.startswith("ep2") else ("qwen3", "qwen2.5-vl", *MOE_FAMILIES)
    assert tuple(results) == kinds
    for kind, cases in results.items():
        moe = kind in MOE_FAMILIES
        assert set(cases) == {"none", *RECOMPUTED, *(["selective_moe"] if moe else [])}, kind
        none = cases["none"]
        for case, r in cases.items():
            where = f"{which} {kind} {case}"
            assert r["logprobs"] == r["entropy"] == r["loss"] == r["grads"] == r["grad_norm"] == 0.0, (where, r)
            assert r["metrics_equal"], where  # the router's load and the replay counts too, not counted twice
            assert r["replayed_routes"] == none["replayed_routes"] and (r["replayed_routes"] > 0) == moe, where
            if case != "none":  # what the forward keeps for the backward
                assert r["kept_bytes"] < none["kept_bytes"], (where, r["kept_bytes"], none["kept_bytes"])
        # whole layers recomputed keep the least: only each recomputed chunk's input
        assert cases["full_uniform"]["kept_bytes"] <= min(c["kept_bytes"] for c in cases.values()), kind
