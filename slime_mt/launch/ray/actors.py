"""The Ray actors of a run: one ``TrainerRank`` per Megatron rank, one ``EngineActor`` per engine.

A trainer rank runs exactly what a ``torchrun`` process runs (``trainer.train``: the train loop on
every rank, the rollout side on rank 0), with the process group's rendezvous on rank 0's node
(``MASTER_ADDR``/``MASTER_PORT``; NCCL on GPUs, gloo on CPUs). Ray gives each rank one device through
``CUDA_VISIBLE_DEVICES``, so every rank's local device is 0. An engine actor starts the embedded
engine or an SGLang server on its devices, bound to its node's address, and answers its URL.

Both run in the driver's working directory with its ``sys.path`` (relative paths in flags, plug-ins
by module path): every node needs the same code and files at the same paths, as with slime.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import ray


def enter(cwd: str, paths: list[str]) -> None:
    """Work in the driver's directory with its module path (relative paths and plug-ins resolve there)."""
    os.chdir(cwd)
    for path in reversed(paths):
        if path not in sys.path:
            sys.path.insert(0, path)


def _where() -> dict:
    return {
        "node_ip": ray.util.get_node_ip_address(),
        "node_id": ray.get_runtime_context().get_node_id(),
        "gpus": [int(g) for g in ray.get_gpu_ids()],
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "pid": os.getpid(),
    }


@ray.remote
class TrainerRank:
    def __init__(self, cwd: str, paths: list[str]) -> None:
        enter(cwd, paths)

    def where(self) -> dict:
        return _where()

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0: its node's address and a free port there, for every rank's ``MASTER_ADDR:MASTER_PORT``."""
        from slime_mt.engine.weight_group import free_port

        address = ray.util.get_node_ip_address()
        return address, free_port(address)

    def train(self, cfg, run_dir: str, rank: int, world: int, master: tuple[str, int]) -> None:
        from slime_mt.trainer import train

        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK="0",  # Ray shows each rank only its own device
            MASTER_ADDR=master[0],
            MASTER_PORT=str(master[1]),
        )
        train(cfg, Path(run_dir))


@ray.remote
class EngineActor:
    """One engine on ``devices`` (physical ids on its node; empty on a CPU cluster). The actor holds no
    Ray device of its own: from its start it shows only the engine's devices (``CUDA_VISIBLE_DEVICES``),
    which Ray leaves alone under ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES``."""

    def __init__(self, cwd: str, paths: list[str], devices: list[int]) -> None:
        enter(cwd, paths)
        self.devices = list(devices)
        if self.devices:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in self.devices)
        self.engine = None

    def where(self) -> dict:
        return _where()

    def start(self, engine_cfg, model_path: str, seed: int, log_dir: str) -> str:
        """Start the engine on this actor's devices, bound to its node's address -> its URL."""
        from slime_mt.engine.launch import SGLangServer
        from slime_mt.engine.server import LocalEngine

        host = ray.util.get_node_ip_address()
        if engine_cfg.engine == "local":
            self.engine = LocalEngine(
                model_path,
                host=host,
                max_batch_size=engine_cfg.engine_max_batch_size,
                seed=seed,
                cache_tokens=engine_cfg.engine_cache_tokens,
            ).start()
        else:
            self.engine = SGLangServer(
                model_path,
                Path(log_dir),
                tp_size=max(len(self.devices), 1),
                mem_fraction_static=engine_cfg.sglang_mem_fraction_static,
                extra_args=engine_cfg.sglang_extra_args,
                host=host,
            )
        return self.engine.url

    def stop(self) -> None:
        if self.engine is not None:
            self.engine.stop()
            self.engine = None
