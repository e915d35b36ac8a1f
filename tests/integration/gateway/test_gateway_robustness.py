"""Malformed and hostile requests get a 4xx naming what is wrong (or a correct answer), never a 5xx
or a hang, and the gateway keeps serving valid sessions."""

import asyncio
import json
import socket
import statistics
import time
import urllib.parse

import httpx
import pytest
from gateway_helpers import TOOLS, Harness, openai

GOOD = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

BAD_BODIES = [
    b"",
    b"{",
    b"[1, 2]",
    b'"text"',
    b"null",
    b'{"messages": ' + b"[" * 200 + b"]" * 200 + b"}",
    b"\xff\xfe\x00",
    b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1e999}',
]
BAD_FIELDS = [
    {"messages": "hi"},
    {"messages": []},
    {"messages": [{"role": "wizard", "content": "hi"}]},
    {"messages": [{"role": "user", "content": {"text": "hi"}}]},
    {"messages": [{"role": "user", "content": [{"type": "audio", "data": "x"}]}]},
    {
        "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}]}
        ]
    },
    {
        "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}
        ]
    },
    {"messages": [{"role": "user", "content": "hi"}] * 2000},
    {
        "messages": [
            {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}
        ]
    },
    {"messages": [{"role": "assistant", "tool_calls": "x"}]},
    {"temperature": "hot"},
    {"temperature": -1},
    {"temperature": 3.5},
    {"top_p": 2},
    {"max_tokens": -5},
    {"max_tokens": 0},
    {"max_tokens": "many"},
    {"max_completion_tokens": 1.5},
    {"n": 100},
    {"n": 0},
    {"seed": 1.5},
    {"seed": 2**70},
    {"stop": ["a"] * 20},
    {"stop": 5},
    {"stop": [""]},
    {"tools": "add"},
    {"tools": [{"type": "retrieval"}]},
    {"tools": [{"type": "function", "function": {"name": ""}}]},
    {"tool_choice": "required"},
    {"tool_choice": {"type": "function", "function": {"name": "add"}}},
    {"top_logprobs": 5},
    {"logprobs": "yes"},
    {"stream": "sometimes"},
    {"stream_options": {"include_usage": True, "other": 1}},
    {"return_token_ids": 1},
    {"frequency_penalty": 1.0},
    {"response_format": {"type": "json_object"}},
    {"functions": [{"name": "f"}]},
    {"logit_bias": {"1": 5}},
    {"modalities": ["audio"]},
    {"model": 5},
]
ANTHROPIC_BAD = [
    {"model": "m", "messages": [{"role": "user", "content": "hi"}]},  # no max_tokens
    {"model": "m", "max_tokens": 4, "messages": [{"role": "system", "content": "hi"}]},
    {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "document"}]}]},
    {
        "model": "m",
        "max_tokens": 4,
        "messages": [{"role": "assistant", "content": [{"type": "tool_use", "name": "f", "input": 3}]}],
    },
    {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "any"}},
    {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "thinking": "lots"},
    {"model": "m", "max_tokens": 4, "messages": [], "stop_sequences": "x"},
]


def _expect_4xx(response: httpx.Response, what) -> None:
    assert 400 <= response.status_code < 500, f"{what!r:.120}: HTTP {response.status_code} {response.text[:300]}"
    body = response.json()
    message = body["error"]["message"]
    assert message, f"{what!r:.120}: no message"


async def _hostile(base: str, sid_url: str) -> int:
    """200 bad requests plus 64 valid sessions at once; -> how many bad requests were sent."""
    sent = 0
    async with httpx.AsyncClient(timeout=60) as http:
        chat = sid_url + "/chat/completions"

        async def post(url, content=None, json_body=None):
            nonlocal sent
            sent += 1
            return await http.post(url, content=content, json=json_body)

        for body in BAD_BODIES:
            _expect_4xx(await post(chat, content=body), body)
        for fields in BAD_FIELDS:
            response = await post(chat, json_body={**GOOD, **fields})
            _expect_4xx(response, fields)
            name = next(iter(fields))
            assert name in response.json()["error"]["message"] or name == "messages", response.text
        for body in ANTHROPIC_BAD:
            response = await post(sid_url.removesuffix("/v1") + "/v1/messages", json_body=body)
            assert 400 <= response.status_code < 500 and response.json()["type"] == "error", response.text
        for k in range(40):
            unknown = f"{base}/sessions/not-a-session-{k}/v1/chat/completions"
            response = await post(unknown, json_body=GOOD)
            assert response.status_code == 404 and "unknown or closed" in response.text
        huge = b'{"messages": "' + b"x" * (65 * 1024 * 1024) + b'"}'
        response = await post(chat, content=huge)
        assert response.status_code == 413
        for k in range(200 - sent):
            response = await post(chat, json_body={**GOOD, "messages": [{"role": "user", "content": 7 + k}]})
            _expect_4xx(response, "content as a number")
    return sent


def test_hostile_requests_get_4xx_and_valid_sessions_keep_being_served(harness):
    session, base_url = harness.open()
    assert asyncio.run(_hostile(harness.gateway.url, base_url)) == 200
    # a valid call still works in the same session, and 64 sessions at once are all served
    client = openai.OpenAI(base_url=base_url, api_key="EMPTY", max_retries=0)
    assert client.chat.completions.create(**GOOD).choices[0].message.content is not None
    harness.close(session)

    sessions = [harness.open(index=k) for k in range(64)]

    async def call_all():
        async with httpx.AsyncClient(timeout=60) as http:
            return await asyncio.gather(
                *(http.post(url + "/chat/completions", json={**GOOD, "tools": TOOLS}) for _, url in sessions)
            )

    answers = asyncio.run(call_all())
    assert [a.status_code for a in answers] == [200] * 64
    assert all(a.json()["choices"][0]["finish_reason"] in ("tool_calls", "length") for a in answers)
    for s, _ in sessions:
        harness.close(s)
        assert len(s.sample.turns) == 1


def test_a_session_holds_at_most_its_concurrency_and_a_closed_session_is_404(harness):
    session, base_url = harness.open()

    async def burst():
        async with httpx.AsyncClient(timeout=60) as http:
            return await asyncio.gather(*(http.post(base_url + "/chat/completions", json=GOOD) for _ in range(20)))

    codes = sorted(r.status_code for r in asyncio.run(burst()))
    assert set(codes) <= {200, 429} and 200 in codes
    harness.close(session)
    response = httpx.post(base_url + "/chat/completions", json=GOOD)
    assert response.status_code == 404
    assert len(session.sample.turns) == codes.count(200)


def test_a_client_that_leaves_mid_stream_does_not_disturb_the_gateway(harness):
    session, base_url = harness.open()
    with httpx.stream("POST", base_url + "/chat/completions", json={**GOOD, "stream": True, "tools": TOOLS}) as r:
        assert r.status_code == 200
        next(r.iter_bytes())  # the first chunk, then the client goes
    answer = httpx.post(base_url + "/chat/completions", json=GOOD, timeout=60)
    harness.close(session)
    assert answer.status_code == 200
    assert len(session.sample.turns) == 2  # the left stream's call was generated and is recorded


def test_a_huge_request_does_not_stall_the_other_sessions(harness):
    """Issue 44 item 5: while 4 MiB requests are in flight in one session (text far past the context
    budget: refused before it is tokenized), another session's calls keep their latency (within 2x of
    idle, medians), and nothing is recorded for the refused calls."""
    huge_session, huge_url = harness.open(index=1)
    session, base_url = harness.open(index=2)
    huge = {**GOOD, "messages": [{"role": "user", "content": "hello world, " * (4 * 1024 * 1024 // 13)}]}

    async def timed(http, url, body):
        started = time.perf_counter()
        response = await http.post(url + "/chat/completions", json=body)
        return response, time.perf_counter() - started

    async def scenario():
        async with httpx.AsyncClient(timeout=120) as http:
            await timed(http, base_url, GOOD)  # warm
            idle = [(await timed(http, base_url, GOOD))[1] for _ in range(7)]
            huge_calls = asyncio.gather(*(timed(http, huge_url, huge) for _ in range(3)))
            await asyncio.sleep(0.05)  # the uploads under way
            busy = [(await timed(http, base_url, GOOD))[1] for _ in range(7)]
            return idle, busy, await huge_calls

    idle, busy, refused = asyncio.run(scenario())
    for response, _ in refused:
        assert response.status_code == 400, response.text[:300]
        error = response.json()["error"]
        assert error["type"] == "context_length_exceeded" and "characters of text cannot fit" in error["message"]
    assert statistics.median(busy) <= 2 * statistics.median(idle), (idle, busy)
    harness.close(huge_session)
    harness.close(session)
    assert huge_session.sample.turns == [] and huge_session.sample.metadata.get("termination") != "error"


def test_a_lone_surrogate_anywhere_is_a_400_naming_the_field_and_records_nothing(harness):
    """Issue 44 item 6: a field that would be echoed (``model``) or tokenized holding a lone surrogate
    (JSON's \\ud800 escape) is refused before the engine is called, on both APIs; never a 5xx."""
    session, base_url = harness.open()
    messages_url = base_url.removesuffix("/v1") + "/v1/messages"
    cases = [
        (base_url + "/chat/completions", {**GOOD, "model": "m\ud800"}, "model"),
        (base_url + "/chat/completions", {**GOOD, "messages": [{"role": "user", "content": "a\udfffb"}]}, "content"),
        (base_url + "/chat/completions", {**GOOD, "stop": ["\ud83d"]}, "stop"),
        (messages_url, {"model": "\ud800", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}, "model"),
    ]
    for url, body, name in cases:
        content = json.dumps(body).encode()  # ensure_ascii: the surrogate travels as its escape
        response = httpx.post(url, content=content, headers={"content-type": "application/json"}, timeout=60)
        assert response.status_code == 400, (name, response.status_code, response.text[:300])
        message = response.json()["error"]["message"]
        assert name in message and "lone surrogate" in message, message
    assert session.sample.turns == []  # refused before the engine: nothing generated, nothing recorded
    assert httpx.post(base_url + "/chat/completions", json=GOOD, timeout=60).status_code == 200
    harness.close(session)
    assert len(session.sample.turns) == 1


def _raw_post(url: str, body: bytes, chunked: bool) -> bytes:
    """POST ``body`` over a plain socket as a client that sends all of it before reading (what most
    HTTP clients do) -> the bytes of the answer ('' when the connection was reset first)."""
    parsed = urllib.parse.urlsplit(url)
    head = f"POST {parsed.path} HTTP/1.1\r\nHost: {parsed.netloc}\r\ncontent-type: application/json\r\n"
    head += "transfer-encoding: chunked\r\n\r\n" if chunked else f"content-length: {len(body)}\r\n\r\n"
    with socket.create_connection((parsed.hostname, parsed.port), timeout=60) as sock:
        try:
            sock.sendall(head.encode())
            for start in range(0, len(body), 1 << 20):
                piece = body[start : start + (1 << 20)]
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
            if chunked:
                sock.sendall(b"0\r\n\r\n")
            answer = b""
            while b"\r\n\r\n" not in answer and (data := sock.recv(65536)):
                answer += data
            return answer
        except (ConnectionResetError, BrokenPipeError):
            return b""


def test_an_oversized_body_gets_its_413_every_time(harness):
    """Issue 44 item 7: the 413 comes after the upload is read through, declared or chunked, so a client
    that sends everything before it reads always gets it (before, the connection was often reset)."""
    session, base_url = harness.open()
    body = b'{"messages": "' + b"x" * (65 * 1024 * 1024) + b'"}'
    for chunked in (False, True, False, True):
        answer = _raw_post(base_url + "/chat/completions", body, chunked)
        assert answer.startswith(b"HTTP/1.1 413"), (chunked, answer[:200])
    assert httpx.post(base_url + "/chat/completions", json=GOOD, timeout=60).status_code == 200
    harness.close(session)


@pytest.fixture(scope="module")
def exposed(scripted_path, scripted_engine):
    h = Harness(scripted_path, scripted_engine.url, ["--gateway-host", "0.0.0.0"])
    yield h
    h.stop()


def test_beyond_loopback_a_key_is_required_and_file_paths_are_refused(exposed, tmp_path):
    key = exposed.gateway.api_key
    assert key and len(key) >= 32
    session, base_url = exposed.open()
    local = base_url.replace(exposed.gateway.url, f"http://127.0.0.1:{exposed.gateway.port}")
    for headers in ({}, {"authorization": "Bearer wrong"}, {"x-api-key": "wrong"}):
        response = httpx.post(local + "/chat/completions", json=GOOD, headers=headers)
        assert response.status_code == 401, headers
    response = httpx.post(
        local + "/chat/completions",
        json={
            **GOOD,
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": str(tmp_path / "a.png")}}]}
            ],
        },
        headers={"authorization": f"Bearer {key}"},
    )
    assert response.status_code == 400 and "loopback" in response.text
    client = openai.OpenAI(base_url=local, api_key=key, max_retries=0)
    assert client.chat.completions.create(**GOOD).choices
    assert client.models.list().data[0].id
    exposed.close(session)
    assert json.loads(httpx.get(local + "/models", headers={"x-api-key": key}).text)["error"]["code"] == 404
