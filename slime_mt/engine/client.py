"""One async client for every engine that speaks SGLang's native HTTP API (embedded, SGLang, router).

``generate`` posts to ``url`` (an engine or a router) with bounded retries and exponential backoff
on connection errors and HTTP 5xx; a 4xx is never retried and raises ``EngineRequestError`` with the
server's message. Each request carries an ``rid`` so it can be aborted. Control calls (abort, pause,
continue, weight updates, flush) go to every worker URL, because a router does not forward them
(sglang-router answers 404 on ``/abort_request``).

With an ``UpdateGate`` (fully-async training), weights change in the middle of generation without a
request inside an engine while they do: see ``UpdateGate``.

No call outlives its timeout (retries and backoff included): ``generate`` raises
``EngineTimeoutError`` after ``timeout`` seconds plus at most ``ABORT_GRACE`` seconds spent
aborting the request on the engine. Every error names the engine URL that failed; a broadcast names
each worker that failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx

logger = logging.getLogger(__name__)

RETRYABLE_ERRORS = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.ReadError,
    httpx.WriteError,
    httpx.RemoteProtocolError,
    httpx.PoolTimeout,
)
ABORT_GRACE = 2.0  # seconds an abort after a timeout may take, on all workers together


class EngineError(RuntimeError):
    """An engine that could not answer within the retry budget; names the URL and the last failure."""


class EngineRequestError(EngineError):
    """The engine rejected the request (HTTP 4xx): the request is wrong, retrying cannot help."""

    def __init__(self, url: str, status: int, message: str):
        super().__init__(f"{url}: HTTP {status}: {message}")
        self.status = status
        self.message = message


class EngineTimeoutError(EngineError):
    """A request that took longer than its timeout (a generate is aborted on the engine)."""


UPDATE_ABORT = "weight_update_abort"  # meta_info key marking a generate that a weight update aborted
DRAIN_ABORT_INTERVAL = 0.5  # seconds between abort-all calls while an update waits for requests to return


class UpdateGate:
    """Weight updates in the middle of generation (``--fully-async``).

    Every ``EngineClient.generate`` passes the gate. ``close`` stops new calls at the gate, pauses
    the engines with ``mode="abort"`` (requests in flight return at once, finish_reason abort, with
    the tokens they generated under the old weights) and waits until every call in flight has
    returned; the caller updates the weights, then ``open`` continues generation and lets the waiting
    calls through. So no request is inside an engine while its weights change, and the
    ``weight_version`` of every response names the weights that generated all of its tokens. A
    response that an update aborted carries ``meta_info["weight_update_abort"] = True``; the rollout
    resumes it from its tokens (``--partial-rollout``) or generates it again.
    Its methods run on the client's event loop.
    """

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._in_flight = 0
        self._drained = asyncio.Event()
        self._drained.set()
        self.updates = 0  # closes so far

    @contextlib.asynccontextmanager
    async def passage(self) -> AsyncIterator[Callable[[], bool]]:
        """Wait while the gate is closed, then hold a place until the call returns; yields a function
        telling whether an update began since the call passed."""
        while not self._open.is_set():
            await self._open.wait()
        passed = self.updates
        self._in_flight += 1
        self._drained.clear()
        try:
            yield lambda: self.updates != passed
        finally:
            self._in_flight -= 1
            if not self._in_flight:
                self._drained.set()

    async def close(self, client: EngineClient) -> None:
        """Stop new calls, abort the engines' requests and pause them, wait for every call to return."""
        self.updates += 1
        self._open.clear()
        await client.pause(mode="abort")
        while not self._drained.is_set():  # a request that reached an engine after the pause waits there
            try:
                await asyncio.wait_for(self._drained.wait(), DRAIN_ABORT_INTERVAL)
            except asyncio.TimeoutError:
                await client.abort(abort_all=True)

    async def open(self, client: EngineClient) -> None:
        """Continue generation on every engine and let the waiting calls through."""
        try:
            await client.resume()
        finally:
            self._open.set()


class EngineClient:
    """Async client; share one per run (pooled connections). Use as ``async with`` or call close()."""

    def __init__(
        self,
        url: str,
        worker_urls: list[str] | None = None,
        timeout: float = 600.0,
        max_retries: int = 3,
        backoff: float = 0.5,
        max_connections: int = 256,
    ):
        self.gate: UpdateGate | None = None
        self.url = url.rstrip("/")
        self.worker_urls = [u.rstrip("/") for u in (worker_urls or [self.url])]
        self.timeout = timeout
        self.max_retries = max_retries
        self.backoff = backoff
        self._limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._client: httpx.AsyncClient | None = None

    @property
    def http(self) -> httpx.AsyncClient:
        # Created lazily so the client binds to the event loop that first uses it.
        if self._client is None:
            self._client = httpx.AsyncClient(limits=self._limits, timeout=httpx.Timeout(self.timeout, connect=10.0))
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ------------------------------------------------------------------ generation

    async def generate(
        self,
        input_ids: list[int] | None = None,
        sampling_params: dict | None = None,
        image_data: list[str] | None = None,
        text: str | None = None,
        return_logprob: bool = True,
        rid: str | None = None,
        timeout: float | None = None,
        **extra: Any,
    ) -> dict:
        """POST /generate for one prompt -> SGLang's response dict (``text``, ``output_ids``, ``meta_info``)."""
        rid = rid or uuid.uuid4().hex
        body: dict[str, Any] = {"rid": rid, "sampling_params": sampling_params or {}, "return_logprob": return_logprob}
        if input_ids is not None:
            body["input_ids"] = input_ids
        if text is not None:
            body["text"] = text
        if image_data:
            body["image_data"] = image_data
        body.update(extra)
        return await self._generate(body, [rid], timeout)

    async def generate_batch(
        self,
        input_ids: list[list[int]],
        sampling_params: dict | None = None,
        return_logprob: bool = True,
        timeout: float | None = None,
        **extra: Any,
    ) -> list[dict]:
        """POST /generate with a batch of prompts -> a list of responses (SGLang's batch form). The
        batch's ``rid`` is a prefix: item i is ``{rid}_{i}`` (a list of rids is not accepted by
        sglang-router)."""
        rid = extra.pop("rid", None) or uuid.uuid4().hex
        body = {
            "input_ids": input_ids,
            "sampling_params": sampling_params or {},
            "return_logprob": return_logprob,
            "rid": rid,
            **extra,
        }
        return await self._generate(body, [f"{rid}_{i}" for i in range(len(input_ids))], timeout)

    async def _generate(self, body: dict, rids: list[str], timeout: float | None) -> Any:
        if self.gate is None:
            return await self._generate_now(body, rids, timeout)
        async with self.gate.passage() as interrupted:
            result = await self._generate_now(body, rids, timeout)
            if interrupted():
                for response in result if isinstance(result, list) else [result]:
                    meta = response.get("meta_info", {}) if isinstance(response, dict) else {}
                    if (meta.get("finish_reason") or {}).get("type") == "abort":
                        meta[UPDATE_ABORT] = True
            return result

    async def _generate_now(self, body: dict, rids: list[str], timeout: float | None) -> Any:
        limit = timeout or self.timeout
        try:
            return await asyncio.wait_for(self._post_with_retries(self.url, "/generate", body), limit)
        except asyncio.TimeoutError:
            await self._abort_within_grace(rids)
            raise EngineTimeoutError(
                f"{self.url}/generate: request {', '.join(rids)} exceeded {limit:.1f}s; aborted on the engine"
            ) from None

    async def _abort_within_grace(self, rids: list[str]) -> None:
        try:
            await asyncio.wait_for(asyncio.gather(*(self.abort(rid) for rid in rids)), ABORT_GRACE)
        except asyncio.TimeoutError:
            logger.warning(
                "aborting %s on %s took longer than %.0fs; left running", rids, self.worker_urls, ABORT_GRACE
            )

    async def _post_with_retries(self, base: str, path: str, body: dict, text: bool = False) -> Any:
        """POST with retries on connection errors and 5xx -> the JSON answer (``text``: the body as
        text, for endpoints that answer plain text). Raises EngineRequestError (4xx) or EngineError
        naming ``base + path``; the caller bounds the total time."""
        last = "no attempt"
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                response = await self.http.post(base + path, json=body)
            except RETRYABLE_ERRORS as e:
                last = f"{type(e).__name__}: {e}"
                logger.warning("engine %s%s attempt %d failed: %s", base, path, attempt + 1, last)
                continue
            except httpx.TimeoutException as e:
                raise EngineTimeoutError(f"engine {base}{path} did not answer: {type(e).__name__}: {e}") from None
            except httpx.HTTPError as e:
                raise EngineError(f"engine {base}{path} cannot be reached: {type(e).__name__}: {e}") from None
            if response.status_code >= 500:
                last = f"HTTP {response.status_code}: {_message(response)}"
                logger.warning("engine %s%s attempt %d failed: %s", base, path, attempt + 1, last)
                continue
            if response.status_code >= 400:
                raise EngineRequestError(base + path, response.status_code, _message(response))
            return response.text if text else _json_of(response, base + path)
        raise EngineError(f"engine {base}{path} failed after {self.max_retries + 1} attempts; last failure: {last}")

    # ------------------------------------------------------------------ control endpoints

    async def _broadcast(
        self, path: str, body: dict | None = None, timeout: float | None = None, text: bool = False
    ) -> list[Any]:
        """POST to every worker (concurrently, each bounded by ``timeout``); an error names every
        worker that failed and why."""
        limit = timeout or self.timeout

        async def one(url: str) -> Any:
            try:
                return await asyncio.wait_for(self._post_with_retries(url, path, body or {}, text), limit)
            except asyncio.TimeoutError:
                raise EngineTimeoutError(f"engine {url}{path} did not answer within {limit:.1f}s") from None

        results = await asyncio.gather(*(one(u) for u in self.worker_urls), return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            if len(failures) == 1 and len(results) == 1:
                raise failures[0]
            raise EngineError(
                f"{path} failed on {len(failures)} of {len(results)} engines: " + "; ".join(str(f) for f in failures)
            )
        return list(results)

    async def abort(self, rid: str | None = None, abort_all: bool = False) -> None:
        """Abort one request (``rid``) or everything on every worker; errors are logged, not raised."""
        body = {"rid": rid or "", "abort_all": abort_all}

        async def one(url: str) -> None:
            try:
                await self.http.post(url + "/abort_request", json=body, timeout=10.0)
            except httpx.HTTPError as e:
                logger.warning("abort on %s failed: %s", url, e)

        await asyncio.gather(*(one(u) for u in self.worker_urls))

    async def pause(self, mode: str = "in_place", timeout: float | None = None) -> None:
        await self._broadcast("/pause_generation", {"mode": mode}, timeout)

    async def resume(self, timeout: float | None = None) -> None:
        await self._broadcast("/continue_generation", timeout=timeout)

    async def flush_cache(self, timeout: float | None = None) -> None:
        """Drop every worker's prefix cache (SGLang answers plain text; 400 while it cannot)."""
        await self._broadcast("/flush_cache", timeout=timeout, text=True)

    async def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None, timeout: float | None = None
    ) -> list[dict]:
        """Every worker loads ``model_path`` (all or nothing on each); sets ``weight_version`` when given."""
        body: dict[str, Any] = {"model_path": model_path}
        if weight_version is not None:
            body["weight_version"] = weight_version
        return await self._broadcast("/update_weights_from_disk", body, timeout)

    async def _get(self, url: str, path: str) -> Any:
        try:
            response = await self.http.get(url + path, timeout=30.0)
        except httpx.HTTPError as e:
            raise EngineError(f"engine {url}{path} did not answer: {type(e).__name__}: {e}") from None
        if response.status_code >= 400:
            raise EngineError(f"engine {url}{path}: HTTP {response.status_code}: {_message(response)}")
        return _json_of(response, url + path)

    async def health(self) -> bool:
        return all(await asyncio.gather(*(self._answers(u + "/health", 5.0) for u in self.worker_urls)))

    async def health_generate(self) -> bool:
        return all(await asyncio.gather(*(self._answers(u + "/health_generate", 60.0) for u in self.worker_urls)))

    async def _answers(self, url: str, timeout: float) -> bool:
        try:
            return (await self.http.get(url, timeout=timeout)).status_code == 200
        except httpx.HTTPError:
            return False

    async def model_info(self) -> dict:
        return await self._get(self.worker_urls[0], "/model_info")

    async def server_info(self) -> list[dict]:
        return [await self._get(u, "/server_info") for u in self.worker_urls]


def _json_of(response: httpx.Response, where: str) -> Any:
    if not response.content:
        return {}
    try:
        return response.json()
    except ValueError:
        raise EngineError(
            f"engine {where} answered HTTP {response.status_code} with a body that is not JSON: {response.text[:200]!r}"
        ) from None


def _message(response: httpx.Response) -> str:
    try:
        data = response.json()
    except ValueError:
        return response.text[:500] or response.reason_phrase
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict):
            return str(error.get("message", error))
        return str(error or data.get("message") or data)
    return str(data)[:500]
