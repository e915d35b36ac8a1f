"""Where the run's parts run (``ClusterConfig``: Ray placement, colocation, offload) and its rules."""

from __future__ import annotations

from dataclasses import dataclass

from slime_mt.config.fields import group, option, positive
from slime_mt.errors import ConfigError


@group("cluster")
@dataclass
class ClusterConfig:
    """Where the run's parts run: ``--ray`` places trainer ranks and engines on a Ray cluster."""

    ray: bool = option(False, "Run on a Ray cluster: one placement group, a Ray actor per trainer rank and per engine.")
    ray_address: str | None = option(
        None, "Ray cluster to join (the address 'ray start --head' prints, or auto); none: start a local one."
    )
    actor_num_nodes: int = option(1, "--ray: nodes of trainer ranks.")
    actor_num_gpus_per_node: int | None = option(
        None, "--ray: trainer ranks per node (one device each); none: --tensor-model-parallel-size."
    )
    rollout_num_gpus: int | None = option(
        None,
        "--ray: devices of all engines; none: --num-engines x --rollout-num-gpus-per-engine "
        "(with --colocate: the trainer's).",
    )
    rollout_num_gpus_per_engine: int = option(
        1, "--ray: devices per engine (SGLang's tensor parallel size), on one node."
    )
    num_gpus_per_node: int = option(8, "--ray: devices per node.")
    colocate: bool = option(
        False,
        "Engines on the trainer's devices (under --ray, the only way two roles share one): they generate, "
        "then release their weights and KV cache while the trainer trains, and take them back with the "
        "new weights.",
    )
    offload: bool = option(
        False,
        "--colocate: the trainer's parameters, gradients and optimizer state leave the device while the "
        "engines generate, and come back for training (slime's --offload).",
    )


def validate_cluster(cfg) -> None:
    """The placement flags (their fit to a cluster is checked when it is reserved)."""
    k = cfg.cluster
    positive(
        k,
        ("actor_num_nodes", "actor_num_gpus_per_node", "rollout_num_gpus", "rollout_num_gpus_per_engine"),
        optional=True,
    )
    positive(k, ("num_gpus_per_node",))
    if k.ray and cfg.engine.engine_url:
        raise ConfigError("--engine-url with --ray: the run places and starts its engines; give one or the other")
    if k.offload and not k.colocate:
        raise ConfigError("--offload: the trainer leaves the device to colocated engines; it needs --colocate")
    if k.colocate and (cfg.rollout.async_mode or cfg.rollout.fully_async):
        mode = "--async" if cfg.rollout.async_mode else "--fully-async"
        raise ConfigError(
            f"--colocate with {mode}: colocated engines sleep while the trainer trains, so generation "
            "cannot overlap training; drop one of them"
        )
