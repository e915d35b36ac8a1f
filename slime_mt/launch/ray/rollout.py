"""``--ray``: the rollout role in its own Ray actor (``RolloutActor``), reached by the first trainer rank.

The actor runs the rollout role (engines' client, update gate, data, rollout function or fully-async
manager, environment workers and rollout processes, metrics, records) on the driver's node, where the
run folder is. The first trainer rank's ``RolloutHost`` calls it by RPC (``RemoteRole``) and sends every
rank its share of each step; the exported weights stay on the trainer rank, which sends them to the
engines itself (``RemoteWeights``: its own engine client and the run's transport, so a GPU rank
broadcasts from its device as before), while the actor holds its update gate shut and brings engines
started again into the update. A rollout that raises, or whose actor dies, reaches every rank as
``RolloutRoleFailed`` naming the step; no trainer rank dies of it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import ray

from slime_mt.config import Config
from slime_mt.engine.clients.control import EngineControl
from slime_mt.engine.weights.fp8 import rollout_checkpoint
from slime_mt.engine.weights.sync import EngineWeights, transport_for
from slime_mt.roles.link import RolloutHost
from slime_mt.roles.steps import drain_weights


class RemoteRole:
    """The rollout role's methods (``roles/steps.py``), each a call on its actor: an exception the role
    raised comes back as itself (not Ray's wrapper), so the host names it in one line."""

    def __init__(self, actor) -> None:
        self.actor = actor

    def close(self) -> None:
        try:
            ray.get(self.actor.close.remote())
        except ray.exceptions.RayActorError:  # its process is gone, and what it held with it
            pass

    def __getattr__(self, name: str):
        def call(*args):
            try:
                return ray.get(self.actor.call.remote(name, *args))
            except ray.exceptions.RayTaskError as e:
                raise e.cause from None

        return call


class RemoteWeights:
    """The trainer rank's end of a weight update under ``--ray``: its own engine client on the engines'
    URLs and the run's transport (``--weight-transport``), the actor's update gate shut around it."""

    def __init__(self, role: RemoteRole, cfg: Config, run_dir: Path) -> None:
        e = cfg.engine
        url, worker_urls = role.engine_urls()
        self.role = role
        self.control = EngineControl(e.engine, url, worker_urls, e.engine_request_timeout, e.engine_max_retries)

        def make(urls: list[str]):
            self.control.client.worker_urls = list(urls)  # before the transport reads them; nothing else runs
            return transport_for(e, True, cfg.cluster.colocate, [], self.control, run_dir)

        try:
            quantization = rollout_checkpoint(e, cfg.train.hf_checkpoint, run_dir)[1]  # the folder is given
            self.weights = EngineWeights(make, worker_urls, quantization)
        except BaseException:
            self.control.close()
            raise

    def push(self, stream: Iterator, version: int) -> None:
        plan = self.role.begin_update(version)
        self.weights.push(stream, version, plan, self.gate_closed)
        self.role.end_update(version, plan)

    @contextlib.contextmanager
    def gate_closed(self):
        self.role.close_gate()
        try:
            yield
        finally:
            self.role.open_gate()

    def close(self) -> None:
        try:
            self.weights.close()
        finally:
            self.control.close()


class RemoteHost(RolloutHost):
    """The first rank's ``RolloutHost`` on the rollout role's actor; it also closes its weight sender."""

    def __init__(self, role: RemoteRole, info, split, weights: RemoteWeights | None) -> None:
        super().__init__(role, info, split, push=weights.push if weights is not None else drain_weights)
        self.weights = weights

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self.weights is not None:
                self.weights.close()


def remote_host(actor, cfg: Config, run_dir: Path):
    """``launch.ranks.train``'s ``rollout_host`` for the first rank: ``(info, trainer) -> its end``."""

    def build(info, trainer) -> RemoteHost:
        role = RemoteRole(actor)
        weights = None if cfg.debug.train_only else RemoteWeights(role, cfg, run_dir)  # train-only: no engines
        return RemoteHost(role, info, trainer.splitter(), weights)

    return build
