"""One async client for every engine that speaks SGLang's native HTTP API (embedded, SGLang, router).

``generate`` posts to ``url`` (an engine or a router) with bounded retries and exponential backoff
on connection errors and HTTP 5xx; a 4xx is never retried and raises ``EngineRequestError`` with the
server's message. Each request carries an ``rid`` so it can be aborted. Control calls (abort, pause,
continue, weight updates, flush) go to every worker URL, because a router does not forward them
(sglang-router answers 404 on ``/abort_request``).

With an ``UpdateGate`` (fully-async training), weights change in the middle of generation without a
request inside an engine while they do: see ``engine/clients/update_gate.py``.

No call outlives its timeout (retries and backoff included): ``generate`` raises
``EngineTimeoutError`` after ``timeout`` seconds plus at most ``ABORT_GRACE`` seconds spent
aborting the request on the engine. Every error names the engine URL that failed; a broadcast names
each worker that failed.

The transport is ``engine/http.py`` (one keep-alive pool per engine, constant work per request) and
JSON goes through orjson: at a node's load (thousands of turns per second from one process, see
``benchmarks/rollout_scale.py``) a general-purpose HTTP client cost more than everything else a turn
does.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import resource
import uuid
import zlib
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import orjson

from slime_mt.engine.clients.priority import sglang_priority
from slime_mt.engine.http import HTTPClient, Response, within
from slime_mt.errors import ConnectError, ConnectionLost, EngineError, EngineRequestError, EngineTimeoutError, HTTPError
from slime_mt.timeline import Timeline, default_lane, maybe_span

if TYPE_CHECKING:
    from slime_mt.engine.clients.update_gate import UpdateGate

logger = logging.getLogger(__name__)

RETRYABLE_ERRORS = (ConnectError, ConnectionLost)
ABORT_GRACE = 2.0  # seconds an abort after a timeout may take, on all workers together


UPDATE_ABORT = "weight_update_abort"  # meta_info key marking a generate that a weight update aborted


def output_of(response: dict) -> tuple[list[int], list[float]]:
    """A ``/generate`` answer's output ids and their log-probs (``meta_info.output_token_logprobs``
    holds ``[logprob, id, text]`` per token); EngineError when the two lengths differ."""
    ids = list(response["output_ids"])
    log_probs = [float(lp) for lp, *_ in response["meta_info"].get("output_token_logprobs", [])]
    if len(log_probs) != len(ids):
        raise EngineError(f"engine returned {len(ids)} tokens but {len(log_probs)} log-probs")
    return ids, log_probs


JOIN_SECONDS = 660.0  # an engine joining the weight group waits up to weight_group.JOIN_TIMEOUT for rank 0
CONTROL_CONNECTIONS = 32  # sockets counted per worker for control calls, which have their own pool
DEFAULT_CONCURRENCY = 512  # /generate requests in flight per worker (slime's --sglang-server-concurrency)


def _header_value(text: str) -> str:
    """A routing name as a header value: printable ASCII only (others become ``_``)."""
    return "".join(c if " " <= c <= "~" else "_" for c in text)


def weight_group_joins(
    master_address: str, master_port: int, tp_sizes: list[int], group_name: str, backend: str
) -> list[dict]:
    """SGLang's ``/init_weights_update_group`` body for each worker: worker i (``tp_sizes[i]`` devices)
    joins as ranks from 1 + sum(tp_sizes[:i]) of 1 + sum(tp_sizes); rank 0 is the caller."""
    return [
        {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": 1 + sum(tp_sizes[:i]),
            "world_size": 1 + sum(tp_sizes),
            "group_name": group_name,
            "backend": backend,
        }
        for i in range(len(tp_sizes))
    ]


class EngineClient:
    """Async client; share one per run (pooled connections). Use as ``async with`` or call close().

    ``/generate`` requests hold one of ``max_connections`` slots while they are out (a request waits
    in the client for a free one, where an update gate can hold it; default 512 per worker, slime's
    ``--sglang-server-concurrency``); control calls have a pool of their own, so a pause or an abort
    never queues behind generation."""

    def __init__(
        self,
        url: str,
        worker_urls: list[str] | None = None,
        timeout: float = 600.0,
        max_retries: int = 3,
        backoff: float = 0.5,
        max_connections: int | None = None,
    ):
        self.gate: UpdateGate | None = None
        self.lora_path: str | None = None  # the adapter every /generate names unless it names its own (a LoRA run's)
        self.timeline: Timeline | None = None  # the process's trace (slime_mt/timeline.py), when it keeps one
        self.url = url.rstrip("/")
        self.worker_urls = [u.rstrip("/") for u in (worker_urls or [self.url])]
        self.timeout = timeout
        self.max_retries = max_retries
        self.backoff = backoff
        self.max_connections = max_connections or DEFAULT_CONCURRENCY * len(self.worker_urls)
        self._client: HTTPClient | None = None
        self._control: HTTPClient | None = None
        self._slots: asyncio.Semaphore | None = None
        _allow_open_files(self.max_connections + CONTROL_CONNECTIONS * len(self.worker_urls))

    @property
    def http(self) -> HTTPClient:
        """The ``/generate`` pool. Created lazily so the client binds to the event loop that first uses it."""
        if self._client is None:
            self._client = HTTPClient()
            self._slots = asyncio.Semaphore(self.max_connections)
        return self._client

    @property
    def control(self) -> HTTPClient:
        """The pool of control calls (pause, continue, abort, weight updates, health, info)."""
        if self._control is None:
            self._control = HTTPClient()
        return self._control

    async def close(self) -> None:
        for client in (self._client, self._control):
            if client is not None:
                client.close()
        self._client = self._control = self._slots = None
        await asyncio.sleep(0)  # the closed connections' callbacks run while the loop does

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
        route: str | None = None,
        **extra: Any,
    ) -> dict:
        """POST /generate for one prompt -> SGLang's response dict (``text``, ``output_ids``, ``meta_info``).
        ``route`` names the trajectory (or gateway session) the request belongs to: clients that pick
        the engine themselves (vLLM's) keep it on one; behind sglang-router it is sent as
        ``X-SMG-Routing-Key``, which the router's ``manual`` policy keeps on one worker (its other
        policies ignore it; cache_aware follows the prefix)."""
        rid = rid or uuid.uuid4().hex
        body: dict[str, Any] = {"rid": rid, "sampling_params": sampling_params or {}, "return_logprob": return_logprob}
        if input_ids is not None:
            body["input_ids"] = input_ids
        if text is not None:
            body["text"] = text
        if image_data:
            body["image_data"] = image_data
        priority = sglang_priority()
        if priority is not None:
            body["priority"] = priority
        if self.lora_path is not None:
            body["lora_path"] = self.lora_path
        body.update(extra)
        header = f"X-SMG-Routing-Key: {_header_value(route)}\r\n" if route else ""
        where = self.url
        if extra.get("return_routed_experts") and self.url not in self.worker_urls:
            # sglang-router (0.3.2 and earlier) drops return_routed_experts and routed_experts_start_len:
            # a request for routes goes to its trajectory's worker directly, always the same one, so the
            # trajectory's prefix stays in that worker's cache
            where = self.worker_urls[zlib.crc32((route or rid).encode()) % len(self.worker_urls)]
        with default_lane(f"route {route}" if route else None):
            return await self._generate(where + "/generate", body, [rid], timeout, header=header)

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
        if self.lora_path is not None:
            body.setdefault("lora_path", self.lora_path)
        rids = [f"{rid}_{i}" for i in range(len(input_ids))]
        return await self._generate(self.url + "/generate", body, rids, timeout)

    async def _generate(
        self,
        where: str,
        body: dict,
        rids: list[str],
        timeout: float | None,
        convert: Callable[[Any], Any] | None = None,
        header: str = "",
        engine: str | None = None,
    ) -> Any:
        """POST ``body`` to ``where`` through the pool and the update gate, with retries, within
        ``timeout`` (time spent waiting at a closed gate before the first attempt not counted) -> the
        answer, through ``convert`` when given (an engine whose answer is not SGLang's); a response an
        update aborted is marked ``UPDATE_ABORT``."""
        if self.gate is not None:
            await self.gate.wait_open()
        http = self.http
        update = {"began": False}
        payload = orjson.dumps(body)

        async def send() -> Response:
            if self.gate is None:
                async with self._slots:
                    return await http.request("POST", where, payload, header)
            async with self.gate.sending(self._slots) as update_began:
                try:
                    return await http.request("POST", where, payload, header)
                finally:
                    update["began"] = update_began()

        limit = timeout or self.timeout
        engine = engine or where.rsplit("/", 1)[0]  # the server (or router) the trace names
        with maybe_span(self.timeline, "generate", "engine", engine=engine, rid=rids[0]) as span:
            if isinstance(body, dict) and body.get("priority") is not None:
                span["priority"] = body["priority"]  # as the engine got it (engine/clients/priority.py)
            try:
                result = await within(self._post_with_retries(where, send), limit)
            except asyncio.TimeoutError:
                await self._abort_within_grace(rids)
                span["error"] = "timeout"
                raise EngineTimeoutError(
                    f"{where}: request {', '.join(rids)} exceeded {limit:.1f}s; aborted on the engine"
                ) from None
            if convert is not None:
                result = convert(result)
            meta = result.get("meta_info", {}) if isinstance(result, dict) else {}
            span.update(
                output_tokens=meta.get("completion_tokens"),
                finish_reason=(meta.get("finish_reason") or {}).get("type"),
                weight_version=meta.get("weight_version"),
            )
        if update["began"]:
            for response in result if isinstance(result, list) else [result]:
                meta = response.get("meta_info", {}) if isinstance(response, dict) else {}
                if (meta.get("finish_reason") or {}).get("type") == "abort":
                    meta[UPDATE_ABORT] = True
        return result

    async def _abort_within_grace(self, rids: list[str]) -> None:
        try:
            await within(asyncio.gather(*(self.abort(rid) for rid in rids)), ABORT_GRACE)
        except asyncio.TimeoutError:
            logger.warning(
                "aborting %s on %s took longer than %.0fs; left running", rids, self.worker_urls, ABORT_GRACE
            )

    async def _post_with_retries(self, where: str, send: Callable[[], Awaitable[Response]], text: bool = False) -> Any:
        """``send()`` with retries on connection errors and 5xx -> the JSON answer (``text``: the body
        as text, for endpoints that answer plain text). Raises EngineRequestError (4xx) or EngineError
        naming ``where``; the caller bounds the total time."""
        last = "no attempt"
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                response = await send()
            except RETRYABLE_ERRORS as e:
                last = f"{type(e).__name__}: {e}"
                logger.warning("engine %s attempt %d failed: %s", where, attempt + 1, last)
                continue
            if response.status >= 500:
                last = f"HTTP {response.status}: {_message(response)}"
                logger.warning("engine %s attempt %d failed: %s", where, attempt + 1, last)
                continue
            if response.status >= 400:
                raise EngineRequestError(where, response.status, _message(response))
            return response.text if text else _json_of(response, where)
        raise EngineError(f"engine {where} failed after {self.max_retries + 1} attempts; last failure: {last}")

    # ------------------------------------------------------------------ control endpoints

    async def _broadcast(
        self,
        path: str,
        body: dict | list[dict] | None = None,
        timeout: float | None = None,
        text: bool = False,
        retry: bool = True,
        urls: list[str] | None = None,
    ) -> list[Any]:
        """POST to every worker (or to ``urls``; concurrently, each bounded by ``timeout``) ``body``, or
        ``body[i]`` to worker i; an error names every worker that failed and why. ``retry`` False: one
        attempt (a weight-group call must not be repeated: the engine may be waiting on the first)."""
        limit = timeout or self.timeout
        urls = urls or self.worker_urls
        bodies = body if isinstance(body, list) else [body or {}] * len(urls)

        async def one(url: str, payload: bytes) -> Any:
            send = functools.partial(self.control.request, "POST", url + path, payload)
            try:
                if not retry:
                    response = await within(send(), limit)
                    if response.status >= 400:
                        raise EngineRequestError(url + path, response.status, _message(response))
                    return _json_of(response, url + path)
                return await within(self._post_with_retries(url + path, send, text), limit)
            except asyncio.TimeoutError:
                raise EngineTimeoutError(f"engine {url}{path} did not answer within {limit:.1f}s") from None
            except HTTPError as e:
                raise EngineError(f"engine {url}{path}: {type(e).__name__}: {e}") from None

        results = await asyncio.gather(
            *(one(u, orjson.dumps(b)) for u, b in zip(urls, bodies, strict=True)), return_exceptions=True
        )
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
        path, body = self._abort_call(rid, abort_all)
        payload = orjson.dumps(body)

        async def one(url: str) -> None:
            try:
                await within(self.control.request("POST", url + path, payload), 10.0)
            except (HTTPError, asyncio.TimeoutError) as e:
                logger.warning("abort on %s failed: %s", url, type(e).__name__ if not str(e) else e)

        await asyncio.gather(*(one(u) for u in self.worker_urls))

    def _abort_call(self, rid: str | None, abort_all: bool) -> tuple[str, dict]:
        """The endpoint and body of an abort (SGLang's ``/abort_request``)."""
        return "/abort_request", {"rid": rid or "", "abort_all": abort_all}

    async def pause(self, mode: str = "in_place", timeout: float | None = None) -> None:
        await self._broadcast("/pause_generation", {"mode": mode}, timeout)

    async def resume(self, timeout: float | None = None) -> None:
        await self._broadcast("/continue_generation", timeout=timeout)

    async def paused(self) -> list[bool]:
        """Whether each worker is paused."""
        return [bool(info["internal_states"][0]["paused"]) for info in await self.server_info()]

    async def flush_cache(self, timeout: float | None = None) -> None:
        """Drop every worker's prefix cache (SGLang answers plain text; 400 while it cannot)."""
        await self._broadcast("/flush_cache", timeout=timeout, text=True)

    async def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None, timeout: float | None = None
    ) -> list[dict]:
        """Every worker loads ``model_path`` (all or nothing on each); sets ``weight_version`` when given.
        Returns once every worker acknowledged the load (SGLang's ``success``); EngineError otherwise."""
        body: dict[str, Any] = {"model_path": model_path}
        if weight_version is not None:
            body["weight_version"] = weight_version
        results = await self._broadcast("/update_weights_from_disk", body, timeout)
        return self._acknowledged(f"/update_weights_from_disk {model_path}", results)

    async def replace_lora_adapter(
        self, name: str, path: str, weight_version: str | None = None, timeout: float | None = None
    ) -> None:
        """Every worker serves the PEFT folder ``path`` as LoRA adapter ``name`` (whatever it served under
        that name unloaded first, as miles does with SGLang, which refuses to load over a loaded name) and,
        when given, reports ``weight_version`` (SGLang's ``/update_weight_version``). EngineError naming a
        worker that refused."""

        async def unload(url: str) -> None:
            try:
                await self._broadcast("/unload_lora_adapter", {"lora_name": name}, timeout, retry=False, urls=[url])
            except EngineRequestError as e:
                if "does not exist" not in str(e):  # nothing of that name there yet: nothing to unload
                    raise

        await asyncio.gather(*(unload(url) for url in self.worker_urls))
        body = {"lora_name": name, "lora_path": path}
        results = await self._broadcast("/load_lora_adapter", body, timeout, retry=False)
        self._acknowledged(f"/load_lora_adapter {name} from {path}", results)
        if weight_version is not None:
            body = {"new_version": weight_version, "abort_all_requests": False}
            self._acknowledged("/update_weight_version", await self._broadcast("/update_weight_version", body, timeout))

    def _acknowledged(self, what: str, results: list[Any]) -> list[dict]:
        """``results`` when every worker answered SGLang's ``success: true``; EngineError naming the others."""
        refused = [(u, r) for u, r in zip(self.worker_urls, results) if not (isinstance(r, dict) and r.get("success"))]
        if refused:
            raise EngineError(
                f"{what} was not acknowledged by " + "; ".join(f"{u}: {str(r)[:300]}" for u, r in refused)
            )
        return results

    async def init_weights_update_group(
        self, master_address: str, master_port: int, tp_sizes: list[int], group_name: str, backend: str
    ) -> None:
        """Every worker joins the weight group whose rank 0 is the caller: worker i (``tp_sizes[i]``
        devices) as ranks from 1 + sum(tp_sizes[:i]). Returns once every worker has joined, so the
        caller joins as rank 0 while this waits."""
        bodies = weight_group_joins(master_address, master_port, tp_sizes, group_name, backend)
        results = await self._broadcast("/init_weights_update_group", bodies, timeout=JOIN_SECONDS, retry=False)
        self._acknowledged(f"/init_weights_update_group {group_name}", results)

    async def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str, weight_version: str
    ) -> None:
        """Every worker receives one bucket that the caller broadcasts as rank 0 (in this order) and loads
        it as ``weight_version``; EngineError naming the workers that refused."""
        body = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "weight_version": weight_version,
            "flush_cache": True,
        }
        results = await self._broadcast("/update_weights_from_distributed", body, retry=False)
        self._acknowledged(f"/update_weights_from_distributed {names[0]}..{names[-1]}", results)

    async def finish_weights_update(self, weight_version: str | None) -> None:
        """After the last bucket of a distributed update (``weight_version``), or after a failed bucket
        (None). SGLang loads each bucket as it arrives and takes its version with it: nothing to do."""

    async def update_weights_from_tensor(self, entries: list[list[str]], weight_version: str) -> None:
        """Worker i loads ``entries[i]`` (one serialized list of named tensors per tensor-parallel rank,
        ``tensor_payload.serialize``) as ``weight_version``; EngineError naming the workers that refused."""
        bodies = [
            {"serialized_named_tensors": e, "load_format": None, "flush_cache": True, "weight_version": weight_version}
            for e in entries
        ]
        results = await self._broadcast("/update_weights_from_tensor", bodies, retry=False)
        self._acknowledged("/update_weights_from_tensor", results)

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Every worker frees the tagged memory (``weights``, ``kv_cache``; None: all) for the trainer
        sharing its device (colocated); refused while a request is in an engine."""
        await self._broadcast("/release_memory_occupation", {"tags": tags}, timeout=300.0, retry=False)

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Every worker takes the tagged memory back (None: all it released)."""
        await self._broadcast("/resume_memory_occupation", {"tags": tags}, timeout=300.0, retry=False)

    async def destroy_weights_update_group(self, group_name: str) -> None:
        await self._broadcast("/destroy_weights_update_group", {"group_name": group_name}, timeout=60.0, retry=False)

    async def _get(self, url: str, path: str) -> Any:
        try:
            response = await within(self.control.request("GET", url + path), 30.0)
        except (HTTPError, asyncio.TimeoutError) as e:
            raise EngineError(f"engine {url}{path} did not answer: {type(e).__name__}: {e}") from None
        if response.status >= 400:
            raise EngineError(f"engine {url}{path}: HTTP {response.status}: {_message(response)}")
        return _json_of(response, url + path)

    async def health(self) -> bool:
        return all(await asyncio.gather(*(self._answers(u + "/health", 5.0) for u in self.worker_urls)))

    async def health_generate(self) -> bool:
        return all(await asyncio.gather(*(self._answers(u + "/health_generate", 60.0) for u in self.worker_urls)))

    async def _answers(self, url: str, timeout: float) -> bool:
        try:
            return (await within(self.control.request("GET", url), timeout)).status == 200
        except (HTTPError, asyncio.TimeoutError):
            return False

    async def model_info(self) -> dict:
        return await self._get(self.worker_urls[0], "/model_info")

    async def server_info(self) -> list[dict]:
        return [await self._get(u, "/server_info") for u in self.worker_urls]


def _json_of(response: Response, where: str) -> Any:
    if not response.body:
        return {}
    try:
        return orjson.loads(response.body)
    except orjson.JSONDecodeError:
        raise EngineError(
            f"engine {where} answered HTTP {response.status} with a body that is not JSON: {response.text[:200]!r}"
        ) from None


def _message(response: Response) -> str:
    try:
        data = orjson.loads(response.body)
    except orjson.JSONDecodeError:
        return response.text[:500] or response.reason
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict):
            return str(error.get("message", error))
        return str(error or data.get("message") or data)
    return str(data)[:500]


def _allow_open_files(needed: int) -> None:
    """Raise the soft limit on open files toward the hard one when the connections need more (each
    request in flight holds a socket; a rollout at a node's load keeps thousands)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = needed + 1024  # and what else the process opens
    if soft != resource.RLIM_INFINITY and soft < wanted:
        new = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        if new < wanted:
            logger.warning(
                "open files are limited to %d (ulimit -n); %d connections to engines need about %d", new, needed, wanted
            )
