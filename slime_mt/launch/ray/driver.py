"""``slime-mt train --ray``: the run on a Ray cluster.

The driver (the ``slime-mt train`` process, on the head node) connects to the cluster
(``--ray-address``; none: starts a local one), reserves the run's placement group (``placement.py``),
logs who runs where, starts one ``EngineActor`` per engine on its devices and the sglang-router on
its node in front of them (vLLM engines have none: their client routes), the rollout role's
``RolloutActor`` on its own node (where the run folder is), then one ``TrainerRank`` per Megatron
rank. The ranks run the driver as under ``torchrun``; rank 0 reaches the rollout role's actor for
every rank (``rollout.py``) and sends the engines the weights itself over the distributed path
(``--weight-transport auto``). The driver waits for the ranks; when one fails it stops the others
(they would wait in a collective), then the rollout role, the engines, the router and the placement
group. A rollout that fails ends the run with one line naming the role and the step, once every rank
has stopped with it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
from pathlib import Path

from slime_mt.config import Config
from slime_mt.errors import ConfigError, RolloutFailedError, RolloutRoleFailed, TrainerRankLost
from slime_mt.launch.ray.placement import Placement, Plan, plan, reserve
from slime_mt.stop import StopRequest, on_stop_signals

logger = logging.getLogger(__name__)


def plan_of(cfg: Config, use_gpus: bool) -> Plan:
    """The run's plan from its flags; ConfigError naming the flag when they do not fit together."""
    c, e = cfg.cluster, cfg.engine
    tp = cfg.train.tensor_model_parallel_size
    per_node = c.actor_num_gpus_per_node or tp
    rollout = c.rollout_num_gpus
    if rollout is None and not c.colocate:
        rollout = e.num_engines * c.rollout_num_gpus_per_engine
    result = plan(
        c.actor_num_nodes,
        per_node,
        rollout,
        c.rollout_num_gpus_per_engine,
        c.num_gpus_per_node,
        colocate=c.colocate,
        use_gpus=use_gpus,
    )
    if result.trainer_ranks % tp:
        raise ConfigError(
            f"--tensor-model-parallel-size={tp} must divide the trainer's {result.trainer_ranks} ranks "
            f"(--actor-num-nodes x --actor-num-gpus-per-node)"
        )
    t = cfg.train
    ep, etp = t.expert_model_parallel_size, t.expert_tensor_parallel_size or tp
    if result.trainer_ranks % (ep * etp):
        raise ConfigError(
            f"--expert-model-parallel-size={ep} x --expert-tensor-parallel-size={etp} must divide the trainer's "
            f"{result.trainer_ranks} ranks"
        )
    if e.engine == "local" and use_gpus and c.rollout_num_gpus_per_engine != 1:
        raise ConfigError("--rollout-num-gpus-per-engine: the embedded engine (--engine local) runs on one device")
    return result


def place(cfg: Config) -> Placement:
    """Reserve the run's placement group on the connected cluster (GPU bundles when it has GPUs)."""
    import ray

    use_gpus = ray.cluster_resources().get("GPU", 0) > 0
    placement = reserve(plan_of(cfg, use_gpus))
    for line in placement.describe():
        print(f"placement: {line}", flush=True)
    return placement


def dry_run_placement(cfg: Config) -> list[str]:
    """``--dry-run --ray``: reserve the placement group, describe it, release it -> the lines."""
    import ray
    from ray.util.placement_group import remove_placement_group

    from slime_mt.cluster.runtime import connect

    connect(cfg.cluster.ray_address)  # the driver's own connection, shut down below
    try:
        use_gpus = ray.cluster_resources().get("GPU", 0) > 0
        placement = reserve(plan_of(cfg, use_gpus))
        remove_placement_group(placement.group)
        return placement.describe()
    finally:
        ray.shutdown()


def run(cfg: Config, run_dir: Path, stop: StopRequest | None = None) -> int:
    """Train ``cfg`` on the Ray cluster -> the steps done (rank 0's); raises what the first failing rank
    raised. ``stop``: set by the driver's Ctrl-C or SIGTERM (which every rank then acts on)."""
    import ray
    from ray.util.placement_group import remove_placement_group

    from slime_mt.cluster.runtime import connect
    from slime_mt.engine.launch import Router

    connect(cfg.cluster.ray_address)  # the driver's own connection, shut down below
    placement = None
    engines, ranks, router, rollout = [], [], None, None
    try:
        placement = place(cfg)
        ranks = trainer_actors(placement)
        rollout = rollout_actor()
        prepared = [r.prepare.remote() for r in [*ranks, rollout]]  # they import while the engines start
        engines, urls = _start_engines(cfg, placement, run_dir)
        if cfg.engine.engine == "vllm":  # no router: the vLLM client keeps its own rotation
            engine_url = urls
        else:  # always a router: an engine that dies leaves its rotation until it is back with the weights
            host = ray.util.get_node_ip_address()
            router = Router(run_dir / "logs", host=host, policy=cfg.engine.sglang_router_policy)
            for url in urls:
                router.add_worker(url)
            engine_url = [router.url, *urls]
        cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, engine_url=engine_url))
        ray.get(prepared)
        where = ray.get(rollout.where.remote())
        print(f"placement: rollout role: node {where['node_ip']} ({where['node_id'][:8]})", flush=True)
        ray.get(rollout.start.remote(cfg, str(run_dir), engines))
        master = ray.get(ranks[0].rendezvous.remote())
        logger.info("trainer ranks rendezvous at %s:%d", *master)
        refs = [
            r.train.remote(cfg, str(run_dir), i, len(ranks), master, rollout if i == 0 else None)
            for i, r in enumerate(ranks)
        ]
        with on_stop_signals(_forward_interrupt(ranks, stop or StopRequest())):
            try:
                _wait_all(refs)
                return ray.get(refs[0])
            except ray.exceptions.RayActorError as e:
                raise TrainerRankLost(_lost_rank_message(cfg, placement, refs, e)) from None
            except ray.exceptions.RayTaskError as e:
                if not isinstance(e.cause, RolloutFailedError | RolloutRoleFailed):
                    raise
                raise type(e.cause)(f"{e.cause}; {_stopped_with(refs, type(e.cause))}") from None
    finally:
        for rank in ranks:
            ray.kill(rank)
        if rollout is not None:
            # rank 0 closed it when the run ended; after a failure it goes now, with the workers it
            # started (Ray ends an actor's own actors with it), not after what it was still doing
            ray.kill(rollout)
        for engine in engines:
            try:
                ray.get(engine.stop.remote(), timeout=60)
            except Exception:  # stop everything even if one engine cannot be stopped cleanly
                logger.exception("stopping an engine failed")
            ray.kill(engine)
        if router is not None:
            router.stop()
        if placement is not None:
            remove_placement_group(placement.group)
        ray.shutdown()


def rollout_actor():
    """The rollout role's actor, on the driver's node (the run folder is there)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from slime_mt.launch.ray.actors import RolloutActor

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return RolloutActor.options(num_cpus=0, scheduling_strategy=here).remote(os.getcwd(), list(sys.path))


def _stopped_with(refs: list, error: type) -> str:
    """Which trainer ranks stopped of themselves with the rollout role's ``error`` (each raised it)."""
    import ray

    stopped = []
    for rank, ref in enumerate(refs):
        try:
            ray.get(ref, timeout=0)
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, error):
                stopped.append(rank)
        except Exception:  # not finished, or lost: not stopped with it
            pass
    return f"trainer ranks {', '.join(map(str, stopped))} of {len(refs)} stopped with it"


def trainer_actors(placement: Placement) -> list:
    """One TrainerRank per Megatron rank, in rank order, each in its bundle with its one device."""
    from slime_mt.launch.ray.actors import TrainerRank

    gpus = 1 if placement.plan.use_gpus else 0
    return [_actor(TrainerRank, placement, slot.bundle, gpus) for slot in placement.trainer]


def engine_actors(placement: Placement, cfg: Config, log_dir: Path) -> list:
    """One EngineActor per engine, in the bundle of its first device and showing only its devices;
    Ray restarts one whose process dies (the rollout role starts its engine again)."""
    from slime_mt.engine.launch import run_engine_settings
    from slime_mt.launch.ray.actors import EngineActor

    no_visible_devices_override = {"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}
    settings, lora = run_engine_settings(cfg)
    return [
        _actor(
            EngineActor,
            placement,
            slots[0].bundle,
            0,
            [s.gpu for s in slots if s.gpu is not None],
            settings,
            cfg.engine.rollout_checkpoint or cfg.train.hf_checkpoint,  # FP8: given (config.engine)
            cfg.train.seed + e,
            str(log_dir),
            lora,
            runtime_env=no_visible_devices_override,
            max_restarts=-1,
        )
        for e, slots in enumerate(placement.engines)
    ]


def _actor(cls, placement: Placement, bundle: int, gpus: float, *args, **options):
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    strategy = PlacementGroupSchedulingStrategy(placement.group, placement_group_bundle_index=bundle)
    return cls.options(num_cpus=0, num_gpus=gpus, scheduling_strategy=strategy, **options).remote(
        os.getcwd(), list(sys.path), *args
    )


def _start_engines(cfg: Config, placement: Placement, run_dir: Path) -> tuple[list, list[str]]:
    """Start every engine on its devices -> (actors, URLs)."""
    import ray

    actors = engine_actors(placement, cfg, run_dir / "logs")
    started = [actor.start.remote() for actor in actors]
    try:
        urls = ray.get(started)
    except BaseException:
        for actor in actors:
            ray.kill(actor)
        raise
    for e, url in enumerate(urls):
        print(f"placement: engine {e} serves at {url}", flush=True)
    return actors, urls


def _forward_interrupt(ranks: list, stop: StopRequest):
    """The driver's Ctrl-C and SIGTERM handler: the first signal asks rank 0 to stop as under ``torchrun``
    (every rank finishes the step, saves and stops; ``stop`` records which); a second one stops the
    driver at once."""

    def forward(signum, frame):
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        stop.request(signum)
        print(
            f"slime-mt train: {stop.signal_name}: every rank finishes its step, saves and stops",
            file=sys.stderr,
            flush=True,
        )
        ranks[0].request_stop.remote()

    return forward


LOST_PEER_SECONDS = 10.0  # how long a rank's failure waits for news of a lost peer


def _lost_rank_message(cfg: Config, placement: Placement, refs: list, error: Exception) -> str:
    """Which rank was lost, on which node (and whether the node has left the cluster), and how to resume."""
    import ray

    rank = next(r for r, ref in enumerate(refs) if ref == getattr(error, "ref", None))
    slot = placement.trainer[rank]
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    gone = "; the node has left the cluster" if slot.node_id not in alive else ""
    cause = str(error).strip().splitlines()[0].rstrip(".") if str(error).strip() else type(error).__name__
    resume = (
        f"resume from the last checkpoint with --load {cfg.checkpoint.save}"
        if cfg.checkpoint.save
        else "no --save was given, so there is no checkpoint to resume from"
    )
    return (
        f"trainer rank {rank} on node {slot.node_ip} ({slot.node_id[:8]}) was lost ({cause}{gone}); "
        f"the run stops; {resume}"
    )


def _wait_all(refs: list) -> None:
    """Every rank's result; the first failure is raised at once (the caller stops the other ranks)."""
    import ray

    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=1.0)  # a timeout lets Ctrl-C in
        if not done:
            continue
        try:
            ray.get(done[0])  # raises the rank's own exception (RayTaskError wraps it with its traceback)
        except ray.exceptions.RayActorError as e:  # the rank's process (or its node) is gone
            e.ref = done[0]
            raise
        except Exception as first:  # maybe a collective whose peer was lost: name the lost rank instead
            finished, _ = ray.wait(pending, num_returns=len(pending), timeout=LOST_PEER_SECONDS)
            for ref in finished:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    e.ref = ref
                    raise e from first
                except Exception:  # another rank's own error: the first one is raised
                    pass
            raise
