"""The engine client's HTTP/1.1 transport: one keep-alive pool per engine, constant work per request.

A rollout process keeps thousands of requests in flight against a few engines. General-purpose
clients spend time per request that grows with the requests in flight (httpcore walks every pooled
connection to place each one) or in layers an engine call does not need (cookies, redirects, proxy
resolution, header objects). This transport does one thing: a request with a bytes body to an
``http://`` or ``https://`` origin, on a connection taken from that origin's idle stack (the most
recently used first) or opened for it, its answer parsed from the socket's bytes as they arrive
(``Content-Length``, chunked, or until the server closes). Taking and returning a connection is
O(1); a connection the server closed while idle leaves the stack when it closes.

Errors are ``ConnectError`` (nothing sent: the connection could not be opened within
``connect_timeout``) and ``ConnectionLost`` (the connection closed or broke before the whole answer
came); a request on a reused connection that closes before any byte of the answer is sent once more
on another (the server closed it idle as the request left, and never read it); each such retry
takes a different pooled connection, and one newly opened is never retried here. A cancelled
request closes its connection, so the server sees the client go (SGLang aborts a request whose client
disconnected). Engine calls go straight to the engine: no proxy from the environment is used.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from dataclasses import dataclass
from urllib.parse import urlsplit

from slime_mt.errors import ConnectError, ConnectionLost

CONNECT_TIMEOUT = 10.0


async def within(awaitable, seconds: float | None):
    """``awaitable`` bounded by ``seconds`` (None: unbounded) -> its result; ``asyncio.TimeoutError``
    past the bound. Unlike ``asyncio.wait_for`` before Python 3.12, a cancellation that arrives as the
    awaitable finishes is never lost (an episode cancelled then would run on), and no task is made
    (Python 3.11+)."""
    if hasattr(asyncio, "timeout"):
        async with asyncio.timeout(seconds):
            return await awaitable
    task = asyncio.ensure_future(awaitable)  # Python 3.10
    try:
        done, _ = await asyncio.wait({task}, timeout=seconds)
    except asyncio.CancelledError:
        task.cancel()
        await asyncio.wait({task})
        raise
    if not done:
        task.cancel()
        await asyncio.wait({task})
        raise asyncio.TimeoutError
    return task.result()


@dataclass
class Response:
    status: int
    reason: str
    headers: dict[str, str]  # names lower-cased; a repeated header keeps its last value
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")


def split_url(url: str) -> tuple[tuple[str, str, int], str]:
    """``http://host:port/path?q`` -> ((scheme, host, port), "/path?q")."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http:// or https:// URL")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return (parts.scheme, parts.hostname, port), path


class _Connection(asyncio.Protocol):
    """One keep-alive connection: at most one request at a time (no pipelining)."""

    def __init__(self, pool: Pool):
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.used = False  # has carried a request before the current one
        self._waiter: asyncio.Future | None = None
        self._buffer = bytearray()
        self._reset()

    def _reset(self) -> None:
        """The state of one answer, cleared before each request."""
        self._buffer.clear()
        self._got_bytes = False
        self._head: tuple[int, str, dict[str, str]] | None = None
        self._keep_alive = False
        self._length: int | None = None  # body length; None: chunked or until close
        self._chunked = False
        self._chunks: list[bytes] = []

    # -- protocol callbacks

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self._waiter is None:  # bytes nobody asked for: the connection cannot be trusted
            self.close()
            return
        self._got_bytes = True
        self._buffer += data
        try:
            self._parse()
        except ConnectionLost as e:
            self._fail(e)
            self.close()

    def eof_received(self) -> bool:
        if self._waiter is not None and self._head is not None and self._length is None and not self._chunked:
            self._finish(bytes(self._buffer), keep_alive=False)  # a body that ends when the server closes
        return False  # close the transport

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.pool._forget(self)
        self._fail(ConnectionLost(f"connection closed{f': {exc}' if exc else ''}"))

    # -- requests

    def send(self, data: bytes) -> asyncio.Future:
        self._waiter = asyncio.get_running_loop().create_future()
        self._reset()
        self.transport.write(data)
        return self._waiter

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.pool._forget(self)
            if self.transport is not None:
                self.transport.close()

    def _fail(self, error: ConnectionLost) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            error.before_answer = not self._got_bytes
            waiter.set_exception(error)

    def _finish(self, body: bytes, keep_alive: bool) -> None:
        status, reason, headers = self._head
        waiter, self._waiter = self._waiter, None
        if not keep_alive:
            self.close()
        if waiter is not None and not waiter.done():
            waiter.set_result((Response(status, reason, headers, body), keep_alive))

    def _parse(self) -> None:
        buffer = self._buffer
        while self._head is None:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(buffer) > 1 << 20:
                    raise ConnectionLost("response head over 1 MiB")
                return
            lines = bytes(buffer[:end]).decode("latin-1").split("\r\n")
            del buffer[: end + 4]
            version, _, rest = lines[0].partition(" ")
            code, _, reason = rest.partition(" ")
            if not version.startswith("HTTP/1.") or not code.isdigit():
                raise ConnectionLost(f"not an HTTP/1.x response: {lines[0][:100]!r}")
            status = int(code)
            if 100 <= status < 200:  # an interim answer: the real one follows
                continue
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            self._head = (status, reason, headers)
            self._keep_alive = version == "HTTP/1.1" and headers.get("connection", "").lower() != "close"
            if "chunked" in headers.get("transfer-encoding", "").lower():
                self._chunked = True
            elif "content-length" in headers:
                try:
                    self._length = int(headers["content-length"])
                except ValueError:
                    raise ConnectionLost(f"bad content-length {headers['content-length']!r}") from None
            elif status in (204, 304):
                self._length = 0
            else:
                self._keep_alive = False  # the body ends when the server closes
        if self._length is not None:
            if len(buffer) >= self._length:
                body = bytes(buffer[: self._length])
                del buffer[: self._length]
                self._finish(body, self._keep_alive and not buffer)
        elif self._chunked:
            self._parse_chunks()

    def _parse_chunks(self) -> None:
        buffer = self._buffer
        while True:
            end = buffer.find(b"\r\n")
            if end < 0:
                return
            size_text = bytes(buffer[:end]).split(b";")[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise ConnectionLost(f"bad chunk size {size_text[:20]!r}") from None
            if size == 0:
                trailer_end = buffer.find(b"\r\n\r\n", end)
                if trailer_end < 0 and buffer[end : end + 4] != b"\r\n\r\n":
                    return
                del buffer[: (trailer_end if trailer_end >= 0 else end) + 4]
                self._finish(b"".join(self._chunks), self._keep_alive and not buffer)
                return
            if len(buffer) < end + 2 + size + 2:
                return
            self._chunks.append(bytes(buffer[end + 2 : end + 2 + size]))
            del buffer[: end + 2 + size + 2]


class Pool:
    """Keep-alive connections to one origin: an idle stack, most recently used on top. How many
    requests run at once is the caller's to bound (``EngineClient`` holds a semaphore)."""

    def __init__(self, origin: tuple[str, str, int], connect_timeout: float = CONNECT_TIMEOUT):
        self.scheme, self.host, self.port = origin
        self.connect_timeout = connect_timeout
        self._idle: collections.OrderedDict[_Connection, None] = collections.OrderedDict()
        self._open: set[_Connection] = set()
        self._host_header = f"{self.host}:{self.port}"
        self._ssl = ssl.create_default_context() if self.scheme == "https" else None

    def _forget(self, connection: _Connection) -> None:
        self._idle.pop(connection, None)
        self._open.discard(connection)

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _, connection = await within(
                loop.create_connection(lambda: _Connection(self), self.host, self.port, ssl=self._ssl),
                self.connect_timeout,
            )
        except asyncio.TimeoutError:
            raise ConnectError(f"connect timed out after {self.connect_timeout:.0f}s") from None
        except OSError as e:
            raise ConnectError(str(e) or type(e).__name__) from None
        self._open.add(connection)
        return connection

    async def request(self, method: str, path: str, body: bytes | None = None, header: str = "") -> Response:
        """``header``: extra header lines, each ending with CRLF."""
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: {self._host_header}\r\nUser-Agent: slime-mt\r\n"
            f"Accept: application/json\r\nContent-Type: application/json\r\n{header}"
            f"Content-Length: {len(body) if body else 0}\r\n\r\n"
        ).encode("latin-1")
        data = head + body if body else head
        while True:
            if self._idle:
                connection, _ = self._idle.popitem()  # the most recently used
            else:
                connection = await self._connect()
            reused, connection.used = connection.used, True
            try:
                if connection.closed or connection.transport.is_closing():
                    raise ConnectionLost("connection closed")
                response, keep_alive = await connection.send(data)
            except ConnectionLost as e:
                connection.close()
                if reused and e.before_answer:
                    continue  # closed idle by the server as the request left, never read: the next one
                raise
            except BaseException:  # cancelled, or a timeout around the call: the server sees the client go
                connection.close()
                raise
            if keep_alive and not connection.closed:
                self._idle[connection] = None
            return response

    def close(self) -> None:
        for connection in list(self._open):
            connection.close()


class HTTPClient:
    """Pools by origin. ``request(method, url, body)`` -> Response; ``close()`` closes every connection."""

    def __init__(self, connect_timeout: float = CONNECT_TIMEOUT):
        self.connect_timeout = connect_timeout
        self._pools: dict[tuple[str, str, int], Pool] = {}
        self._paths: dict[str, tuple[Pool, str]] = {}

    def _target(self, url: str) -> tuple[Pool, str]:
        target = self._paths.get(url)
        if target is None:
            origin, path = split_url(url)
            pool = self._pools.get(origin)
            if pool is None:
                pool = self._pools[origin] = Pool(origin, self.connect_timeout)
            target = self._paths[url] = (pool, path)
        return target

    async def request(self, method: str, url: str, body: bytes | None = None, header: str = "") -> Response:
        pool, path = self._target(url)
        return await pool.request(method, path, body, header)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
        self._paths.clear()
