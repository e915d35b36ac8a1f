"""The engine client's HTTP/1.1 transport against a real socket server that answers as each test says:
keep-alive reuse, the three ways a body ends, answers cut into pieces, idle connections the server
closed, answers cut short, cancellation."""

import asyncio

import pytest
from engine_helpers import run

from slime_mt.engine.http import HTTPClient, split_url
from slime_mt.errors import ConnectError, ConnectionLost

OK = b'{"ok": true}'


def framed(body: bytes = OK, extra: str = "") -> bytes:
    return f"HTTP/1.1 200 OK\r\ncontent-length: {len(body)}\r\n{extra}\r\n".encode() + body


class Server:
    """An asyncio TCP server on 127.0.0.1; ``answer(request_number, head, body)`` -> (bytes to send, or
    a list of pieces, and whether to close after). Counts connections and reads requests as sent."""

    def __init__(self, answer):
        self.answer = answer
        self.connections = 0
        self.requests: list[tuple[bytes, bytes]] = []
        self.closed_by_client = 0

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        self.server.close()

    async def _serve(self, reader, writer):
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.lower().split(b"\r\n")
                length = next(int(line.split(b":")[1]) for line in lines if line.startswith(b"content-length"))
                body = await reader.readexactly(length)
                self.requests.append((head, body))
                out, close = self.answer(len(self.requests), head, body)
                for piece in out if isinstance(out, list) else [out]:
                    if isinstance(piece, float):
                        await asyncio.sleep(piece)
                        continue
                    writer.write(piece)
                    await writer.drain()
                if close:
                    break
        except asyncio.IncompleteReadError:
            self.closed_by_client += 1
        finally:
            writer.close()


def test_keep_alive_reuses_one_connection_and_sends_the_body_as_given():
    async def go():
        async with Server(lambda n, head, body: (framed(b'{"n": %d}' % n), False)) as server:
            client = HTTPClient()
            url = server.url + "/generate"
            answers = [await client.request("POST", url, b'{"input_ids": [1, 2]}') for _ in range(5)]
            client.close()
            return server, answers

    server, answers = run(go())
    assert [a.status for a in answers] == [200] * 5
    assert [a.body for a in answers] == [b'{"n": %d}' % n for n in range(1, 6)]
    assert server.connections == 1
    head, body = server.requests[0]
    assert head.startswith(b"POST /generate HTTP/1.1\r\n") and b"Host: 127.0.0.1:" in head
    assert body == b'{"input_ids": [1, 2]}'


def test_chunked_answer_in_one_byte_pieces_and_an_interim_answer():
    body = b'{"output_ids": [1, 2, 3], "text": "' + b"x" * 300 + b'"}'
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(body[i : i + 100]), body[i : i + 100]) for i in range(0, len(body), 100))
    head = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    wire = head + chunked + b"0\r\n\r\n"

    async def go():
        async with Server(lambda n, head, b: ([wire[i : i + 1] for i in range(len(wire))], False)) as server:
            client = HTTPClient()
            first = await client.request("POST", server.url + "/x", b"{}")
            second = await client.request("POST", server.url + "/x", b"{}")
            client.close()
            return server, first, second

    server, first, second = run(go())
    assert first.body == body and second.body == body and first.headers["transfer-encoding"] == "chunked"
    assert server.connections == 1  # a chunked answer leaves the connection reusable


def test_body_until_close_and_connection_close():
    async def go():
        answers = {
            1: (b"HTTP/1.0 200 OK\r\n\r\n<html>a proxy page</html>", True),
            2: (framed(extra="connection: close\r\n"), True),
        }
        async with Server(lambda n, head, body: answers.get(n, (framed(), False))) as server:
            client = HTTPClient()
            first = await client.request("POST", server.url + "/a", b"{}")
            second = await client.request("POST", server.url + "/a", b"{}")
            third = await client.request("POST", server.url + "/a", b"{}")
            client.close()
            return server, first, second, third

    server, first, second, third = run(go())
    assert first.body == b"<html>a proxy page</html>" and second.body == OK and third.body == OK
    assert server.connections == 3  # neither answer left its connection open


def test_a_connection_the_server_closed_while_idle_is_not_used():
    async def go():
        async with Server(lambda n, head, body: (framed(), n == 1)) as server:  # closes after the first answer
            client = HTTPClient()
            await client.request("POST", server.url + "/a", b"{}")
            await asyncio.sleep(0.05)
            answer = await client.request("POST", server.url + "/a", b"{}")
            client.close()
            return server, answer

    server, answer = run(go())
    assert answer.body == OK and server.connections == 2


def test_a_reused_connection_that_closes_before_answering_is_sent_again_once_a_fresh_one_fails_loudly():
    """The server reads the second request and closes without a byte (a keep-alive race): the request
    goes out again on a new connection. A new connection closed the same way raises ConnectionLost."""

    async def go():
        async with Server(lambda n, head, body: (framed() if n != 2 else b"", n == 2)) as server:
            client = HTTPClient()
            await client.request("POST", server.url + "/a", b"{}")
            answer = await client.request("POST", server.url + "/a", b"{}")
            client.close()
        async with Server(lambda n, head, body: (b"", True)) as server:
            client = HTTPClient()
            with pytest.raises(ConnectionLost):
                await client.request("POST", server.url + "/a", b"{}")
            client.close()
        return answer

    assert run(go()).body == OK


def test_an_answer_cut_short_raises_connection_lost():
    async def go():
        async with Server(lambda n, head, body: (framed(b'{"output_ids": [1, 2, 3]}')[:-5], True)) as server:
            client = HTTPClient()
            with pytest.raises(ConnectionLost, match="closed"):
                await client.request("POST", server.url + "/a", b"{}")
            client.close()

    run(go())


def test_a_cancelled_request_closes_its_connection():
    """The server sees the client go (SGLang aborts a request whose client disconnected)."""

    async def go():
        saw_eof = asyncio.Event()

        async def serve(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(2)
            if await reader.read(1) == b"":  # no answer is sent: the next thing is the client closing
                saw_eof.set()
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        client = HTTPClient()
        task = asyncio.create_task(client.request("POST", url + "/slow", b"{}"))
        await asyncio.sleep(0.2)
        assert not saw_eof.is_set()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(saw_eof.wait(), 5.0)
        client.close()
        server.close()

    run(go())


def test_connect_errors_name_the_cause():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def go():
        client = HTTPClient()
        with pytest.raises(ConnectError):
            await client.request("GET", f"http://127.0.0.1:{port}/health")

    run(go())
    with pytest.raises(ValueError, match="not an http"):
        split_url("ftp://host/x")
    assert split_url("https://engine.example/generate?x=1") == (("https", "engine.example", 443), "/generate?x=1")


def test_many_requests_in_flight_on_many_connections():
    """1,000 requests at once: each gets its own answer (no answer crosses connections), and the pool
    keeps every connection for reuse."""

    async def go():
        async with Server(lambda n, head, body: ([0.01, framed(body)], False)) as server:
            client = HTTPClient()
            bodies = [b'{"i": %d}' % i for i in range(1000)]
            answers = await asyncio.gather(*(client.request("POST", server.url + "/e", b) for b in bodies))
            again = await asyncio.gather(*(client.request("POST", server.url + "/e", b) for b in bodies[:200]))
            client.close()
            return server, bodies, answers, again

    server, bodies, answers, again = run(go())
    assert [a.body for a in answers] == bodies and [a.body for a in again] == bodies[:200]
    assert server.connections == 1000
