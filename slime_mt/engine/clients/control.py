"""An engine client on an event loop of its own, for a process that controls the engines without
rolling out: under ``--ray`` the trainer rank that sends the weights (the rollout role, in its own
actor, keeps the client that generates, and the update gate)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any

from slime_mt.engine.clients import client_for


class EngineControl:
    def __init__(self, engine: str, url: str, worker_urls: list[str], timeout: float, max_retries: int) -> None:
        self.client = client_for(engine, url, worker_urls, timeout=timeout, max_retries=max_retries)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="slime-mt-engine-control", daemon=True)
        self._thread.start()

    def run_sync(self, coro) -> Any:
        """Run a coroutine on this loop from synchronous code and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def submit(self, coro) -> concurrent.futures.Future:
        """Start a coroutine on this loop -> its future (do not wait)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        self.run_sync(self.client.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
