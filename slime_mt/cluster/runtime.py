"""What every process of a run on Ray does to take part: join the cluster (``connect``), work in the
driver's directory with its module path (``enter``), and say where it runs (``location``). The run's
actors (``launch/ray/actors.py``) and the rollout's pools of actors (``rollout/env_workers.py``,
``rollout/rollout_workers.py``) use them."""

from __future__ import annotations

import logging
import os
import sys

import ray


def enter(cwd: str, paths: list[str]) -> None:
    """Work in the driver's directory with its module path (relative paths and plug-ins resolve there)."""
    os.chdir(cwd)
    for path in reversed(paths):
        if path not in sys.path:
            sys.path.insert(0, path)


def connect(address: str | None) -> bool:
    """Join the Ray cluster at ``address`` (None: start a local one) unless this process already is in
    one (a run's actors are) -> whether this call started the connection (``ray.shutdown`` it after).
    Every worker gets this process's working directory and module path."""
    if ray.is_initialized():
        return False
    paths = os.pathsep.join(p for p in [os.getcwd(), *sys.path, os.environ.get("PYTHONPATH", "")] if p)
    ray.init(
        address=address,
        include_dashboard=False,
        runtime_env={"env_vars": {"PYTHONPATH": paths}},
        logging_level=logging.WARNING,
    )
    return True


def location() -> dict:
    """Where the calling actor runs: its node, the devices Ray gave it, its process."""
    return {
        "node_ip": ray.util.get_node_ip_address(),
        "node_id": ray.get_runtime_context().get_node_id(),
        "gpus": [int(g) for g in ray.get_gpu_ids()],
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "pid": os.getpid(),
    }
