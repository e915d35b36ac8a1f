"""Weight updates in the middle of generation: the gate every ``EngineClient`` request leaves through
(``--fully-async``, ``--async``), closed while the engines are paused and their weights change."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Protocol

logger = logging.getLogger(__name__)

DRAIN_SECONDS = 1.0  # the longest an update waits for requests still out after the engines paused
DRAIN_ABORT_INTERVAL = 0.25  # seconds between abort-all calls while it waits


class PausableEngines(Protocol):
    """What the gate needs of the engines' client (``EngineClient`` and its vLLM subclass are such)."""

    async def pause(self, mode: str = "in_place", timeout: float | None = None) -> None: ...

    async def abort(self, rid: str | None = None, abort_all: bool = False) -> None: ...

    async def resume(self, timeout: float | None = None) -> None: ...


class UpdateGate:
    """Weight updates in the middle of generation (``--fully-async``, ``--async``).

    Every request ``EngineClient.generate`` sends leaves the client through the gate: it waits while
    the gate is closed, then for a free connection of the client's pool (``max_connections``), and
    leaves only if the gate is still open. Once an update begins nothing new reaches an engine: a
    request queued for a connection (or retrying after a failure) stays in the client until the gate
    opens again.

    ``close`` (an update begins) closes the gate and pauses every engine with ``mode="abort"``: an
    engine aborts the requests it has admitted (they return at once, finish_reason abort, with the
    tokens generated under the old weights) and answers once none is left; a request that reaches an
    engine after that (a router's extra hop, a request already on the wire) waits at the engine's
    admission, where abort-all does not reach it, until ``/continue_generation`` (SGLang's tokenizer
    manager holds it on its pause condition). ``close`` then waits at most ``drain_seconds`` for the
    requests still out to come back, repeating abort-all for an engine that admitted a late one; the
    requests left out are held at an engine's admission and have generated nothing, so the update
    need not wait for them (``held_by_engines`` counts them). The caller updates the weights; ``open``
    continues the engines, and the held requests then generate from their context under the new
    weights alone, as a turn generated again would.

    So no request generates while weights change, and the ``weight_version`` of every response names
    the weights of all of its tokens. A response that an update aborted carries
    ``meta_info["weight_update_abort"] = True``; the rollout resumes it from its tokens
    (``--partial-rollout``) or generates it again. Methods run on the client's event loop.

    ``followers`` (``--rollout-num-processes``): the gates of the other rollout processes' clients
    (``rollout/rollout_workers.py``), which send to the same engines. ``close`` holds them (closed,
    the update counted, no engine call) before it pauses the engines, waits for their requests as
    for its own, and ``open`` lets them through after the engines continue; an aborted response in
    any process is then read as the update's.
    """

    def __init__(self, drain_seconds: float = DRAIN_SECONDS) -> None:
        self.drain_seconds = drain_seconds
        self._open = asyncio.Event()
        self._open.set()
        self._out = 0  # requests sent to an engine and not back
        self._back = asyncio.Event()
        self._back.set()
        self.updates = 0  # closes so far
        self.held_by_engines = 0  # requests the last close left waiting at an engine's admission
        self.followers = None  # the other rollout processes' gates (--rollout-num-processes)

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    async def wait_open(self) -> None:
        await self._open.wait()

    @contextlib.asynccontextmanager
    async def sending(self, slots: asyncio.Semaphore) -> AsyncIterator[Callable[[], bool]]:
        """One request leaving for an engine: wait for the gate and a connection (``slots``); yields a
        function telling whether an update began while the request was out."""
        while True:
            await self._open.wait()
            await slots.acquire()
            if self._open.is_set():
                break
            slots.release()  # the gate closed while the request waited for a connection: it stays here
        sent_at = self.updates
        self._out += 1
        self._back.clear()
        try:
            yield lambda: self.updates != sent_at
        finally:
            self._out -= 1
            if not self._out:
                self._back.set()
            slots.release()

    def hold(self) -> None:
        """Close the gate and count the update, without calling an engine (a follower's part of ``close``)."""
        self.updates += 1
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    @property
    def out(self) -> int:
        """Requests sent to an engine and not back."""
        return self._out

    async def back(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for every request out to come back -> whether they all did."""
        try:
            await asyncio.wait_for(self._back.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    async def close(self, client: PausableEngines) -> None:
        """Stop requests at the gate (and the followers'), abort and pause the engines, wait (bounded)
        for those still out."""
        self.hold()
        if self.followers is not None:
            await self.followers.hold()
        await client.pause(mode="abort")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_seconds
        while (left := deadline - loop.time()) > 0:
            if await self._all_back(min(DRAIN_ABORT_INTERVAL, left)):
                break
            await client.abort(abort_all=True)
        self.held_by_engines = self._out + (await self.followers.out() if self.followers is not None else 0)
        if self.held_by_engines:
            logger.info(
                "weight update %d: %d requests wait at the engines' admission", self.updates, self.held_by_engines
            )

    async def _all_back(self, timeout: float) -> bool:
        if self.followers is None:
            return await self.back(timeout)
        return all(await asyncio.gather(self.back(timeout), self.followers.back(timeout)))

    async def open(self, client: PausableEngines) -> None:
        """Continue generation on every engine and let the waiting requests through."""
        try:
            await client.resume()
        finally:
            self.release()
            if self.followers is not None:
                await self.followers.release()
