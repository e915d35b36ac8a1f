"""The Ray actors of a run: one ``TrainerRank`` per Megatron rank, one ``EngineActor`` per engine.

A trainer rank runs exactly what a ``torchrun`` process runs (``launch.ranks.train``: the train role on
every rank, the rollout role in rank 0's process), with the process group's rendezvous on rank 0's node
(``MASTER_ADDR``/``MASTER_PORT``; NCCL on GPUs, gloo on CPUs). Ray gives each rank one device through
``CUDA_VISIBLE_DEVICES``, so every rank's local device is 0. An engine actor starts the embedded
engine or an SGLang server on its devices, bound to its node's address, and answers its URL.

Both run in the driver's working directory with its ``sys.path`` (relative paths in flags, plug-ins
by module path): every node needs the same code and files at the same paths, as with slime.
"""

from __future__ import annotations

import os
from pathlib import Path

import ray

from slime_mt.backends.megatron import import_megatron_core
from slime_mt.cluster.runtime import enter, location


@ray.remote(max_concurrency=2)  # ``request_stop`` answers while ``train`` runs
class TrainerRank:
    def __init__(self, cwd: str, paths: list[str]) -> None:
        import threading

        enter(cwd, paths)
        self.stop_requested = threading.Event()

    def request_stop(self) -> None:
        """The driver's Ctrl-C: finish the step, save and stop (rank 0's request reaches every rank)."""
        self.stop_requested.set()

    def where(self) -> dict:
        return location()

    def prepare(self) -> None:
        """Import the trainer (torch, transformers, megatron.core) while the engines start: the run's
        start pays for the slower of the two, not both."""
        import slime_mt.launch.ranks  # noqa: F401
        import slime_mt.launch.ray.rollout  # noqa: F401

        import_megatron_core()

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0: its node's address and a free port there, for every rank's ``MASTER_ADDR:MASTER_PORT``."""
        from slime_mt.engine.weights.group import free_port

        address = ray.util.get_node_ip_address()
        return address, free_port(address)

    def train(self, cfg, run_dir: str, rank: int, world: int, master: tuple[str, int], rollout=None) -> int:
        """``launch.ranks.train`` as rank ``rank`` -> its steps done; rank 0 gets the rollout role's actor
        (``rollout``), which it reaches for every rank."""
        from slime_mt.launch.ranks import train
        from slime_mt.launch.ray.rollout import remote_host

        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK="0",  # Ray shows each rank only its own device
            MASTER_ADDR=master[0],
            MASTER_PORT=str(master[1]),
        )
        host = remote_host(rollout, cfg, Path(run_dir)) if rollout is not None else None
        return train(cfg, Path(run_dir), stop_requested=self.stop_requested, rollout_host=host)


@ray.remote
class RolloutActor:
    """The rollout role (``roles/rollout.py``) in a process of its own, on the driver's node: the first
    trainer rank calls its methods (``launch/ray/rollout.py``), one at a time."""

    def __init__(self, cwd: str, paths: list[str]) -> None:
        enter(cwd, paths)
        self.role = None

    def where(self) -> dict:
        return location()

    def prepare(self) -> None:
        """Import the rollout role (transformers' processing, the rollout machinery) while the engines start."""
        import slime_mt.roles.rollout  # noqa: F401

    def start(self, cfg, run_dir: str, engines: list) -> None:
        """The rollout role of the run (``engines``: the engines' actors, to start again one that dies);
        the trainer rank that holds the weights sends them, so no transport is made here."""
        from slime_mt.roles.rollout import start_role

        self.role = start_role(cfg, Path(run_dir), engines, sends_weights=False)

    def call(self, name: str, *args):
        return getattr(self.role, name)(*args)

    def close(self) -> None:
        if self.role is not None:
            role, self.role = self.role, None
            role.close()


@ray.remote
class EngineActor:
    """One engine on ``devices`` (physical ids on its node; empty on a CPU cluster), with what it serves
    given at birth, so that Ray, restarting the actor after its process died, gives it the same. The
    actor holds no Ray device of its own: from its start it shows only the engine's devices
    (``CUDA_VISIBLE_DEVICES``), which Ray leaves alone under ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES``."""

    def __init__(
        self,
        cwd: str,
        paths: list[str],
        devices: list[int],
        engine_cfg,
        model_path: str,
        seed: int,
        log_dir: str,
        lora=None,
    ) -> None:
        enter(cwd, paths)
        self.devices = list(devices)
        if self.devices:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in self.devices)
        self.engine_cfg, self.model_path, self.seed, self.log_dir = engine_cfg, model_path, seed, log_dir
        self.lora = lora  # a LoRA run's: the embedded engine serves adapters (LoraServing); others take flags
        self.engine = None

    def where(self) -> dict:
        return location()

    def start(self) -> str:
        """Start the engine on this actor's devices, bound to its node's address -> its URL."""
        from slime_mt.engine.embedded.server import LocalEngine
        from slime_mt.engine.launch import SGLangServer, VLLMServer

        host, cfg = ray.util.get_node_ip_address(), self.engine_cfg
        if cfg.engine == "local":
            self.engine = LocalEngine(
                self.model_path,
                host=host,
                max_batch_size=cfg.engine_max_batch_size,
                seed=self.seed,
                cache_tokens=cfg.engine_cache_tokens,
                lora=self.lora,
            ).start()
        elif cfg.engine == "vllm":
            self.engine = VLLMServer(
                self.model_path,
                Path(self.log_dir),
                tp_size=max(len(self.devices), 1),
                extra_args=cfg.vllm_extra_args,
                python=cfg.vllm_python,
                seed=self.seed,
                host=host,
            )
        else:
            self.engine = SGLangServer(
                self.model_path,
                Path(self.log_dir),
                tp_size=max(len(self.devices), 1),
                mem_fraction_static=cfg.sglang_mem_fraction_static,
                extra_args=cfg.sglang_extra_args,
                host=host,
            )
        return self.engine.url

    def serving(self) -> str | None:
        """The URL of the engine this actor runs, or None when it runs none (not started, restarted by
        Ray, or its engine died)."""
        return self.engine.url if self.engine is not None and self.engine.alive else None

    def stop(self) -> None:
        if self.engine is not None:
            self.engine.stop()
            self.engine = None
