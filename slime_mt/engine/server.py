"""The embedded engine (``engine=local``): an HTTP server speaking SGLang's native API over a
transformers model, with continuous batching (``scheduler.py``).

Endpoints (SGLang names; the deprecated ``/get_*`` aliases too): ``/generate``, ``/health``,
``/health_generate``, ``/model_info``, ``/server_info``, ``/flush_cache``, ``/abort_request``,
``/pause_generation``, ``/continue_generation``, ``/update_weights_from_disk``. Malformed requests get
HTTP 400 with a message and the server stays up.

    with LocalEngine(model_path) as engine:      # binds 127.0.0.1, waits for /health
        client = EngineClient(engine.url)
        engine.update_weights_from_tensors(named_tensors)   # in-process weight sync
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from pathlib import Path

import httpx
import torch
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from slime_mt import __version__
from slime_mt.engine.images import load_image
from slime_mt.engine.protocol import ProtocolError, parse_generate
from slime_mt.engine.runner import ModelRunner, WeightUpdateError
from slime_mt.engine.scheduler import Scheduler

logger = logging.getLogger(__name__)


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "code": status}, "object": "error"}, status_code=status)


async def _json_body(request: Request, required: bool = True) -> dict:
    raw = await request.body()
    if not raw:
        if required:
            raise ProtocolError("request body is empty; expected a JSON object")
        return {}
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ProtocolError(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ProtocolError(f"request body must be a JSON object, got {type(body).__name__}")
    return body


class EngineApp:
    """Starlette handlers over one Scheduler."""

    def __init__(self, scheduler: Scheduler, model_path: str):
        self.scheduler = scheduler
        self.runner = scheduler.runner
        self.model_path = model_path
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
        ]
        self.app = Starlette(routes=routes)

    async def generate(self, request: Request):
        try:
            body = await _json_body(request)
            requests, is_batch = parse_generate(body, self.runner.vocab_size)
            for i, req in enumerate(requests):
                req.images = [load_image(img, f"image_data[{i}][{k}]") for k, img in enumerate(req.images)]
        except ProtocolError as e:
            return _error(400, str(e))
        futures = [self.scheduler.submit(req) for req in requests]
        results = []
        for fut in futures:
            try:
                results.append(await asyncio.wrap_future(fut))
            except ProtocolError as e:
                for other in futures:
                    other.cancel()
                return _error(400, str(e))
            except Exception as e:
                return _error(500, f"{type(e).__name__}: {e}")
        return JSONResponse(results if is_batch else results[0])

    async def health(self, request: Request):
        return PlainTextResponse("")

    async def health_generate(self, request: Request):
        from slime_mt.engine.protocol import GenerateRequest, SamplingParams

        probe = GenerateRequest(rid=f"health-{time.time_ns()}", input_ids=[self._probe_token()], text=None, images=[],
                                sampling=SamplingParams(max_new_tokens=1, temperature=0.0))
        if self.scheduler.paused:
            return PlainTextResponse("")
        try:
            await asyncio.wait_for(asyncio.wrap_future(self.scheduler.submit(probe)), timeout=60)
        except Exception as e:
            return _error(503, f"health generate failed: {type(e).__name__}: {e}")
        return PlainTextResponse("")

    def _probe_token(self) -> int:
        tok = self.runner.tokenizer
        return tok.bos_token_id if tok.bos_token_id is not None else min(self.runner.eos_ids)

    async def model_info(self, request: Request):
        return JSONResponse({
            "model_path": self.model_path, "tokenizer_path": self.model_path, "is_generation": True,
            "weight_version": self.scheduler.weight_version, "has_image_understanding": self.runner.is_vlm,
            "preferred_sampling_params": None,
        })

    async def server_info(self, request: Request):
        return JSONResponse({
            "model_path": self.model_path, "engine": "slime_mt.local", "version": __version__,
            "context_length": self.runner.context_length, "max_running_requests": self.scheduler.max_batch_size,
            "weight_version": self.scheduler.weight_version, "internal_states": [self.scheduler.load()],
            "image_token_id": self.runner.image_token_id, "vocab_size": self.runner.vocab_size,
        })

    async def weight_version(self, request: Request):
        return JSONResponse({"weight_version": self.scheduler.weight_version})

    async def flush_cache(self, request: Request):
        return PlainTextResponse("Cache flushed.\nPlease check backend logs for more details. "
                                 "(When there are running or waiting requests, the operation will not be performed.)")

    async def abort_request(self, request: Request):
        try:
            body = await _json_body(request)
        except ProtocolError as e:
            return _error(400, str(e))
        rid, abort_all = body.get("rid"), bool(body.get("abort_all", False))
        if not abort_all and not isinstance(rid, str):
            return _error(400, "abort_request needs a string 'rid' or 'abort_all': true")
        count = self.scheduler.abort(rid, abort_all)
        return JSONResponse({"success": True, "aborted": count})

    async def pause_generation(self, request: Request):
        try:
            body = await _json_body(request, required=False)
            self.scheduler.pause(body.get("mode", "abort"))
        except ProtocolError as e:
            return _error(400, str(e))
        return JSONResponse({"success": True, "message": "Generation paused."})

    async def continue_generation(self, request: Request):
        self.scheduler.resume()
        return JSONResponse({"success": True, "message": "Generation continued."})

    async def update_weights_from_disk(self, request: Request):
        try:
            body = await _json_body(request)
        except ProtocolError as e:
            return _error(400, str(e))
        path = body.get("model_path")
        if not isinstance(path, str) or not Path(path).is_dir():
            return _error(400, f"update_weights_from_disk: model_path {path!r} is not a folder")
        version = body.get("weight_version")
        try:
            count = await asyncio.get_running_loop().run_in_executor(
                None, lambda: update_weights(self.scheduler, lambda: self.runner.load_weights_from_disk(path), version))
        except WeightUpdateError as e:
            return _error(400, str(e))
        return JSONResponse({"success": True, "message": f"Updated {count} tensors from {path}.",
                             "num_paused_requests": 0, "weight_version": self.scheduler.weight_version})


def update_weights(scheduler: Scheduler, load, weight_version: str | None) -> int:
    """Run ``load()`` between decode steps and bump the weight version (``weight_version`` or +1)."""
    with scheduler.lock:
        count = load()
        scheduler.weight_version = weight_version if weight_version is not None else _next_version(scheduler.weight_version)
    return count


def _next_version(version: str) -> str:
    return str(int(version) + 1) if version.isdigit() else version + "+1"


class LocalEngine:
    """An embedded engine server in this process (model + scheduler thread + uvicorn thread)."""

    def __init__(self, model_path: str | Path, host: str = "127.0.0.1", port: int = 0, max_batch_size: int = 32,
                 seed: int = 0, weight_version: str = "0", dtype: torch.dtype = torch.float32):
        self.model_path = str(model_path)
        self.host, self.port = host, port
        self.max_batch_size, self.seed, self.dtype = max_batch_size, seed, dtype
        self.initial_version = weight_version
        self.scheduler: Scheduler | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def weight_version(self) -> str:
        return self.scheduler.weight_version

    def start(self, timeout: float = 120.0) -> LocalEngine:
        runner = ModelRunner(self.model_path, dtype=self.dtype)
        self.scheduler = Scheduler(runner, self.max_batch_size, self.seed, self.initial_version)
        self.scheduler.start()
        app = EngineApp(self.scheduler, self.model_path).app
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        # "error": the router probes workers with non-HTTP/1 requests that uvicorn would warn about
        config = uvicorn.Config(app, log_level="error", access_log=False, timeout_keep_alive=30)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True,
                                        name=f"slime-mt-http-{self.port}")
        self._thread.start()
        wait_healthy(self.url, timeout)
        return self

    def update_weights_from_tensors(self, named: dict[str, torch.Tensor], weight_version: str | None = None) -> int:
        """In-process weight sync (trainer and engine in one process): copy HF-named tensors."""
        return update_weights(self.scheduler, lambda: self.scheduler.runner.load_weights(named), weight_version)

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


def serve(model_path: str, host: str, port: int, max_batch_size: int, seed: int) -> None:
    """``slime-mt serve``: run an embedded engine in the foreground until interrupted."""
    engine = LocalEngine(model_path, host, port, max_batch_size, seed).start()
    print(f"slime-mt engine serving {model_path} at {engine.url}", flush=True)
    try:
        while engine._thread.is_alive():
            engine._thread.join(timeout=1.0)
    except KeyboardInterrupt:
        pass
    finally:
        engine.stop()
