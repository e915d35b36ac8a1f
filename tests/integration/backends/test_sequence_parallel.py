"""Sequence parallelism (integration tier; the worlds tp2sp ~45 s and tp2sp_moe ~45 s, 2 ranks each):
TP=2 with ``--sequence-parallel`` equals TP=2 without it for every family (log-probs, entropies, loss,
every gradient in HF layout, grad norm, replicated copies, the weights after one step and after two),
the MoE families also replaying random routes (R3) and with the load-balancing loss on; rows of an odd
length are padded to split over the TP ranks. TP=2 x EP=2 and TP=2 x CP=2 with SP are in test_expert_parallel.py and
test_context_parallel.py (against one rank)."""

import pytest
import torch
from megatron_worlds import FAMILIES, MOE_FAMILIES, assert_close

# what the issue allows; the figures of this machine: log-probs, entropies, loss and the dense weights
# exactly equal, gradients within 6e-8 (the TP group's sums in another order), the grad norm 1.3e-7
TOLERANCE = 1e-6

CASES = [(k, "") for k in FAMILIES] + [(k, "_r3") for k in MOE_FAMILIES]


@pytest.mark.parametrize("kind,replay", CASES)
def test_sequence_parallel_trains_as_tp2_without_it(world, megatron_dir, kind, replay):
    world("tp2", kind), world("tp2sp", kind)
    off, on = (torch.load(megatron_dir / f"matrix_{t}_{kind}{replay}.pt", weights_only=True) for t in ("tp2", "tp2_sp"))
    assert on["sequence_parallel"] and not off["sequence_parallel"]
    assert any(on["row_pads"]) and not any(off["row_pads"])  # an odd row was padded to split over TP
    assert on["replayed_routes"] == off["replayed_routes"] and (off["replayed_routes"] > 0) == bool(replay)
    for got, want in zip(on["logprobs"] + on["entropy"], off["logprobs"] + off["entropy"]):
        assert len(got) == len(want) and max(abs(u - v) for u, v in zip(got, want)) <= TOLERANCE, (got, want)
    assert abs(on["loss"] - off["loss"]) <= TOLERANCE
    assert on["grads"].keys() == off["grads"].keys()
    for name, want in off["grads"].items():
        assert_close(on["grads"][name], want, name)
    assert abs(on["grad_norm"] - off["grad_norm"]) <= TOLERANCE * max(1.0, off["grad_norm"])
    assert on["replicated_spread"] == 0.0
    for after in ("weights", "weights_2"):  # after one step and after two (Adam's state from the first)
        assert on[after].keys() == off[after].keys()
        for name, want in off[after].items():
            assert float((on[after][name] - want).abs().max()) <= TOLERANCE, (after, name)
    assert abs(on["loss_2"] - off["loss_2"]) <= TOLERANCE
    assert abs(on["grad_norm_2"] - off["grad_norm_2"]) <= TOLERANCE * max(1.0, off["grad_norm_2"])


def test_the_load_balancing_loss_under_sequence_parallelism_is_tp2s(world, megatron_dir):
    """Qwen3-MoE with the load-balancing loss (coefficient 0.01): the routers see each TP rank's slice of
    the row, padding routed nowhere that counts; the gradients and the router metrics are TP=2's."""
    world("tp2_moe"), world("tp2sp_moe")
    off, on = (torch.load(megatron_dir / f"aux_{t}.pt", weights_only=True) for t in ("tp2", "tp2_sp"))
    assert off["metrics"]["moe/load_balancing_loss"] > 0
    assert on["metrics"].keys() == off["metrics"].keys()
    for key, want in off["metrics"].items():
        assert abs(on["metrics"][key] - want) <= TOLERANCE * max(1.0, abs(want)), (key, on["metrics"][key], want)
    for name, want in off["grads"].items():
        assert_close(on["grads"][name], want, name)
