"""Placement on a real Ray cluster of two nodes with their own raylets on loopback, each declaring 8
GPUs (Ray hands out device ids without physical GPUs): the geo3k recipe's layouts on one 8-GPU node,
disaggregated and colocated, and on two nodes; the run's own actors (a TrainerRank per rank, an
EngineActor per engine) report from inside the node and devices they were given."""

import pytest

from slime_mt.errors import ConfigError
from slime_mt.launch.ray.placement import Slot, assign, plan


@pytest.mark.parametrize(
    "flags,message",
    [
        (dict(rollout_num_gpus=None), "--rollout-num-gpus is required unless --colocate"),
        (dict(rollout_num_gpus=6, rollout_num_gpus_per_engine=4), "--rollout-num-gpus=6: must be a multiple of"),
        (dict(rollout_num_gpus_per_engine=16), "an engine's devices are on one node"),
        (dict(actor_num_gpus_per_node=9), "--actor-num-gpus-per-node=9: a node has --num-gpus-per-node=8"),
        (dict(colocate=True, rollout_num_gpus=2), "--colocate: --rollout-num-gpus=2 must equal"),
        (dict(actor_num_nodes=0), "--actor-num-nodes=0: must be a positive integer"),
    ],
)
def test_flags_that_cannot_place_name_the_flag(flags, message):
    base = dict(actor_num_nodes=1, actor_num_gpus_per_node=4, rollout_num_gpus=4, rollout_num_gpus_per_engine=2)
    with pytest.raises(ConfigError, match=message):
        plan(num_gpus_per_node=8, **{**base, **flags})


def test_bundles_order_by_node_address_then_node_then_device_and_an_engine_never_spans_nodes():
    slots = [
        Slot(0, "10.0.0.10", "b", 1),
        Slot(1, "10.0.0.9", "a", 1),
        Slot(2, "10.0.0.10", "b", 0),
        Slot(3, "10.0.0.9", "a", 0),
    ]
    trainer, engines = assign(plan(1, 2, 2, 2, 2), slots)
    assert [s.bundle for s in trainer] == [3, 1]  # 10.0.0.9 before 10.0.0.10 (numerically), device 0 first
    assert [[s.bundle for s in e] for e in engines] == [[2, 0]]
    odd = [Slot(0, "h", "a", 0), Slot(1, "h", "a", 1), Slot(2, "h", "b", 0), Slot(3, "h", "b", 1), Slot(4, "h", "b", 2)]
    with pytest.raises(ConfigError, match="engine 0 would span nodes"):
        assign(plan(1, 1, 4, 2, 4), odd)
