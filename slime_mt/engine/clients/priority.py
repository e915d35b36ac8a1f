"""Request priorities, as the engines' schedulers rank them: ``--oldest-groups-first`` and an evaluation
beside the rollout (``config.priority_scheduling``).

The rollout sets ``group_version`` (``set_rank``) in the task of each trajectory; the clients read it
when they build a request. Lower ranks go first: under ``--oldest-groups-first`` a group's rank is the
weight version it started under (older groups first), an evaluation's requests rank ``EVALUATION``
(after every training request), and where the engines schedule by priority every other request ranks 0:
SGLang serves a request without a priority after every request with one, as the embedded engine does.
SGLang (``--enable-priority-scheduling``) and the embedded engine serve higher priorities first, so they
get the rank negated; vLLM (``--scheduling-policy priority``) serves lower values first, so it gets the
rank as it is. Outside a rollout, or where the engines do not schedule by priority, nothing is set and no
request carries a priority."""

from __future__ import annotations

import contextvars

group_version: contextvars.ContextVar[int | None] = contextvars.ContextVar("slime_mt_group_version", default=None)
EVALUATION = 2**31 - 1  # the rank of an evaluation's requests: after every training group's


def set_rank(priorities: bool, oldest_first: bool, start_version: int | None, evaluation: bool = False) -> None:
    """This task's requests' rank (``priorities``: the engines schedule by priority; ``oldest_first``:
    ``--oldest-groups-first``; ``start_version``: the version the trajectory's group started under)."""
    if evaluation and priorities:
        group_version.set(EVALUATION)
    elif oldest_first:
        group_version.set(start_version)
    elif priorities:
        group_version.set(0)


def sglang_priority() -> int | None:
    """The ``priority`` field of a request to SGLang or the embedded engine (higher first)."""
    version = group_version.get()
    return None if version is None else -version


def vllm_priority() -> int | None:
    """The ``priority`` field of a request to vLLM (lower first)."""
    return group_version.get()
