"""slime.utils.async_utils: ``run(coro)`` runs a coroutine on the run's event loop and waits for it."""

from slime_mt.compat.run_state import active


def run(coro):
    return active().ctx.run_sync(coro)
