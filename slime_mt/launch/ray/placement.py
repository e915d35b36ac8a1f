"""Where each trainer rank and each engine runs: one placement group for the run, ordered by node and device.

slime's flags decide the counts: ``--actor-num-nodes`` x ``--actor-num-gpus-per-node`` trainer ranks,
``--rollout-num-gpus`` / ``--rollout-num-gpus-per-engine`` engines. The run reserves one bundle per
device (``{"GPU": 1, "CPU": c}``; on a CPU cluster ``{"CPU": c}`` per rank and per engine) in one
placement group, asks a probe actor in every bundle which node and device Ray gave it, and sorts the
bundles by (node address, node id, device): trainer rank r takes the r-th, so ranks fill nodes in
order and the same cluster gives the same ranks. Disaggregated, the engines take the bundles after
the trainer's; with ``--colocate`` they take the trainer's own (the only case where two roles share
a device). An engine's devices are always on one node.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from slime_mt.errors import ConfigError


@dataclass(frozen=True)
class Slot:
    """One bundle of the run's placement group, as Ray placed it."""

    bundle: int  # index in the placement group
    node_ip: str
    node_id: str
    gpu: int | None  # the device Ray gave the bundle (None on a CPU cluster)

    def describe(self) -> str:
        where = f"node {self.node_ip} ({self.node_id[:8]})"
        return f"{where} GPU {self.gpu}" if self.gpu is not None else f"{where} CPU"


@dataclass(frozen=True)
class Plan:
    """How many bundles the run reserves and who takes which (from the flags, before any cluster)."""

    trainer_ranks: int
    engines: int
    devices_per_engine: int
    colocate: bool
    use_gpus: bool
    cpus_per_bundle: float = 1.0

    @property
    def bundles(self) -> int:
        if not self.use_gpus:
            return self.trainer_ranks + (0 if self.colocate else self.engines)
        return self.trainer_ranks + (0 if self.colocate else self.engines * self.devices_per_engine)

    def bundle_resources(self) -> dict[str, float]:
        return {"GPU": 1.0, "CPU": self.cpus_per_bundle} if self.use_gpus else {"CPU": self.cpus_per_bundle}


def plan(
    actor_num_nodes: int,
    actor_num_gpus_per_node: int,
    rollout_num_gpus: int | None,
    rollout_num_gpus_per_engine: int,
    num_gpus_per_node: int,
    colocate: bool = False,
    use_gpus: bool = True,
    cpus_per_bundle: float = 1.0,
) -> Plan:
    """The run's plan from slime's flags; ConfigError naming the flag when they cannot place.
    ``rollout_num_gpus`` None: with ``--colocate`` the trainer's devices, otherwise required."""
    for flag, value in (
        ("--actor-num-nodes", actor_num_nodes),
        ("--actor-num-gpus-per-node", actor_num_gpus_per_node),
        ("--rollout-num-gpus-per-engine", rollout_num_gpus_per_engine),
        ("--num-gpus-per-node", num_gpus_per_node),
    ):
        if value < 1:
            raise ConfigError(f"{flag}={value}: must be a positive integer")
    trainer = actor_num_nodes * actor_num_gpus_per_node
    if rollout_num_gpus is None:
        if not colocate:
            raise ConfigError("--rollout-num-gpus is required unless --colocate (engines on the trainer's devices)")
        rollout_num_gpus = trainer
    if rollout_num_gpus < 1:
        raise ConfigError(f"--rollout-num-gpus={rollout_num_gpus}: must be a positive integer")
    if actor_num_gpus_per_node > num_gpus_per_node:
        raise ConfigError(
            f"--actor-num-gpus-per-node={actor_num_gpus_per_node}: a node has --num-gpus-per-node={num_gpus_per_node}"
        )
    if rollout_num_gpus_per_engine > num_gpus_per_node:
        raise ConfigError(
            f"--rollout-num-gpus-per-engine={rollout_num_gpus_per_engine}: an engine's devices are on one node, "
            f"which has --num-gpus-per-node={num_gpus_per_node}"
        )
    if rollout_num_gpus % rollout_num_gpus_per_engine:
        raise ConfigError(
            f"--rollout-num-gpus={rollout_num_gpus}: must be a multiple of "
            f"--rollout-num-gpus-per-engine={rollout_num_gpus_per_engine}"
        )
    if colocate and rollout_num_gpus != trainer:
        raise ConfigError(
            f"--colocate: --rollout-num-gpus={rollout_num_gpus} must equal the trainer's devices "
            f"(--actor-num-nodes x --actor-num-gpus-per-node = {trainer})"
        )
    return Plan(
        trainer,
        rollout_num_gpus // rollout_num_gpus_per_engine,
        rollout_num_gpus_per_engine,
        colocate,
        use_gpus,
        cpus_per_bundle,
    )


@dataclass
class Placement:
    """The reserved placement group and who runs where."""

    group: object  # ray.util.placement_group.PlacementGroup
    plan: Plan
    slots: list[Slot]  # every bundle, in the run's order
    trainer: list[Slot]  # rank r runs in trainer[r]
    engines: list[list[Slot]]  # engine e runs on engines[e] (its devices, one node)

    def describe(self) -> list[str]:
        """The placement as the run logs it (and ``--dry-run`` prints it)."""
        lines = [f"trainer rank {r}: {slot.describe()}" for r, slot in enumerate(self.trainer)]
        for e, slots in enumerate(self.engines):
            devices = ", ".join(str(s.gpu) for s in slots) if self.plan.use_gpus else "CPU"
            lines.append(f"engine {e}: node {slots[0].node_ip} ({slots[0].node_id[:8]}) devices {devices}")
        return lines


def order_key(slot: Slot) -> tuple:
    """Bundles sort by node address (numerically), then node id (nodes that share an address), then device."""
    try:
        address: tuple = (0, int(ipaddress.ip_address(slot.node_ip)))
    except ValueError:
        address = (1, slot.node_ip)
    return (*address, slot.node_id, slot.gpu if slot.gpu is not None else -1, slot.bundle)


def assign(plan_: Plan, slots: list[Slot]) -> tuple[list[Slot], list[list[Slot]]]:
    """Trainer ranks and engines from the bundles (any order) -> (trainer slots, engine slot lists)."""
    ordered = sorted(slots, key=order_key)
    trainer = ordered[: plan_.trainer_ranks]
    rest = trainer if plan_.colocate else ordered[plan_.trainer_ranks :]
    per_engine = plan_.devices_per_engine if plan_.use_gpus else 1
    engines = [rest[e * per_engine : (e + 1) * per_engine] for e in range(plan_.engines)]
    for e, engine in enumerate(engines):
        if len({s.node_id for s in engine}) > 1:
            raise ConfigError(
                f"engine {e} would span nodes ({', '.join(s.describe() for s in engine)}): "
                f"--rollout-num-gpus-per-engine={plan_.devices_per_engine} must divide the devices "
                f"each node gives the engines"
            )
    return trainer, engines


def reserve(plan_: Plan, timeout: float = 300.0) -> Placement:
    """Reserve the run's placement group on the connected Ray cluster and place it. Raises naming the
    resources when the cluster cannot hold it within ``timeout`` seconds."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    resources = plan_.bundle_resources()
    total = ray.cluster_resources()
    short = {k: v * plan_.bundles for k, v in resources.items() if v * plan_.bundles > total.get(k, 0)}
    if short:
        have = {k: total.get(k, 0) for k in short}
        raise ConfigError(
            f"the Ray cluster cannot hold {plan_.bundles} bundles of {resources}: they need {short} and the "
            f"cluster has {have} in all (see --actor-num-nodes, "
            f"--actor-num-gpus-per-node, --rollout-num-gpus)"
        )
    group = placement_group([dict(resources) for _ in range(plan_.bundles)], strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=timeout)
    if not ready:
        remove_placement_group(group)
        raise RuntimeError(
            f"the Ray cluster cannot hold {plan_.bundles} bundles of {resources} within {timeout:.0f}s "
            f"(it has {ray.cluster_resources()})"
        )
    answers = _probe_bundles(group, plan_.bundles, gpus=1 if plan_.use_gpus else 0)
    slots = [Slot(i, *answers[i]) for i in range(plan_.bundles)]
    trainer, engines = assign(plan_, slots)
    return Placement(group, plan_, sorted(slots, key=order_key), trainer, engines)


def _probe_bundles(group, bundles: int, gpus: int) -> dict[int, tuple[str, str, int | None]]:
    """Ask inside each bundle where it is -> {bundle index: (node address, node id, its device or None)}.

    One probe at a time per node, on one worker process there: a task asking for a device would
    otherwise get a process of its own (Ray starts a worker per waiting task, and by default ends a
    device task's worker after one call), and a placement of 16 bundles on two nodes started 16 Python
    workers that only answered this. The nodes answer in parallel."""
    import ray
    from ray.util.placement_group import placement_group_table
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    probe = ray.remote(max_calls=0)(_where)  # 0: no limit (a device task's default is one call)
    by_node: dict[str, list[int]] = {}
    for index, node in sorted(placement_group_table(group)["bundles_to_node_id"].items()):
        by_node.setdefault(node, []).append(int(index))
    running: dict = {}  # probe's ObjectRef -> (its node, its bundle)

    def ask(node: str) -> None:
        index = by_node[node].pop(0)
        strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)
        ref = probe.options(num_cpus=0, num_gpus=gpus, scheduling_strategy=strategy).remote()
        running[ref] = (node, index)

    for node in by_node:
        ask(node)
    answers: dict[int, tuple[str, str, int | None]] = {}
    while running:
        (ref,), _ = ray.wait(list(running), num_returns=1)
        node, index = running.pop(ref)
        answers[index] = ray.get(ref)
        if by_node[node]:
            ask(node)
    if sorted(answers) != list(range(bundles)):
        raise RuntimeError(f"placement group {group.id.hex()} answered for bundles {sorted(answers)} of {bundles}")
    return answers


def _where() -> tuple[str, str, int | None]:
    """Inside a bundle: (node address, node id, the device Ray gave it or None)."""
    import ray

    gpu_ids = ray.get_gpu_ids()
    return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id(), int(gpu_ids[0]) if gpu_ids else None
