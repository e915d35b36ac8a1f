"""The embedded engine (``engine=local``): an HTTP server speaking SGLang's native API over a
transformers model, with continuous batching (``scheduler.py``).

Endpoints (SGLang names; the deprecated ``/get_*`` aliases too): ``/generate``, ``/health``,
``/health_generate``, ``/model_info``, ``/server_info``, ``/flush_cache``, ``/abort_request``,
``/pause_generation``, ``/continue_generation``, ``/update_weights_from_disk``, and the distributed
path (``/init_weights_update_group``, ``/update_weights_from_distributed``,
``/destroy_weights_update_group``: weights broadcast from trainer rank 0, ``weight_group.py``) and
``/update_weights_from_tensor`` (tensors passed by handle on one node, ``tensor_payload.py``), and LoRA
adapters served by name (``/load_lora_adapter``, ``/unload_lora_adapter``, a request's ``lora_path``: ``lora.py``).

Guarantees, for any input: every request gets an answer; a client error is a 4xx naming the field
(never a 5xx), an engine failure is a 5xx naming the cause and fails only the requests it touched;
bodies are bounded in size and nesting, images in bytes and pixels, and decoded off the event loop;
a weight update is all-or-nothing (the previous weights and ``weight_version`` keep serving after a
failed one); the batch's other requests are aborted when one of a batch fails or the client leaves.

Pausing follows SGLang's tokenizer manager: while paused (any mode), a ``/generate`` that arrives
waits at admission, before the scheduler, where ``/abort_request`` (abort-all included) does not
reach it, and goes on after ``/continue_generation``. ``/pause_generation`` with mode ``abort``
aborts every admitted request and answers once all of them have been answered; ``in_place`` keeps
the running requests where they are. A weight update waits for running requests unless paused
(``Scheduler.update_weights``).

    with LocalEngine(model_path) as engine:      # binds 127.0.0.1, waits for /health
        client = EngineClient(engine.url)
        engine.update_weights_from_tensors(named_tensors, weight_version="1")   # in-process weight sync
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import httpx
import torch
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from slime_mt import __version__
from slime_mt.engine.embedded import lora
from slime_mt.engine.embedded.lora import LoraServing
from slime_mt.engine.embedded.responses import JSON, error, memory_tags, refused
from slime_mt.engine.embedded.runner import ModelRunner
from slime_mt.engine.embedded.scheduler import PAUSE_MODES, Scheduler
from slime_mt.engine.images import MAX_IMAGE_PIXELS, load_image
from slime_mt.engine.protocol import GenerateRequest, SamplingParams, decode_json_body, parse_bool, parse_generate, show
from slime_mt.engine.weights import group as weight_group
from slime_mt.engine.weights import tensor_payload
from slime_mt.errors import EngineAsleep, EngineFault, MemoryBusy, PayloadTooLarge, ProtocolError, WeightUpdateError

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 256 * 1024 * 1024
MAX_REQUEST_PIXELS = 2 * MAX_IMAGE_PIXELS  # all images of one request together
DISCONNECT_POLL_SECONDS = 1.0
PAUSE_POLL_SECONDS = 0.005


class _Unavailable(ProtocolError):
    """The engine cannot serve (its scheduler thread stopped): HTTP 503."""

    status = 503


def _guarded(handler):
    """Every answer of a handler: its own, a 4xx for a ProtocolError (or WeightUpdateError), a 500
    naming the cause for anything else. The server keeps serving either way."""

    @functools.wraps(handler)
    async def wrapped(request: Request):
        try:
            return await handler(request)
        except ProtocolError as e:
            return error(e.status, str(e))
        except WeightUpdateError as e:
            return error(400, str(e))
        except EngineFault as e:
            return error(500, str(e))
        except EngineAsleep as e:
            return error(503, str(e))
        except MemoryBusy as e:
            return error(400, str(e))
        except Exception as e:
            logger.exception("%s %s failed", request.method, request.url.path)
            return error(500, f"{request.url.path} failed in the engine: {type(e).__name__}: {e}")

    return wrapped


async def _json_body(request: Request, required: bool = True, limit: int = MAX_BODY_BYTES) -> dict:
    """The request's JSON object, read up to ``limit`` bytes (413 beyond)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body of {declared} bytes is larger than the {limit} bytes allowed")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body is larger than the {limit} bytes allowed")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw and not required:
        return {}
    return decode_json_body(raw)


def _load_request_images(requests: list[GenerateRequest]) -> None:
    """Decode every request's images in place (runs in a worker thread); a per-request pixel budget
    bounds what many small-but-huge images can cost together."""
    for i, req in enumerate(requests):
        images, pixels = [], 0
        for k, item in enumerate(req.images):
            image = load_image(item, f"image_data[{i}][{k}]")
            pixels += image.width * image.height
            if pixels > MAX_REQUEST_PIXELS:
                raise ProtocolError(
                    f"image_data[{i}]: the images hold more than the {MAX_REQUEST_PIXELS} pixels allowed per request"
                )
            images.append(image)
        req.images = images


class EngineApp:
    """Starlette handlers over one Scheduler."""

    def __init__(self, scheduler: Scheduler, model_path: str):
        self.scheduler = scheduler
        self.runner = scheduler.runner
        self.model_path = model_path
        self._admission = asyncio.Event()  # cleared while paused: /generate waits before the scheduler
        self._admission.set()
        self.held_at_admission = 0  # /generate requests waiting there now
        self.weight_groups: dict[str, object] = {}  # group name -> the process group joined for weights
        routes = [
            Route("/generate", self.generate, methods=["POST", "PUT"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/health_generate", self.health_generate, methods=["GET"]),
            Route("/model_info", self.model_info, methods=["GET"]),
            Route("/get_model_info", self.model_info, methods=["GET"]),
            Route("/server_info", self.server_info, methods=["GET"]),
            Route("/get_server_info", self.server_info, methods=["GET"]),
            Route("/flush_cache", self.flush_cache, methods=["GET", "POST"]),
            Route("/abort_request", self.abort_request, methods=["POST"]),
            Route("/pause_generation", self.pause_generation, methods=["POST"]),
            Route("/continue_generation", self.continue_generation, methods=["POST"]),
            Route("/update_weights_from_disk", self.update_weights_from_disk, methods=["POST"]),
            Route("/get_weight_version", self.weight_version, methods=["GET"]),
            Route("/update_weight_version", self.update_weight_version, methods=["POST"]),
            Route("/init_weights_update_group", self.init_weights_update_group, methods=["POST"]),
            Route("/update_weights_from_distributed", self.update_weights_from_distributed, methods=["POST"]),
            Route("/destroy_weights_update_group", self.destroy_weights_update_group, methods=["POST"]),
            Route("/update_weights_from_tensor", self.update_weights_from_tensor, methods=["POST"]),
            Route("/release_memory_occupation", self.release_memory_occupation, methods=["GET", "POST"]),
            Route("/resume_memory_occupation", self.resume_memory_occupation, methods=["GET", "POST"]),
            Route("/load_lora_adapter", self.load_lora_adapter, methods=["POST"]),
            Route("/unload_lora_adapter", self.unload_lora_adapter, methods=["POST"]),
        ]
        self.app = Starlette(routes=[Route(r.path, _guarded(r.endpoint), methods=r.methods) for r in routes])

    def _require_alive(self) -> None:
        if not self.scheduler.alive:
            raise _Unavailable("the engine is not running (its scheduler thread stopped)")

    async def generate(self, request: Request):
        self._require_alive()
        body = await _json_body(request)
        requests, is_batch = parse_generate(body, self.runner.vocab_size)
        for req in requests:
            self._check_size(req)
            self.runner.adapters.check_request(req.lora)
        if not self._admission.is_set():  # held while paused, as SGLang's is_pause_cond holds it
            self.held_at_admission += 1
            try:
                await self._admission.wait()
            finally:
                self.held_at_admission -= 1
        if any(req.images for req in requests):
            if not self.runner.is_vlm:
                raise ProtocolError(f"image_data given but the served model {self.model_path} is text-only")
            await asyncio.get_running_loop().run_in_executor(None, _load_request_images, requests)
        futures = [self.scheduler.submit(req) for req in requests]
        results = await self._wait(request, futures)
        if results is None:
            return error(499, "client disconnected; its requests were aborted")
        return JSON(results if is_batch else results[0])

    def _check_size(self, req: GenerateRequest) -> None:
        """A prompt that cannot fit the context is refused here, before it is tokenized or queued (a 10 MB
        text would hold the scheduler for a minute): ids past the context (the engine only adds image
        tokens to them), a text of more characters than the context's tokens can stand for."""
        context = self.runner.context_length
        if req.input_ids is not None and len(req.input_ids) >= context:
            raise ProtocolError(
                f"The input ({len(req.input_ids)} tokens) is longer than the model's context length ({context} tokens)."
            )
        most = context * self.runner.max_token_chars
        if req.text is not None and len(req.text) > most:
            raise ProtocolError(
                f"text of {len(req.text)} characters is longer than the model's context length ({context} tokens) can "
                f"hold: at most {most} characters ({self.runner.max_token_chars} per token at the most)"
            )

    async def _wait(self, request: Request, futures: list[Future]) -> list[dict] | None:
        """Every result in order, or raise the first failure in batch order (the others are aborted);
        None when the client disconnected (its requests are aborted)."""
        waiters = [asyncio.wrap_future(f) for f in futures]
        for w in waiters:
            w.add_done_callback(_retrieve)
        pending = set(waiters)
        while pending:
            _, pending = await asyncio.wait(
                pending, timeout=DISCONNECT_POLL_SECONDS, return_when=asyncio.FIRST_EXCEPTION
            )
            failed = next((w for w in waiters if w.done() and (w.cancelled() or w.exception() is not None)), None)
            if failed is not None:
                if pending:
                    self.scheduler.abort_futures(futures, "another request of the same batch failed")
                if failed.cancelled():
                    raise EngineFault("the request was cancelled in the engine")
                raise failed.exception()
            if pending and await request.is_disconnected():
                self.scheduler.abort_futures(futures, "client disconnected")
                return None
        return [w.result() for w in waiters]

    async def health(self, request: Request):
        self._require_alive()
        return PlainTextResponse("")

    async def health_generate(self, request: Request):
        self._require_alive()
        if self.scheduler.paused:
            return PlainTextResponse("")
        probe = GenerateRequest(
            rid=f"health-{time.time_ns()}",
            input_ids=[self._probe_token()],
            text=None,
            images=[],
            sampling=SamplingParams(max_new_tokens=1, temperature=0.0),
        )
        try:
            await asyncio.wait_for(asyncio.wrap_future(self.scheduler.submit(probe)), timeout=60)
        except Exception as e:
            return error(503, f"health generate failed: {type(e).__name__}: {e}")
        return PlainTextResponse("")

    def _probe_token(self) -> int:
        tok = self.runner.tokenizer
        return tok.bos_token_id if tok.bos_token_id is not None else min(self.runner.eos_ids)

    async def model_info(self, request: Request):
        return JSON(
            {
                "model_path": self.model_path,
                "tokenizer_path": self.model_path,
                "is_generation": True,
                "weight_version": self.scheduler.weight_version,
                "has_image_understanding": self.runner.is_vlm,
                "preferred_sampling_params": None,
            }
        )

    async def server_info(self, request: Request):
        return JSON(
            {
                "model_path": self.model_path,
                "engine": "slime_mt.local",
                "version": __version__,
                "context_length": self.runner.context_length,
                "max_running_requests": self.scheduler.max_batch_size,
                "tp_size": 1,  # one device: its rank in a weight group is its rank_offset
                "weight_version": self.scheduler.weight_version,
                "internal_states": [self.scheduler.load()],
                "memory_occupation": self.scheduler.memory(),  # slime_mt's: what release frees
                "image_token_id": self.runner.image_token_id,
                "vocab_size": self.runner.vocab_size,
            }
        )

    async def weight_version(self, request: Request):
        return JSON({"weight_version": self.scheduler.weight_version})

    async def update_weight_version(self, request: Request):
        """SGLang's: the version the engine reports from now on (its weights unchanged; after a LoRA load)."""
        body = await _json_body(request)
        version = body.get("new_version")
        if not isinstance(version, str):
            raise ProtocolError(f"update_weight_version: new_version must be a string, got {show(version)}")
        if parse_bool(body.get("abort_all_requests"), "abort_all_requests"):
            self.scheduler.abort(abort_all=True)
        self.scheduler.weight_version = version
        return JSON({"success": True, "message": f"Weight version updated to {version}", "new_version": version})

    async def flush_cache(self, request: Request):
        if self.scheduler.prefix_cache is not None:
            with self.scheduler.lock:
                self.scheduler.prefix_cache.clear()
        return PlainTextResponse(
            "Cache flushed.\nPlease check backend logs for more details. "
            "(When there are running or waiting requests, the operation will not be performed.)"
        )

    async def abort_request(self, request: Request):
        body = await _json_body(request)
        rid, abort_all = body.get("rid"), parse_bool(body.get("abort_all"), "abort_all")
        if rid is not None and not isinstance(rid, str):
            raise ProtocolError(f"abort_request: rid must be a string, got {show(rid)}")
        if not abort_all and rid is None:
            raise ProtocolError("abort_request needs a string 'rid' or 'abort_all': true")
        count = self.scheduler.abort(rid, abort_all)
        return JSON({"success": True, "aborted": count})

    async def pause_generation(self, request: Request):
        body = await _json_body(request, required=False)
        mode = "abort" if body.get("mode") is None else body["mode"]  # SGLang's default
        if mode not in PAUSE_MODES:  # refused before anything closes: a bad pause changes nothing
            raise ProtocolError(f"pause_generation: mode must be abort, in_place or retract, got {show(mode)}")
        self._admission.clear()
        self.scheduler.pause(mode)
        while self.scheduler.aborting() and self.scheduler.alive:  # SGLang answers once they are all answered
            await asyncio.sleep(PAUSE_POLL_SECONDS)
        return JSON({"success": True, "message": "Generation paused."})

    async def continue_generation(self, request: Request):
        self.scheduler.resume()
        self._admission.set()
        return JSON({"success": True, "message": "Generation continued."})

    async def update_weights_from_disk(self, request: Request):
        body = await _json_body(request)
        path, version = body.get("model_path"), body.get("weight_version")
        if not isinstance(path, str) or not path:
            raise ProtocolError(f"update_weights_from_disk: model_path must be a folder path, got {show(path)}")
        if version is not None and not isinstance(version, str):
            raise ProtocolError(f"update_weights_from_disk: weight_version must be a string, got {show(version)}")
        count = await asyncio.get_running_loop().run_in_executor(
            None, lambda: self.scheduler.update_weights(lambda: self.runner.load_weights_from_disk(path), version)
        )
        return JSON(
            {
                "success": True,
                "message": f"Updated {count} tensors from {path}.",
                "num_paused_requests": 0,
                "weight_version": self.scheduler.weight_version,
            }
        )

    async def init_weights_update_group(self, request: Request):
        """Join the trainer's weight group as rank ``rank_offset`` (SGLang's answer: success and message,
        400 when it cannot)."""
        body = await _json_body(request)
        address, port = body.get("master_address"), body.get("master_port")
        offset, world = body.get("rank_offset"), body.get("world_size")
        name, backend = body.get("group_name", weight_group.GROUP_NAME), body.get("backend", "nccl")
        if not isinstance(address, str) or not address:
            return refused(f"master_address must be a host, got {show(address)}")
        if not all(_is_int(v) for v in (port, offset, world)) or not 1 <= offset < world:
            return refused(
                f"master_port, rank_offset (1 .. world_size-1) and world_size must be integers, got "
                f"{show(port)}, {show(offset)}, {show(world)}"
            )
        if backend not in ("gloo", "nccl") or (backend == "nccl" and self.runner.device.type != "cuda"):
            return refused(f"backend {show(backend)}: this engine serves on {self.runner.device.type}; use gloo")
        if not isinstance(name, str) or name in self.weight_groups:
            return refused(f"group_name {show(name)}: already joined, or not a string")
        join = functools.partial(weight_group.join, backend, address, port, world, offset, name)
        try:
            self.weight_groups[name] = await asyncio.get_running_loop().run_in_executor(None, join)
        except Exception as e:  # the rendezvous timed out or the store was unreachable
            return refused(f"joining {name} at {address}:{port} failed: {type(e).__name__}: {e}")
        return JSON({"success": True, "message": f"joined {name} as rank {offset} of {world}"})

    async def update_weights_from_distributed(self, request: Request):
        """Receive one bucket from rank 0 of the weight group and load it (all or nothing); the version
        and a prefix-cache flush follow as in ``/update_weights_from_disk``."""
        body = await _json_body(request)
        name, version = body.get("group_name", weight_group.GROUP_NAME), body.get("weight_version")
        if name not in self.weight_groups:
            return refused(f"group_name {show(name)}: not joined (call /init_weights_update_group first)")
        if version is not None and not isinstance(version, str):
            return refused(f"weight_version must be a string, got {show(version)}")
        try:
            names, dtypes, shapes = weight_group.check_bucket(body)
        except ValueError as e:
            return refused(f"update_weights_from_distributed: {e}")
        loop = asyncio.get_running_loop()
        receive = functools.partial(
            weight_group.receive, self.weight_groups[name], names, dtypes, shapes, str(self.runner.device)
        )
        return await self._load_received(body, await loop.run_in_executor(None, receive), version, name)

    async def update_weights_from_tensor(self, request: Request):
        """Load named tensors passed by handle from a process on this node (``tensor_payload.py``; this
        engine has one rank, so it reads entry 0), all or nothing; version and cache as for the others."""
        body = await _json_body(request)
        entries, version = body.get("serialized_named_tensors"), body.get("weight_version")
        if not isinstance(entries, list) or not entries or not isinstance(entries[0], (str, bytes)):
            return refused(f"serialized_named_tensors must be a non-empty list of strings, got {show(entries)}")
        if body.get("load_format") not in (None, "direct"):
            return refused(f"load_format {show(body.get('load_format'))}: this engine reads (name, tensor) lists")
        if version is not None and not isinstance(version, str):
            return refused(f"weight_version must be a string, got {show(version)}")
        loop = asyncio.get_running_loop()
        try:
            named = dict(await loop.run_in_executor(None, tensor_payload.deserialize, entries[0]))
        except tensor_payload.PayloadError as e:
            return refused(f"update_weights_from_tensor: {e}")
        return await self._load_received(body, named, version, "handles")

    async def _load_received(self, body: dict, named: dict, version: str | None, source: str) -> JSONResponse:
        """Load tensors a weight call received (all or nothing, once no request runs or paused), after
        aborting everything when the call asks (SGLang's ``abort_all_requests``)."""
        if body.get("abort_all_requests"):
            self.scheduler.abort(abort_all=True)
        load = functools.partial(self.scheduler.update_weights, lambda: self.runner.load_weights(named), version)
        try:
            count = await asyncio.get_running_loop().run_in_executor(None, load)
        except WeightUpdateError as e:
            return refused(str(e))
        return JSON({"success": True, "message": f"Updated {count} tensors from {source}."})

    async def release_memory_occupation(self, request: Request):
        """Free the tagged memory (``weights``, ``kv_cache``; none: all) while the trainer uses the
        device, as SGLang does for colocated RL; 400 while a request is in the engine."""
        tags = memory_tags(await _json_body(request, required=False), "release_memory_occupation")
        await asyncio.get_running_loop().run_in_executor(None, self.scheduler.release_memory, tags)
        return JSON({"success": True, "message": f"released {', '.join(sorted(tags))}"})

    async def resume_memory_occupation(self, request: Request):
        """Take the tagged memory back (none: everything released). Resumed weights hold nothing until
        the next update loads them; the engine serves again once every tag is back and they are loaded."""
        tags = memory_tags(await _json_body(request, required=False), "resume_memory_occupation")
        await asyncio.get_running_loop().run_in_executor(None, self.scheduler.resume_memory, tags)
        return JSON({"success": True, "message": f"resumed {', '.join(sorted(tags))}"})

    async def load_lora_adapter(self, request: Request):
        return await lora.update(self.runner.adapters, self.scheduler, await _json_body(request), load=True)

    async def unload_lora_adapter(self, request: Request):
        return await lora.update(self.runner.adapters, self.scheduler, await _json_body(request), load=False)

    async def destroy_weights_update_group(self, request: Request):
        body = await _json_body(request, required=False)
        name = body.get("group_name", weight_group.GROUP_NAME)
        group = self.weight_groups.pop(name, None) if isinstance(name, str) else None
        if group is None:
            return refused(f"group_name {show(name)}: not joined")
        weight_group.leave(group)
        return JSON({"success": True, "message": f"left {name}"})


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _retrieve(waiter: asyncio.Future) -> None:
    """Mark a waiter's exception as seen (a batch that answered early leaves some behind)."""
    if not waiter.cancelled():
        waiter.exception()


class LocalEngine:
    """An embedded engine server in this process (model + scheduler thread + uvicorn thread)."""

    def __init__(
        self,
        model_path: str | Path,
        host: str = "127.0.0.1",
        port: int = 0,
        max_batch_size: int = 32,
        seed: int = 0,
        weight_version: str = "0",
        dtype: torch.dtype = torch.float32,
        device: str | None = None,
        cache_tokens: int = 0,
        lora: LoraServing | None = None,
    ):
        self.model_path = str(model_path)
        self.lora = lora  # SGLang's --enable-lora and its options (None: no adapters)
        self.host, self.port = host, port
        self.max_batch_size, self.seed, self.dtype = max_batch_size, seed, dtype
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.initial_version = weight_version
        self.cache_tokens = cache_tokens  # the prefix cache's size in tokens (0: off)
        self.scheduler: Scheduler | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._app: EngineApp | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def weight_version(self) -> str:
        return self.scheduler.weight_version

    @property
    def held_at_admission(self) -> int:
        """``/generate`` requests that arrived while paused and wait at admission (no abort reaches them)."""
        return self._app.held_at_admission

    @property
    def alive(self) -> bool:
        """Serving: its HTTP server and its scheduler both run."""
        return self._server is not None and self._thread.is_alive() and self.scheduler.alive

    def start(self, timeout: float = 120.0) -> LocalEngine:
        runner = ModelRunner(self.model_path, dtype=self.dtype, device=self.device)
        if self.lora is not None:
            self.lora.apply(runner.adapters)
        self.scheduler = Scheduler(runner, self.max_batch_size, self.seed, self.initial_version, self.cache_tokens)
        self.scheduler.start()
        self._app = EngineApp(self.scheduler, self.model_path)
        app = self._app.app
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        # "error": the router probes workers with non-HTTP/1 requests that uvicorn would warn about
        config = uvicorn.Config(app, log_level="error", access_log=False, timeout_keep_alive=30)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, daemon=True, name=f"slime-mt-http-{self.port}"
        )
        self._thread.start()
        wait_healthy(self.url, timeout)
        return self

    def update_weights_from_tensors(self, named: dict[str, torch.Tensor], weight_version: str | None = None) -> int:
        """In-process weight sync (trainer and engine in one process): copy HF-named tensors, all or
        nothing (a WeightUpdateError leaves the weights and the version as they were)."""
        return self.scheduler.update_weights(lambda: self.scheduler.runner.load_weights(named), weight_version)

    def update_adapter(self, name: str, config: dict, named: dict[str, torch.Tensor], weight_version: str) -> int:
        """In-process LoRA update: serve ``named`` (PEFT-named) as adapter ``name`` from the next step on, as
        ``weight_version`` (``Scheduler.update_weights``: between steps, once no request runs)."""
        adapters = self.scheduler.runner.adapters
        return self.scheduler.update_weights(lambda: adapters.replace(name, config, named), weight_version)

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=30)
            self._server = None
        if self.scheduler is not None:
            self.scheduler.stop()

    def __enter__(self) -> LocalEngine:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def wait_healthy(url: str, timeout: float = 120.0, path: str = "/health") -> None:
    """Poll ``url + path`` until it answers 200; TimeoutError naming the URL otherwise."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            response = httpx.get(url + path, timeout=5.0)
            if response.status_code == 200:
                return
            last = f"HTTP {response.status_code}"
        except httpx.HTTPError as e:
            last = f"{type(e).__name__}: {e}"
        time.sleep(0.1)
    raise TimeoutError(f"engine at {url} not healthy after {timeout:.0f}s (last: {last})")


def serve(
    model_path: str,
    host: str,
    port: int,
    max_batch_size: int,
    seed: int,
    cache_tokens: int = 0,
    lora: LoraServing | None = None,
) -> None:
    """``slime-mt serve``: run an embedded engine in the foreground until interrupted."""
    engine = LocalEngine(model_path, host, port, max_batch_size, seed, cache_tokens=cache_tokens, lora=lora).start()
    print(f"slime-mt engine serving {model_path} at {engine.url}", flush=True)
    try:
        while engine._thread.is_alive():
            engine._thread.join(timeout=1.0)
    except KeyboardInterrupt:
        pass
    finally:
        engine.stop()
