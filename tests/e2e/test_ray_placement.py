"""Placement on a real Ray cluster of two nodes with their own raylets on loopback, each declaring 8
GPUs (Ray hands out device ids without physical GPUs): the geo3k recipe's layouts on one 8-GPU node,
disaggregated and colocated, and on two nodes; the run's own actors (a TrainerRank per rank, an
EngineActor per engine) report from inside the node and devices they were given."""

import os
import subprocess
import sys

import pytest
import ray
from train_helpers import REPO

from slime_mt.errors import ConfigError
from slime_mt.launch.ray.placement import plan, reserve


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 16, "num_gpus": 8, "resources": {"node_a": 1}},
    )
    cluster.add_node(num_cpus=16, num_gpus=8, resources={"node_b": 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def _inside(placement):
    """Start the run's own actors (a TrainerRank per rank, an EngineActor per engine) in their bundles,
    as ``--ray`` does -> what each saw from inside: its node, its Ray devices, its visible devices."""
    from slime_mt.config import Config
    from slime_mt.launch.ray.driver import engine_actors, trainer_actors

    trainer, engines = trainer_actors(placement), engine_actors(placement, Config(), REPO / "logs")
    try:
        return ray.get([a.where.remote() for a in trainer]), ray.get([a.where.remote() for a in engines])
    finally:
        for actor in trainer + engines:
            ray.kill(actor)


def _release(placement):
    from ray.util.placement_group import remove_placement_group

    remove_placement_group(placement.group)


@pytest.mark.parametrize(
    "name,flags,expect",
    [
        # the geo3k recipe on one 8-GPU node, disaggregated: 4 trainer ranks, 2 engines of 2 GPUs
        (
            "one node, disaggregated",
            dict(actor_num_nodes=1, actor_num_gpus_per_node=4, rollout_num_gpus=4, rollout_num_gpus_per_engine=2),
            {"trainer": [(0, 0), (0, 1), (0, 2), (0, 3)], "engines": [[(0, 4), (0, 5)], [(0, 6), (0, 7)]]},
        ),
        # colocated: 8 trainer ranks, 4 engines of 2 GPUs on the same devices
        (
            "one node, colocated",
            dict(
                actor_num_nodes=1,
                actor_num_gpus_per_node=8,
                rollout_num_gpus=None,
                rollout_num_gpus_per_engine=2,
                colocate=True,
            ),
            {
                "trainer": [(0, g) for g in range(8)],
                "engines": [[(0, 2 * e), (0, 2 * e + 1)] for e in range(4)],
            },
        ),
        # two nodes: the trainer's 8 ranks fill the first, 2 engines of 4 GPUs the second
        (
            "two nodes, disaggregated",
            dict(actor_num_nodes=1, actor_num_gpus_per_node=8, rollout_num_gpus=8, rollout_num_gpus_per_engine=4),
            {
                "trainer": [(0, g) for g in range(8)],
                "engines": [[(1, g) for g in range(4)], [(1, g) for g in range(4, 8)]],
            },
        ),
    ],
)
def test_every_rank_and_engine_runs_where_the_placement_says(cluster, name, flags, expect):
    colocate = flags.get("colocate", False)
    placement = reserve(plan(num_gpus_per_node=8, **flags), timeout=60)
    try:
        seen_trainer, seen_engines = _inside(placement)
        nodes = sorted(
            {s.node_id for s in placement.slots},
            key=lambda n: min((i for i, s in enumerate(placement.slots) if s.node_id == n)),
        )
        as_expected = lambda slot: (nodes.index(slot.node_id), slot.gpu)  # noqa: E731
        assert [as_expected(s) for s in placement.trainer] == expect["trainer"], name
        assert [[as_expected(s) for s in e] for e in placement.engines] == expect["engines"], name
        # from inside the actors: a rank holds its one device and sees only it; an engine's actor holds
        # none and sees exactly its engine's devices, on the node of its bundles
        assert [(w["node_id"], w["gpus"], w["cuda_visible_devices"]) for w in seen_trainer] == [
            (s.node_id, [s.gpu], str(s.gpu)) for s in placement.trainer
        ], name
        assert [(w["node_id"], w["gpus"], w["cuda_visible_devices"]) for w in seen_engines] == [
            (e[0].node_id, [], ",".join(str(s.gpu) for s in e)) for e in placement.engines
        ], name
        assert len({w["pid"] for w in seen_trainer + seen_engines}) == len(seen_trainer) + len(seen_engines)
        trainer_devices = {(s.node_id, s.gpu) for s in placement.trainer}
        engine_devices = [(s.node_id, s.gpu) for e in placement.engines for s in e]
        assert len(trainer_devices) == len(placement.trainer) and len(set(engine_devices)) == len(engine_devices)
        if colocate:
            assert set(engine_devices) == trainer_devices
        else:
            assert not trainer_devices & set(engine_devices)
        assert len(placement.describe()) == len(placement.trainer) + len(placement.engines)
    finally:
        _release(placement)


def test_a_run_the_cluster_cannot_hold_names_the_resources(cluster):
    with pytest.raises(ConfigError, match=r"cannot hold 24 bundles of \{'GPU': 1.0, 'CPU': 1.0\}: they need"):
        reserve(plan(1, 8, 16, 2, 8), timeout=3)


@pytest.mark.parametrize(
    "layout,expect",
    [
        # one 8-GPU node: trainer ranks on GPUs 0-3, the 4 engines on GPUs 4-7
        ({"NUM_NODES": "1"}, {"trainer": [(0, g) for g in range(4)], "engines": [[(0, g)] for g in range(4, 8)]}),
        # two nodes, by flags alone: 8 ranks fill the first node, 8 engines the second
        ({"NUM_NODES": "2"}, {"trainer": [(0, g) for g in range(8)], "engines": [[(1, g)] for g in range(8)]}),
        # one node, colocated: 8 ranks and an engine on each of their GPUs
        ({"COLOCATE": "1"}, {"trainer": [(0, g) for g in range(8)], "engines": [[(0, g)] for g in range(8)]}),
        # the MoE variant: colocated, 8 ranks at EP=8, 4 engines of 2 GPUs each
        (
            {"MODEL": "/models/Qwen3-VL-30B-A3B-Instruct"},
            {"trainer": [(0, g) for g in range(8)], "engines": [[(0, g), (0, g + 1)] for g in range(0, 8, 2)]},
        ),
        # the long-trajectory variant: colocated, 8 ranks (CP=4 x DP=2) and an engine on each GPU
        ({"LONG": "1"}, {"trainer": [(0, g) for g in range(8)], "engines": [[(0, g)] for g in range(8)]}),
    ],
)
def test_gpu_recipe_dry_run_places_as_the_readme_says(cluster, layout, expect):
    """The geo3k GPU recipe through --ray --dry-run on the cluster: its configuration, then which node
    and device each trainer rank and each engine gets."""
    script = REPO / "examples/geo3k_vlm_multi_turn/run_geo3k_vlm_multi_turn.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    env = dict(os.environ, MODEL="/models/Qwen3-VL-2B-Instruct", PYTHON=sys.executable, RAY_ADDRESS=cluster.address)
    env.update(layout)
    moe, long = "A3B" in env["MODEL"], "LONG" in layout
    proc = subprocess.run(
        ["bash", str(script), *([] if moe or long else ["2"]), "--dry-run"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"tensor_model_parallel_size: {1 if moe or long else 2}" in proc.stdout and "engine: sglang" in proc.stdout
    colocated = "COLOCATE" in layout or moe or long
    assert f"colocate: {str(colocated).lower()}" in proc.stdout and f"offload: {str(colocated).lower()}" in proc.stdout
    assert "eps_clip_high: 0.28" in proc.stdout and f"hf_checkpoint: {env['MODEL']}" in proc.stdout
    assert "use_distributed_optimizer: true" in proc.stdout  # every variant shards Adam's state over DP
    assert "sequence_parallel: true" in proc.stdout  # and splits the row over TP ranks (off at TP=1)
    experts = ["expert_model_parallel_size: 8", "expert_tensor_parallel_size: 1", "use_rollout_routing_replay: true"]
    assert all((line in proc.stdout) == moe for line in experts), proc.stdout[-3000:]
    recomputed = ["recompute_granularity: full", "recompute_method: uniform", "recompute_num_layers: 1"]
    assert all((line in proc.stdout) == (moe or long) for line in recomputed), proc.stdout[-3000:]
    lengths = [
        "max_turns: 20",
        "rollout_max_response_len: 32000",
        "context_parallel_size: 4",
        "transformer_impl: local",
    ]
    assert all((line in proc.stdout) == long for line in lengths), proc.stdout[-3000:]
    lines = [line.removeprefix("# placement: ") for line in proc.stdout.splitlines() if line.startswith("# placement")]
    node_order = []
    seen = {"trainer": [], "engines": []}
    for line in lines:
        role, where = line.split(": ", 1)
        node = where.split("(", 1)[1].split(")", 1)[0]
        if node not in node_order:
            node_order.append(node)
        gpus = [int(g) for g in where.split(" devices ", 1)[1].split(",")] if role.startswith("engine") else []
        if role.startswith("trainer"):
            seen["trainer"].append((node_order.index(node), int(where.rsplit(" ", 1)[1])))
        else:
            seen["engines"].append([(node_order.index(node), g) for g in gpus])
    assert seen == expect, proc.stdout[-2000:]
