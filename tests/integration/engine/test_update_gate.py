"""Weight updates against SGLang's own pause and update semantics, on the embedded engine over HTTP.

SGLang holds a ``/generate`` that arrives while paused on its tokenizer manager's pause condition,
before the scheduler, where abort-all does not reach it, and lets it go on at
``/continue_generation``; ``/pause_generation`` in abort mode answers once every admitted request
has; an update while not paused waits for the running requests (its model-update lock). The
embedded engine behaves the same, and the client's update gate must not depend on where a request
waits: a full connection pool, a request that reaches the engine after the pause (a router's extra
hop, played by a TCP proxy that holds one request until the engine is paused)."""

import asyncio

import pytest
import torch

from slime_mt.engine.clients.sglang import UPDATE_ABORT, EngineClient
from slime_mt.engine.clients.update_gate import UpdateGate
from slime_mt.engine.embedded.server import LocalEngine
from slime_mt.errors import EngineRequestError
from slime_mt.safetensors_files import load_hf_state

PROMPT = [9707, 11, 1246, 525, 498, 30, 358, 1079]
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def weights(tiny_paths):
    """The tiny Qwen2's weights (version "0") and another version: every matrix moved by noise, so
    greedy outputs differ."""
    original = load_hf_state(tiny_paths["qwen2"])
    noise = torch.Generator().manual_seed(0)
    changed = {
        k: v + 0.5 * v.std() * torch.randn(v.shape, generator=noise) if v.dim() == 2 else v for k, v in original.items()
    }
    return original, changed


@pytest.fixture(scope="module")
def engine(tiny_paths):
    with LocalEngine(tiny_paths["qwen2"], max_batch_size=64, cache_tokens=8192) as engine:
        yield engine


@pytest.fixture
def fresh(engine, weights):
    """The engine at the original weights, version "0", empty cache, not paused (restored after the test)."""
    engine.update_weights_from_tensors(weights[0], "0")
    yield engine
    engine.scheduler.resume()
    engine.update_weights_from_tensors(weights[0], "0")


def run(coro):
    return asyncio.run(coro)


def generated(engine) -> int:
    """Tokens of the request running now (the engine runs one). Read from the running requests, not
    the batch: a request already answered stays in the batch until the engine thread next runs, which
    on a loaded machine is after the next request was sent."""
    (job,) = list(engine.scheduler._running.values()) or [None]
    return len(job.seq.output_ids) if job is not None else 0


async def generate(url, ids, **params):
    async with EngineClient(url) as client:
        return await client.generate(ids, dict(GREEDY, **params))


async def until(predicate, what, seconds=30.0):
    deadline = asyncio.get_running_loop().time() + seconds
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.002)


class HoldingProxy:
    """A TCP hop in front of the engine (what a router adds): bytes pass through both ways, but the
    connection that carries a request whose body holds ``marker`` is held until ``until()`` is true."""

    def __init__(self, port: int, marker: bytes, until):
        self.port, self.marker, self.until = port, marker, until
        self.holding = False
        self._server = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def __aenter__(self):
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc):
        self._server.close()

    async def _connection(self, reader, writer):
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.port)

        async def pump(source, sink, inspect):
            try:
                while chunk := await source.read(65536):
                    if inspect and self.marker in chunk and not self.until():
                        self.holding = True
                        while not self.until():
                            await asyncio.sleep(0.002)
                    sink.write(chunk)
                    await sink.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                sink.close()

        await asyncio.gather(pump(reader, upstream_writer, True), pump(upstream_reader, writer, False))


def test_a_request_that_arrives_while_paused_waits_at_admission_and_abort_all_does_not_reach_it(fresh):
    async def go():
        async with EngineClient(fresh.url) as client:
            await client.pause(mode="abort")
            late = asyncio.ensure_future(client.generate(PROMPT, dict(GREEDY, max_new_tokens=12)))
            await asyncio.sleep(0.3)
            await client.abort(abort_all=True)
            await asyncio.sleep(0.3)
            waiting = not late.done() and fresh.scheduler.load()["#queue_req"] == 0  # not in the scheduler
            held = fresh.held_at_admission
            await client.resume()
            return waiting, held, await late

    waiting, held, late = run(go())
    assert waiting and held == 1
    assert fresh.held_at_admission == 0
    assert late["meta_info"]["finish_reason"] == {"type": "length", "length": 12}


def test_pause_in_abort_mode_answers_once_every_admitted_request_has(fresh):
    async def go():
        async with EngineClient(fresh.url) as client:
            tasks = [
                asyncio.ensure_future(client.generate(PROMPT + [k], dict(GREEDY, max_new_tokens=400))) for k in range(8)
            ]
            await until(lambda: fresh.scheduler.load()["#running_req"] == 8, "the requests never ran")
            await client.pause(mode="abort")
            state = fresh.scheduler.load()
            results = await asyncio.gather(*tasks)
            await client.resume()
            return state, results

    state, results = run(go())
    assert state["#running_req"] == state["#queue_req"] == 0 and fresh.scheduler.aborting() == 0
    assert all(r["meta_info"]["finish_reason"]["type"] == "abort" for r in results)
    assert all(0 < len(r["output_ids"]) < 400 for r in results)


def test_an_update_with_a_full_pool_and_a_late_request_completes_in_seconds_and_answers_everything(fresh, weights):
    """300 requests through a pool of 32 connections (268 wait in the client), one of them held in
    the network until the engine is paused: the update completes within 5 s, no request reaches the
    engine while the gate is closed, and every request is answered: the aborted ones with their old
    tokens (marked), the held one and the queued ones by the new weights alone. The first 32 (the late
    one and the 31 that fill the pool, the pool is first come first served) ask for 48 tokens, so they
    are still running when the update begins; the queued ones for 8."""

    def budget(k):
        return 48 if k < 31 else 8

    async def go():
        async with HoldingProxy(fresh.port, b"late-request", lambda: fresh.scheduler.paused) as proxy:
            client = EngineClient(proxy.url, worker_urls=[fresh.url], max_connections=32)
            client.gate = UpdateGate()
            late = asyncio.ensure_future(client.generate(PROMPT, dict(GREEDY, max_new_tokens=48), rid="late-request"))
            await until(lambda: proxy.holding, "the late request never reached the proxy")
            others = [
                asyncio.ensure_future(client.generate(PROMPT + [k], dict(GREEDY, max_new_tokens=budget(k))))
                for k in range(299)
            ]
            await until(lambda: fresh.scheduler.load()["#running_req"] >= 24, "the pool never filled the batch")
            loop = asyncio.get_running_loop()
            started = loop.time()
            await asyncio.wait_for(client.gate.close(client), 30)
            admitted_while_closed = fresh.scheduler.load()["#running_req"] + fresh.scheduler.load()["#queue_req"]
            await loop.run_in_executor(None, fresh.update_weights_from_tensors, weights[1], "1")
            await client.gate.open(client)
            seconds = loop.time() - started
            results = await asyncio.wait_for(asyncio.gather(late, *others), 300)
            await client.close()
            return seconds, admitted_while_closed, client.gate.held_by_engines, results

    seconds, admitted_while_closed, held, (late, *others) = run(go())
    assert seconds < 5.0
    assert admitted_while_closed == 0 and held == 1
    assert len(others) == 299
    for k, r in [(0, late), *enumerate(others)]:
        meta = r["meta_info"]
        if meta["finish_reason"]["type"] == "abort":
            assert meta[UPDATE_ABORT] is True and meta["weight_version"] == "0" and len(r["output_ids"]) < budget(k)
        else:
            assert meta["finish_reason"] == {"type": "length", "length": budget(k)} and UPDATE_ABORT not in meta
    assert sum(r["meta_info"]["finish_reason"]["type"] == "abort" for r in others) >= 24
    assert all(r["meta_info"]["weight_version"] == "1" for r in others[31:])  # queued: the new weights alone
    # the held request ran after the update, on the new weights alone
    assert late["meta_info"]["weight_version"] == "1"
    assert late["output_ids"] == run(generate(fresh.url, PROMPT, max_new_tokens=48))["output_ids"]


def test_an_update_waits_for_running_requests_and_their_tokens_keep_their_version(fresh, weights):
    """Not paused: the update waits until the running request has finished (SGLang's model-update
    lock), so its tokens are all version 0's and say so; requests that come meanwhile wait for it."""
    reference = run(generate(fresh.url, PROMPT, max_new_tokens=200))["output_ids"]

    async def go():
        async with EngineClient(fresh.url) as client:
            running = asyncio.ensure_future(client.generate(PROMPT, dict(GREEDY, max_new_tokens=200)))
            await until(lambda: generated(fresh) >= 8, "nothing was generated")
            loop = asyncio.get_running_loop()
            update = loop.run_in_executor(None, fresh.update_weights_from_tensors, weights[1], "1")
            await asyncio.sleep(0.05)
            later = asyncio.ensure_future(client.generate(PROMPT, dict(GREEDY, max_new_tokens=200)))
            return await running, await update, await later

    running, _, later = run(go())
    assert running["meta_info"]["weight_version"] == "0" and running["output_ids"] == reference
    assert later["meta_info"]["weight_version"] == "1" and later["output_ids"] != reference


def test_nothing_computed_under_old_weights_enters_the_prefix_cache_after_an_update(fresh, weights):
    """Paused in place, the update applies at once and the paused request finishes on its old KV
    state (SGLang's in-place mode); that state must not be cached for later requests."""

    async def go():
        async with EngineClient(fresh.url) as client:
            running = asyncio.ensure_future(client.generate(PROMPT, dict(GREEDY, max_new_tokens=200)))
            await until(lambda: generated(fresh) >= 8, "nothing was generated")
            await client.pause(mode="in_place")
            await asyncio.get_running_loop().run_in_executor(None, fresh.update_weights_from_tensors, weights[1], "1")
            await client.resume()
            first = await running
            again = await client.generate(PROMPT + first["output_ids"][:50], dict(GREEDY, max_new_tokens=4))
            return first, again

    first, again = run(go())
    assert first["meta_info"]["weight_version"] == "1" and len(first["output_ids"]) == 200
    assert again["meta_info"]["cached_tokens"] == 0
    assert len(fresh.scheduler.prefix_cache) == 1  # only the new request's own state


def test_memory_is_not_released_while_a_request_is_in_the_engine(fresh):
    """SGLang releases memory only when no request is in the engine: a request paused in place is, so
    the release is refused naming it and the request finishes untouched once generation continues."""
    reference = run(generate(fresh.url, PROMPT, max_new_tokens=64))["output_ids"]

    async def go():
        async with EngineClient(fresh.url) as client:
            running = asyncio.ensure_future(client.generate(PROMPT, dict(GREEDY, max_new_tokens=64)))
            await until(lambda: generated(fresh) >= 8, "nothing was generated")
            await client.pause("in_place")
            with pytest.raises(EngineRequestError, match="needs an idle engine: 1 request"):
                await client.release_memory_occupation()
            await client.resume()
            return await running

    result = run(go())
    assert result["output_ids"] == reference
    assert fresh.scheduler.memory()["released"] == [] and fresh.scheduler.memory()["weights_bytes"] > 0
