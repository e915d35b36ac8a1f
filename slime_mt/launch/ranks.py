"""One trainer rank's process, in one process, under ``torchrun`` or as a Ray actor: its parallel state,
its roles, the driver.

Every rank gets a ``TrainRole`` and its end of the rollout role (``roles/link.py``): the first rank
reaches the rollout role (``RolloutHost``), in its own process by default (``RolloutRole``, or the
saved rollouts of ``--debug-train-only``, ``ReplayRole``), or as its Ray actor under ``--ray``
(``launch/ray/rollout.py`` hands in that end); every other rank gets a ``RolloutPeer``. The driver
then runs the same loop on each.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

from slime_mt.backends.megatron.parallel import destroy_parallel, init_parallel
from slime_mt.config import Config
from slime_mt.driver import run
from slime_mt.roles.link import RolloutHost, RolloutPeer
from slime_mt.roles.train import TrainRole
from slime_mt.run_dir import run_dir_of
from slime_mt.stop import SIGNAL_NAMES, StopRequest, on_stop_signals

logger = logging.getLogger(__name__)

ROLLOUT_HOST = 0  # the rank that reaches the rollout role (and, in one process or torchrun, hosts it)


def train(
    cfg: Config,
    run_dir: Path | None = None,
    stop_requested: threading.Event | None = None,
    rollout_host: Callable[[object, TrainRole], RolloutHost] | None = None,
) -> int:
    """This process's rank of the run -> the steps done when it stopped (``num_rollout`` unless Ctrl-C or
    SIGTERM stopped it early); ``run_dir``: the run folder (default: ``run_dir_of(cfg)``).
    ``stop_requested`` (set by those signals here; ``--ray``: the driver's) acts as Ctrl-C does: the
    first rank's request, shared with every rank after the step's weight export, finishes the step,
    saves and stops. ``rollout_host(info, trainer)`` (``--ray``): the first rank's end of the rollout
    role, instead of hosting it here."""
    t = cfg.train
    info = init_parallel(
        t.tensor_model_parallel_size,
        t.seed,
        t.expert_model_parallel_size,
        t.expert_tensor_parallel_size,
        t.context_parallel_size,
        t.pipeline_model_parallel_size,
    )
    stop_requested = stop_requested or StopRequest()

    def request_stop(signum, frame):
        if isinstance(stop_requested, StopRequest):
            stop_requested.request(signum)
        else:
            stop_requested.set()
        logger.warning("%s: finishing this step, saving, stopping engines", SIGNAL_NAMES.get(signum, signum))

    rollout = None
    try:
        with on_stop_signals(request_stop):
            trainer = TrainRole.build(cfg, info)
            if info.rank != ROLLOUT_HOST:
                rollout = RolloutPeer(info)
            elif rollout_host is not None:
                rollout = rollout_host(info, trainer)
            else:
                from slime_mt.roles.rollout import start_role  # a Ray rank never hosts it: not imported there

                rollout = RolloutHost(start_role(cfg, run_dir or run_dir_of(cfg)), info, trainer.splitter())
            return run(cfg, trainer, rollout, stop_requested)
    finally:
        try:
            if rollout is not None:
                rollout.close()
        finally:
            destroy_parallel()
