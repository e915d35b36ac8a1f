"""Malformed requests get a 4xx and the engine keeps serving; the client survives a restarting server."""

import asyncio
import base64
import random
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from engine_helpers import data_uri, diagram, run

from slime_mt.engine import launch
from slime_mt.engine.clients.sglang import EngineClient
from slime_mt.engine.embedded.server import LocalEngine
from slime_mt.engine.launch import free_port
from slime_mt.errors import EngineError, EngineRequestError, EngineTimeoutError, LaunchError

PROMPT = [9707, 1879, 11]
VALID = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}


def malformed_requests(vl_pad: int) -> list[tuple[str, bytes | dict]]:
    """(label, body) pairs: raw bytes are sent as-is, dicts as JSON."""
    not_image = "data:image/png;base64," + base64.b64encode(b"definitely not a png").decode()
    cases: list[tuple[str, bytes | dict]] = [
        ("bad json", b"{not json"),
        ("truncated json", b'{"input_ids": [1, 2'),
        ("empty body", b""),
        ("json list", b"[1, 2, 3]"),
        ("json string", b'"hello"'),
        ("binary", bytes(range(256))),
        ("no prompt", {"sampling_params": {}}),
        ("empty ids", {"input_ids": []}),
        ("empty text", {"text": ""}),
        ("ids and text", {"input_ids": [1], "text": "a"}),
        ("string ids", {"input_ids": "1 2 3"}),
        ("float id", {"input_ids": [1.5]}),
        ("negative id", {"input_ids": [-3]}),
        ("id out of vocab", {"input_ids": [10_000_000]}),
        ("nested empty", {"input_ids": [[1], []]}),
        ("sampling list", {"input_ids": [1], "sampling_params": [1]}),
        ("unknown sampling key", {"input_ids": [1], "sampling_params": {"max_tokens": 5}}),
        ("string max_new_tokens", {"input_ids": [1], "sampling_params": {"max_new_tokens": "5"}}),
        ("negative max_new_tokens", {"input_ids": [1], "sampling_params": {"max_new_tokens": -5}}),
        ("huge max_new_tokens", {"input_ids": [1], "sampling_params": {"max_new_tokens": 10**9}}),
        ("negative temperature", {"input_ids": [1], "sampling_params": {"temperature": -1}}),
        ("top_p zero", {"input_ids": [1], "sampling_params": {"top_p": 0}}),
        ("bad stop", {"input_ids": [1], "sampling_params": {"stop": 5}}),
        ("bad stop ids", {"input_ids": [1], "sampling_params": {"stop_token_ids": ["a"]}}),
        ("broken base64 image", {"input_ids": [1, vl_pad], "image_data": ["data:image/png;base64,!!!!"]}),
        ("non-image bytes", {"input_ids": [1, vl_pad], "image_data": [not_image]}),
        ("missing image file", {"input_ids": [1, vl_pad], "image_data": ["/no/such/image.png"]}),
        ("image not a string", {"input_ids": [1, vl_pad], "image_data": [42]}),
        ("image on text model", {"input_ids": [1, vl_pad], "image_data": [data_uri(diagram(1))]}),
        ("rid not string", {"input_ids": [1], "rid": 7}),
    ]
    return cases


def test_200_malformed_requests_then_a_valid_one(farm, tiny_paths):
    target = farm.target("text-direct", tiny_paths["qwen2"])
    cases = malformed_requests(151655)
    rng = random.Random(0)
    expected = httpx.post(target.url + "/generate", json=VALID, timeout=60).json()
    statuses = []
    with httpx.Client(timeout=60) as http:
        for i in range(200):
            label, body = cases[i % len(cases)] if i < len(cases) else rng.choice(cases)
            if isinstance(body, bytes):
                response = http.post(
                    target.url + "/generate", content=body, headers={"content-type": "application/json"}
                )
            else:
                response = http.post(target.url + "/generate", json=body)
            statuses.append((label, response.status_code))
            assert 400 <= response.status_code < 500, (label, response.status_code, response.text)
            assert response.json()["error"]["message"], label
            if i % 20 == 0:  # the engine keeps answering valid requests correctly in between
                assert http.post(target.url + "/generate", json=VALID).json()["output_ids"] == expected["output_ids"]
        after = http.post(target.url + "/generate", json=VALID).json()
    assert len(statuses) == 200
    assert after["output_ids"] == expected["output_ids"]


def test_4xx_is_not_retried(farm, tiny_paths):
    target = farm.target("text-direct", tiny_paths["qwen2"])

    async def go():
        async with EngineClient(target.url, max_retries=5, backoff=2.0) as client:
            started = time.perf_counter()
            with pytest.raises(EngineRequestError, match="HTTP 400: .*unknown key"):
                await client.generate(PROMPT, {"bogus": 1})
            return time.perf_counter() - started

    assert run(go()) < 1.5  # a retry would have slept 2 s


def test_client_retries_through_a_restart():
    from slime_mt.assets import tiny_model_dir

    path = tiny_model_dir("qwen2")
    port = free_port()
    engine = LocalEngine(path, port=port).start()
    expected = run(_generate(engine.url, retries=0))
    engine.stop()
    restarted: list[LocalEngine] = []

    def restart_later():
        time.sleep(1.5)
        restarted.append(LocalEngine(path, port=port).start())

    thread = threading.Thread(target=restart_later)
    thread.start()
    try:
        out = run(_generate(f"http://127.0.0.1:{port}", retries=6, backoff=0.5))  # waits 0.5+1+2+4+8 s at most
        assert out["output_ids"] == expected["output_ids"]
    finally:
        thread.join()
        for e in restarted:
            e.stop()


def test_client_gives_up_after_budget_naming_url():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(
        EngineError, match=rf"engine {url}/generate failed after 3 attempts; last failure: ConnectError"
    ):
        run(_generate(url, retries=2, backoff=0.05))


def test_timeout_aborts_the_request_on_the_engine(farm, tiny_paths):
    target = farm.target("text-direct", tiny_paths["qwen2"])

    async def go():
        async with EngineClient(target.url) as client:
            with pytest.raises(EngineTimeoutError, match="exceeded 0.5s; aborted"):
                await client.generate(PROMPT, {"max_new_tokens": 3000, "ignore_eos": True}, timeout=0.5)
            await asyncio.sleep(0.3)
            return (await client.server_info())[0]["internal_states"][0]

    state = run(go())
    assert state["#running_req"] == 0 and state["#queue_req"] == 0


async def _generate(url, retries, backoff=0.5):
    async with EngineClient(url, max_retries=retries, backoff=backoff) as client:
        return await client.generate(PROMPT, {"max_new_tokens": 4, "temperature": 0.0})


class BlackHole:
    """A TCP listener that accepts connections and never answers (a wedged engine)."""

    def __enter__(self):
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        return self

    def __exit__(self, *exc):
        self.sock.close()


def test_no_client_call_outlives_its_timeout_and_errors_name_the_engine():
    from slime_mt.engine.clients.sglang import ABORT_GRACE

    async def go(url):
        async with EngineClient(url, timeout=30.0) as client:
            timings = {}
            for name, call in [
                ("generate", client.generate(PROMPT, {"max_new_tokens": 2}, timeout=0.5)),
                ("generate_batch", client.generate_batch([PROMPT, PROMPT], {"max_new_tokens": 2}, timeout=0.5)),
                ("update_weights", client.update_weights_from_disk("/tmp/x", "1", timeout=0.5)),
                ("pause", client.pause(timeout=0.5)),
            ]:
                started = time.perf_counter()
                with pytest.raises(EngineTimeoutError, match=url) as raised:
                    await call
                timings[name] = (time.perf_counter() - started, str(raised.value))
            return timings

    with BlackHole() as hole:
        timings = run(go(hole.url))
    for name, (seconds, _) in timings.items():
        assert seconds < 0.5 + ABORT_GRACE + 0.5, (name, seconds)
    assert "aborted on the engine" in timings["generate"][1]


def test_broadcast_names_each_failed_worker(farm, tiny_paths):
    target = farm.target("text-direct", tiny_paths["qwen2"])
    dead = f"http://127.0.0.1:{free_port()}"

    async def go():
        async with EngineClient(target.url, worker_urls=[target.url, dead], max_retries=1, backoff=0.05) as client:
            with pytest.raises(EngineError) as raised:
                await client.resume()
            return str(raised.value)

    message = run(go())
    assert f"failed on 1 of 2 engines: engine {dead}/continue_generation failed after 2 attempts" in message
    assert target.url not in message


def test_a_200_that_is_not_json_names_the_engine():
    import http.server

    class NotJson(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's naming)
            self.rfile.read(int(self.headers["content-length"]))
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"<html>a proxy page</html>")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotJson)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with pytest.raises(EngineError, match=rf"engine {url}/generate answered HTTP 200 with a body that is not JSON"):
            run(_generate(url, retries=0))
    finally:
        server.shutdown()


class _HTTPDirServer(launch._ServerProcess):
    """A server process that binds late, as vLLM does: Python's own ``http.server`` (healthy at ``/``)."""

    kind, name, ready_path = "http", "http server", "/"

    def __init__(self, log_dir, port=None):
        self.host = "127.0.0.1"
        self.port = port or launch.free_port(self.host)
        command = lambda port: [sys.executable, "-m", "http.server", port, "--bind", self.host]  # an int, as given
        self._launch(command, log_dir, port_given=port is not None)


def test_a_server_whose_chosen_port_was_taken_starts_on_another_and_a_given_one_fails_naming_it(tmp_path, monkeypatch):
    """(integration, ~2 s) A port chosen free and taken by another process before the server bound it:
    the server starts again on another port; a port the user gave is not changed, and the error names
    the command and its log."""
    with socket.socket() as taken:  # bound, not listening: as another process's outgoing connection holds it
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        chosen = iter([port])
        real = launch.free_port
        monkeypatch.setattr(launch, "free_port", lambda host="127.0.0.1": next(chosen, None) or real(host))
        server = _HTTPDirServer(tmp_path / "chosen")
        try:
            assert server.port != port and server.alive
            assert httpx.get(server.url + "/", timeout=5).status_code == 200
            assert launch.PORT_TAKEN in (tmp_path / "chosen" / f"http-{port}.log").read_text()
        finally:
            server.stop()
        with pytest.raises(
            LaunchError,
            match=rf"(?s)exited with code 1: \S+ -m http\.server {port} --bind \S+\nlog .*{launch.PORT_TAKEN}",
        ):
            _HTTPDirServer(tmp_path / "given", port=port)


def test_a_stop_never_raises_when_a_killed_process_is_not_reaped_in_time(tmp_path, caplog):
    """A child that ignores SIGTERM is SIGKILLed after the grace; a wait that still times out after that
    (a loaded machine: the OS had not reaped a killed router in 10 s, and the stop's exception hid the
    error that ended the run) is logged, not raised. The wait timing out is what cannot be made here
    (a SIGKILLed process always dies): it is simulated; the signals are real."""
    ready = tmp_path / "ready"
    code = "import pathlib, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    code += f"pathlib.Path({str(ready)!r}).touch(); time.sleep(60)"
    stubborn = launch._Process([sys.executable, "-c", code], tmp_path / "stubborn.log", "stubborn")
    deadline = time.time() + 30
    while not ready.exists():
        assert time.time() < deadline and stubborn.proc.poll() is None
        time.sleep(0.05)
    wait = stubborn.proc.wait

    def never_in_time(timeout=None):
        raise subprocess.TimeoutExpired(stubborn.cmd, timeout)

    stubborn.proc.wait = never_in_time
    with caplog.at_level("WARNING", logger="slime_mt.engine.launch"):
        stubborn.stop(grace=0.2)  # does not raise
    assert f"stubborn (pid {stubborn.proc.pid}) had not exited 0.2 s after SIGKILL" in caplog.text
    assert wait(timeout=30) == -9  # the SIGTERM was ignored, the SIGKILL was not
