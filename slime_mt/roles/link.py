"""How each trainer rank reaches the rollout role: the driver asks the same of every rank, and the
launcher gives each rank its end of the link.

  ``RolloutHost``  the rank that reaches the rollout role (``roles/steps.py``): in its own process, or
                   as a Ray actor's calls under ``--ray``. It asks for each step's shares and sends
                   every rank its own, hands the exported weights on, and sends the log its parts
  ``RolloutPeer``  every other rank: it receives its share, drains its export, and sends what the
                   log needs (its kept log-probs, its trace spans)

Every method is collective: the two ends call it in the same order, so a step's share, the stop
request and the checkpoint's data cursor reach every rank, and a rollout that fails stops every rank
with the same error.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable, Iterator

import torch.distributed as dist

from slime_mt.algo.batching import RankShare
from slime_mt.errors import USER_ERRORS, RolloutFailedError, RolloutRoleFailed
from slime_mt.roles.steps import StepTimes, drain_weights

logger = logging.getLogger(__name__)

FAILURES = (RolloutFailedError, RolloutRoleFailed, *USER_ERRORS)


def gather(obj, info) -> list:
    """Every rank's ``obj`` on rank 0 (a list by rank; None elsewhere)."""
    if info.world_size == 1:
        return [obj]
    out = [None] * info.world_size if info.rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def broadcast(obj, info):
    """Rank 0's ``obj`` on every rank."""
    if info.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def send_shares(shares: list[RankShare] | Exception | None, dp_of_rank: list[int] | None, info):
    """Each rank's share of rank 0's ``shares`` (one per DP rank), sent to it alone: a rank receives and
    unpickles only the groups of its DP rank (its TP peers the same ones), never the whole batch; a
    failed rollout (``RolloutFailedError``, ``RolloutRoleFailed``) goes to every rank in its place.
    -> (this rank's share or the failure, rank 0: the bytes sent, ``train/batch_bytes`` for the whole
    batch and ``train/batch_bytes_per_rank`` for the largest share, when there are other ranks)."""
    failed = isinstance(shares, FAILURES)
    if info.world_size == 1:
        return (shares if failed else shares[0]), {}
    payloads, sent = None, {}
    if info.rank == 0:
        if failed:
            payloads = [pickle.dumps(shares)] * info.world_size
        else:
            pickled = [pickle.dumps(share, protocol=pickle.HIGHEST_PROTOCOL) for share in shares]
            payloads = [pickled[dp] for dp in dp_of_rank]
            sent = {
                "train/batch_bytes": float(sum(len(p) for p in pickled)),
                "train/batch_bytes_per_rank": float(max(len(p) for p in pickled)),
            }
    out = [None]
    dist.scatter_object_list(out, payloads, src=0)
    return pickle.loads(out[0]), sent


class RolloutHost:
    """``role``: the rollout role (``RolloutRole``, ``ReplayRole``) or its Ray actor's calls; ``push``:
    where the exported weights go (the role's ``push_weights``, or under ``--ray`` this rank's
    ``RemoteWeights``, which sends them itself)."""

    def __init__(self, role, info, split: Callable, push: Callable[[Iterator, int], None] | None = None) -> None:
        self.role, self.info, self.split = role, info, split
        self.push = push or role.push_weights
        self.dp_of_rank = gather(info.dp_rank, info)  # the DP rank of every rank, whose share it is sent
        self.sent: dict[str, float] = {}

    def resume(self, step: int, data_state: dict | None) -> None:
        self.role.resume(step, data_state)

    def begin(self, start: int) -> None:
        self.role.begin(start, self.split)

    def next_share(self, step: int) -> RankShare:
        """Generate: the step's batch, split by DP rank, each rank sent its share -> this rank's share.
        The rollout's failure stops every rank: ``RolloutFailedError`` (every sample failed too often)
        and a user's mistake (``USER_ERRORS``: a plug-in returning the wrong shape) as they are, anything
        else it raised as ``RolloutRoleFailed`` naming the role and the step (its traceback in the log)."""
        try:
            shares = self.role.shares(step)
        except USER_ERRORS as e:  # a plug-in's or an input's mistake: one line on every rank
            shares = e
        except Exception as e:
            logger.exception("the rollout role failed at step %d", step)
            cause = str(e).strip().splitlines()[0] if str(e).strip() else ""
            shares = RolloutRoleFailed(f"the rollout role failed at step {step}: {type(e).__name__}: {cause}")
        share, self.sent = send_shares(shares, self.dp_of_rank, self.info)
        if isinstance(share, FAILURES):
            raise share
        return share

    def trained(self, step: int, kept: dict[int, list[float]], keep: bool) -> None:
        """``keep`` (``--save-debug-rollout-data``): every rank's trained log-probs into the step's dump."""
        if keep:
            parts = gather(kept, self.info)
            self.role.trained(step, {i: lp for part in parts for i, lp in part.items()})

    def drain(self) -> float:
        return self.role.drain()

    def push_weights(self, stream: Iterator, version: int) -> None:
        self.push(stream, version)

    def stop_after(self, requested: bool) -> bool:
        """This process's stop request (Ctrl-C, the Ray driver's) -> whether every rank stops after this step."""
        return broadcast(requested, self.info)

    def data_state(self) -> dict | None:
        """The data cursor a checkpoint saves, on every rank."""
        return broadcast(self.role.data_state(), self.info)

    def wake_engines(self) -> None:
        self.role.wake_engines()

    def weights_changed(self, version: int) -> None:
        self.role.weights_changed(version)

    def log_step(self, step: int, times: StepTimes, trace: list[dict]) -> None:
        """Log: the step's metrics and every rank's spans."""
        events = gather(trace, self.info)
        self.role.log_step(step, times, [e for part in events for e in part], self.sent)

    def close(self) -> None:
        self.role.close()


class RolloutPeer:
    """A rank that hosts no rollout: its share arrives, its export drains, its parts of the log are sent."""

    def __init__(self, info) -> None:
        self.info = info
        gather(info.dp_rank, info)

    def resume(self, step: int, data_state: dict | None) -> None:
        pass

    def begin(self, start: int) -> None:
        pass

    def next_share(self, step: int) -> RankShare:
        share, _ = send_shares(None, None, self.info)
        if isinstance(share, FAILURES):
            raise share
        return share

    def trained(self, step: int, kept: dict[int, list[float]], keep: bool) -> None:
        if keep:
            gather(kept, self.info)

    def drain(self) -> float:
        return 0.0

    def push_weights(self, stream: Iterator, version: int) -> None:
        drain_weights(stream, version)  # this rank's shards: nobody here receives them

    def stop_after(self, requested: bool) -> bool:
        return broadcast(requested, self.info)

    def data_state(self) -> dict | None:
        return broadcast(None, self.info)

    def wake_engines(self) -> None:
        pass

    def weights_changed(self, version: int) -> None:
        pass

    def log_step(self, step: int, times: StepTimes, trace: list[dict]) -> None:
        gather(trace, self.info)

    def close(self) -> None:
        pass
