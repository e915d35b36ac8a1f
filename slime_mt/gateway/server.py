"""The gateway server: OpenAI Chat Completions and Anthropic Messages per session, on the rollout's
event loop, in front of the run's engine client.

    gateway = await Gateway(ctx, cfg.gateway).start()
    session = gateway.open(sample, sampling_params)
    base_url = gateway.base_url(session)        # http://HOST:PORT/sessions/{sid}/v1
    ...                                          # the harness calls it with the openai / anthropic client
    await gateway.close(session)                 # aborts what is in flight, puts the record on the sample

Endpoints (``{sid}``: an unguessable session id the rollout made):
  POST /sessions/{sid}/v1/chat/completions   (``stream: true``: server-sent events, ``data: [DONE]``)
  POST /sessions/{sid}/v1/messages           (Anthropic; ``stream: true``: its event stream)
  GET  /sessions/{sid}/v1/models
  GET  /health

Security: it listens on 127.0.0.1 unless ``--gateway-host`` says otherwise; beyond loopback every
request needs the API key (``Authorization: Bearer KEY`` or ``x-api-key: KEY``; generated when
``--gateway-api-key`` is unset), and images given as file paths are refused. Sessions exist only while
their agent runs; an unknown or closed one is a 404.

Bounds: bodies up to ``MAX_BODY_BYTES`` (a larger one is read through and dropped before its 413), every
string in them Unicode text (a lone surrogate is a 400 naming the field), text up to
``session.MAX_CHARS_PER_TOKEN`` characters a token of the context budget (refused before tokenizing;
rendering runs in a worker thread, so one huge request does not stall the other sessions), the
message, image, stop and choice counts of ``chat.py``,
``max_tokens`` clamped to the run's limits (reported under ``slime_mt.applied``),
``--gateway-session-concurrency`` requests in flight per session (beyond: 429). A refusal is a 4xx
naming the field; an engine that fails past its retries is a 502; either way the gateway goes on
serving the other sessions.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import secrets
import socket
from pathlib import Path

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from slime_mt.engine.protocol import decode_json_body
from slime_mt.errors import EngineError, EngineRequestError, GatewayError, ProtocolError
from slime_mt.gateway.anthropic import anthropic_events, anthropic_response, parse_anthropic
from slime_mt.gateway.chat import check_text, openai_chunks, openai_response, parse_openai
from slime_mt.gateway.session import Session

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024 * 1024
DRAIN_BYTES = 4 * MAX_BODY_BYTES  # an oversized upload read through (and dropped) before its 413, up to this
OFF_LOOP_BYTES = 1024 * 1024  # bodies from this size are decoded in a worker thread


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _json(data, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


def _openai_error(e: GatewayError) -> Response:
    return _json({"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.status}}, e.status)


def _anthropic_error(e: GatewayError) -> Response:
    kind = {401: "authentication_error", 404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error"}
    return _json(
        {"type": "error", "error": {"type": kind.get(e.status, "invalid_request_error"), "message": e.message}},
        e.status,
    )


class Gateway:
    """One per rollout process, started on its event loop the first time an agent needs it."""

    def __init__(self, ctx, settings, model_name: str = ""):
        self.ctx, self.settings = ctx, settings
        self.model_name = model_name or Path(str(getattr(ctx.args, "hf_checkpoint", "") or "slime_mt")).name
        self.host, self.port = settings.gateway_host, settings.gateway_port
        self.loopback = is_loopback(self.host)
        self.api_key = settings.gateway_api_key or (None if self.loopback else secrets.token_urlsafe(32))
        self.sessions: dict[str, Session] = {}
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task | None = None
        routes = [
            Route("/sessions/{sid}/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/sessions/{sid}/v1/messages", self.messages, methods=["POST"]),
            Route("/sessions/{sid}/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
        ]
        self.app = Starlette(routes=routes)

    # ------------------------------------------------------------ lifecycle

    @property
    def url(self) -> str:
        host = self.host
        if host in ("0.0.0.0", "::", ""):  # listening everywhere: say where harnesses elsewhere reach it
            host = socket.gethostbyname(socket.gethostname())
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}"

    async def start(self) -> Gateway:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="error", access_log=False, lifespan="off", timeout_keep_alive=30)
        self._server = uvicorn.Server(config)
        self._task = asyncio.ensure_future(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
            await asyncio.sleep(0.01)
        logger.info("agent gateway at %s (%s)", self.url, "loopback" if self.loopback else "API key required")
        return self

    async def stop(self) -> None:
        for session in list(self.sessions.values()):
            await self.close(session)
        if self._server is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._task, 10)
            self._server = None

    def open(self, sample, sampling_params: dict) -> Session:
        session = Session(self.ctx, sample, sampling_params, self.settings, self.model_name)
        self.sessions[session.sid] = session
        return session

    def base_url(self, session: Session) -> str:
        """The OpenAI base URL of a session (the Anthropic client's is this without ``/v1``)."""
        return f"{self.url}/sessions/{session.sid}/v1"

    async def close(self, session: Session) -> None:
        """End a session: its requests in flight are cancelled (their engine calls aborted), later ones
        get 404, and its record goes onto the sample."""
        session.closed = True
        self.sessions.pop(session.sid, None)
        for task in list(session.in_flight):
            task.cancel()
        if session.in_flight:
            await asyncio.wait(list(session.in_flight))
        session.finish()

    # ------------------------------------------------------------ handlers

    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("x-api-key", "")
        bearer = request.headers.get("authorization", "")
        if bearer.lower().startswith("bearer "):
            given = given or bearer[7:].strip()
        if not given or not secrets.compare_digest(given.encode(), self.api_key.encode()):
            raise GatewayError(
                401, "a valid API key is required (Authorization: Bearer KEY or x-api-key: KEY)", "authentication_error"
            )

    def _session(self, request: Request) -> Session:
        self._authorize(request)
        session = self.sessions.get(request.path_params["sid"])
        if session is None or session.closed:
            raise GatewayError(
                404, "this session is unknown or closed (sessions live while their agent runs)", "not_found_error"
            )
        return session

    async def _body(self, request: Request) -> dict:
        """The request's JSON object, every string of it Unicode text. A body over ``MAX_BODY_BYTES`` is
        413, answered after the upload is read through (and dropped, up to ``DRAIN_BYTES``): a client
        still sending when the answer comes would often see the connection reset instead."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            await _drain(request, int(declared))
            raise GatewayError(413, f"the body is {declared} bytes; at most {MAX_BODY_BYTES} are accepted")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                await _drain(request, size)
                raise GatewayError(413, f"the body is larger than the {MAX_BODY_BYTES} bytes accepted")
            chunks.append(chunk)
        raw = b"".join(chunks)
        del chunks
        try:
            body = (
                decode_json_body(raw) if len(raw) < OFF_LOOP_BYTES else await asyncio.to_thread(decode_json_body, raw)
            )
        except ProtocolError as e:
            raise GatewayError(400, f"body: {e}") from None
        if not isinstance(body, dict):
            raise GatewayError(400, "body: must be a JSON object")
        check_text(body)
        return body

    async def _complete(self, session: Session, chat):
        if len(session.in_flight) >= self.settings.gateway_session_concurrency:
            raise GatewayError(
                429,
                f"this session already has {len(session.in_flight)} requests in flight "
                f"(--gateway-session-concurrency {self.settings.gateway_session_concurrency})",
                "rate_limit_error",
            )
        task = asyncio.ensure_future(session.complete(chat))
        session.in_flight.add(task)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.cancelled():  # the session closed under it
                raise GatewayError(
                    404, "the session closed while this request was in flight", "not_found_error"
                ) from None
            raise
        except EngineRequestError as e:
            raise GatewayError(400, f"the engine refused the request: {e.message}") from None
        except EngineError as e:
            raise GatewayError(502, f"the engine failed: {e}", "api_error") from None
        finally:
            session.in_flight.discard(task)

    async def _serve(self, request: Request, parse, answer, error) -> Response:
        """A call through one API -> ``answer(request, completion)``, or the error answer in that API's
        format (a bug, the answer's own included, answers 500 and the gateway goes on)."""
        try:
            session = self._session(request)
            chat = parse(await self._body(request), self.loopback)
            return answer(chat, await self._complete(session, chat))
        except GatewayError as e:
            return error(e)
        except Exception as e:
            logger.exception("gateway %s failed", request.url.path)
            return error(GatewayError(500, f"the gateway failed: {type(e).__name__}: {e}", "api_error"))

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, parse_openai, _openai_answer, _openai_error)

    async def messages(self, request: Request) -> Response:
        return await self._serve(request, parse_anthropic, _anthropic_answer, _anthropic_error)

    async def models(self, request: Request) -> Response:
        try:
            self._session(request)
        except GatewayError as e:
            return _openai_error(e)
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "slime_mt"}
        return _json({"object": "list", "data": [model]})

    async def health(self, request: Request) -> Response:
        return Response(b"", status_code=200)


def _openai_answer(chat, completion) -> Response:
    if not chat.stream:
        return _json(openai_response(completion, chat))
    lines = [b"data: " + orjson.dumps(c) + b"\n\n" for c in openai_chunks(completion, chat)]
    return _stream([*lines, b"data: [DONE]\n\n"])


def _anthropic_answer(chat, completion) -> Response:
    if not chat.stream:
        return _json(anthropic_response(completion))
    events = [
        f"event: {name}\n".encode() + b"data: " + orjson.dumps(data) + b"\n\n"
        for name, data in anthropic_events(completion)
    ]
    return _stream(events)


async def _drain(request: Request, seen: int) -> None:
    """Read what is left of an upload and drop it (up to ``DRAIN_BYTES`` in all), so that the 413
    reaches a client that is still sending."""
    if seen > DRAIN_BYTES:
        return
    async for chunk in request.stream():
        seen += len(chunk)
        if seen > DRAIN_BYTES:
            return


def _stream(pieces: list[bytes]) -> StreamingResponse:
    async def send():
        for piece in pieces:
            yield piece

    return StreamingResponse(send(), media_type="text/event-stream", headers={"cache-control": "no-cache"})


async def open_gateway(ctx) -> Gateway:
    """The agent gateway of the rollout context ``ctx``'s process, started on the running loop the first
    time (then shared; ``ctx.close()`` stops it)."""
    if ctx.gateway_lock is None:
        ctx.gateway_lock = asyncio.Lock()
    async with ctx.gateway_lock:
        if ctx.gateway is None:
            ctx.gateway = await Gateway(ctx, ctx.gateway_config).start()
    return ctx.gateway
