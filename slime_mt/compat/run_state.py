"""The run's ``SlimeCompat`` while a ``--slime-compat`` run is up (``SlimeCompat.activate`` sets it,
``close`` clears it): what slime's helpers under ``compat/slime/`` reach the run through."""

from __future__ import annotations

from typing import Any

_active: Any = None  # the SlimeCompat of the run


def set_active(compat: Any) -> None:
    global _active
    _active = compat


def clear_active(compat: Any) -> None:
    """Forget ``compat`` if it is the run's (a later run's stays)."""
    global _active
    if _active is compat:
        _active = None


def active() -> Any:
    """The run's compatibility side; slime's helpers need a running run."""
    if _active is None:
        raise RuntimeError(
            "slime's generation helpers (GenerateState, post to the engine) work inside a "
            "'slime-mt train --slime-compat' run, once its engines are up"
        )
    return _active


def current() -> Any:
    """The run's compatibility side, or None outside a run."""
    return _active
