"""``--oldest-groups-first``: the group a request serves, as the engines' schedulers rank it.

The rollout sets ``group_version`` (the weight version its group started under) in the task of each
trajectory; the clients read it when they build a request. Lower versions are older groups, which go
first: SGLang (``--enable-priority-scheduling``) and the embedded engine serve higher priorities first,
so they get the version negated; vLLM (``--scheduling-policy priority``) serves lower values first, so it
gets the version as it is. Outside a rollout, or with the flag off, nothing is set and no request
carries a priority."""

from __future__ import annotations

import contextvars

group_version: contextvars.ContextVar[int | None] = contextvars.ContextVar("slime_mt_group_version", default=None)


def sglang_priority() -> int | None:
    """The ``priority`` field of a request to SGLang or the embedded engine (higher first)."""
    version = group_version.get()
    return None if version is None else -version


def vllm_priority() -> int | None:
    """The ``priority`` field of a request to vLLM (lower first)."""
    return group_version.get()
