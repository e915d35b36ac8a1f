"""--offload (colocated): the trainer's state leaves the device and comes back bit for bit, TP=1 and TP=2,
with the replicated and the distributed optimizer, and a LoRA run's adapters (the merged weights compared)."""

import pytest


@pytest.mark.parametrize("which", ["tp1_state", "tp2_state"])
@pytest.mark.parametrize(
    "kind", ["qwen2", "qwen2.5-vl", "qwen2_distributed_optimizer", "qwen2_distributed_optimizer_lora"]
)
def test_offload_frees_the_device_and_onload_trains_on_bit_for_bit(world, which, kind):
    """--offload (colocated): while offloaded the trainer's parameters, fp32 main parameters,
    gradients, optimizer state and reference model hold no device memory; onloaded, the next step's
    loss, grad norm and weights are exactly those of a trainer that never left the device."""
    r = world(which)["offload"][kind]
    assert r["held_bytes"] > 0 and r["offloaded_bytes"] == 0 and r["onloaded_bytes"] == r["held_bytes"]
    assert r["losses"][0] == r["losses"][1] and r["grad_norms"][0] == r["grad_norms"][1]
    assert r["same_weights"]
