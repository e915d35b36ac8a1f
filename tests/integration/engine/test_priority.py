"""``--oldest-groups-first`` at the engine: each request carries its group's start version as SGLang's
``priority`` (negated: SGLang serves higher first), and the embedded engine admits the oldest group's
turns first, first come first served among equals, directly and behind sglang-router (which forwards
the field). Without the flag no request carries one and the order is arrival order; a request without
one comes after every request with one (SGLang's scheduler), and an evaluation's (``EVALUATION``) after
every training request. One engine that
decodes one request at a time, held by a long request while the queue fills, so the order is the
scheduler's alone. On the wire, a server on 127.0.0.1 records the bodies: the SGLang client asks for
-v, the vLLM client for v (vLLM serves lower first), and neither sends the field outside a group."""

import asyncio
import contextvars

import pytest
from engine_helpers import run
from http_helpers import json_server

from slime_mt.engine.clients.priority import EVALUATION, group_version, set_rank
from slime_mt.engine.clients.sglang import EngineClient
from slime_mt.engine.clients.vllm import VLLMClient
from slime_mt.engine.embedded.server import LocalEngine
from slime_mt.engine.launch import Router


@pytest.fixture(scope="module")
def engine(tiny_paths):
    with LocalEngine(tiny_paths["qwen2"], max_batch_size=1) as engine:
        yield engine


async def finish_order(url: str, engine: LocalEngine, versions: list[int | None]) -> list[int]:
    """Queue one request per entry of ``versions`` (its group's start version, None: not set), in
    order, behind a long request that holds the engine's one slot, then abort that one -> the indices
    in the order their answers came back."""
    client = EngineClient(url, [engine.url])
    params = {"max_new_tokens": 8, "ignore_eos": True, "temperature": 0.0}
    done: list[int] = []

    async def one(i: int, version: int | None) -> None:
        group_version.set(version)
        await client.generate(input_ids=[1, 2, 3 + i], sampling_params=params, return_logprob=False)
        done.append(i)

    async def state() -> dict:
        return (await client.server_info())[0]["internal_states"][0]

    async def until(key: str, count: int) -> None:
        while (await state())[key] < count:
            await asyncio.sleep(0.005)

    loop = asyncio.get_running_loop()
    try:
        blocker = loop.create_task(
            client.generate(input_ids=[1, 2], sampling_params={**params, "max_new_tokens": 512}, rid="blocker")
        )
        await until("#running_req", 1)
        tasks = []
        for i, version in enumerate(versions):  # one at a time: the engine's arrival order is this order
            tasks.append(loop.create_task(one(i, version), context=contextvars.copy_context()))
            await until("#queue_req", i + 1)
        await client.abort("blocker")
        assert (await blocker)["meta_info"]["finish_reason"]["type"] == "abort"
        await asyncio.gather(*tasks)
        return done
    finally:
        await client.close()


@pytest.mark.parametrize("through", ["direct", "router"])
def test_the_oldest_groups_requests_are_served_first(engine, through, tmp_path):
    router = None
    url = engine.url
    if through == "router":
        router = Router(tmp_path)
        router.add_worker(engine.url)
        url = router.url
    try:
        assert run(finish_order(url, engine, [2, 1, 2, 0, 1, 0])) == [3, 5, 1, 4, 0, 2]
        assert run(finish_order(url, engine, [None] * 6)) == [0, 1, 2, 3, 4, 5]
        assert run(finish_order(url, engine, [None, 1, EVALUATION, 0, None])) == [3, 1, 2, 0, 4]
    finally:
        if router is not None:
            router.stop()


ANSWERS = {
    "/generate": {"text": "", "output_ids": [5], "meta_info": {"id": "r", "finish_reason": {"type": "length"}}},
    "/inference/v1/generate": {"choices": [{"token_ids": [5], "finish_reason": "length", "text": ""}]},
}


@pytest.fixture(scope="module")
def recorder():
    with json_server(lambda path, body: ANSWERS[path]) as served:
        yield served


@pytest.mark.parametrize(("client_class", "sign"), [(EngineClient, -1), (VLLMClient, 1)])
def test_a_request_carries_its_groups_priority_in_the_engines_order(recorder, client_class, sign):
    url, bodies = recorder

    async def requests() -> None:
        client = client_class(url)
        try:
            for version in (None, 0, 3):
                context = contextvars.copy_context()
                if version is not None:
                    context.run(group_version.set, version)
                await asyncio.get_running_loop().create_task(
                    client.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 1}), context=context
                )
        finally:
            await client.close()

    bodies.clear()
    asyncio.run(requests())
    assert len(bodies) == 3
    assert "priority" not in bodies[0]
    assert [b["priority"] for b in bodies[1:]] == [0, sign * 3]


def test_a_trajectorys_rank_an_evaluations_last_where_the_engines_schedule_by_priority():
    """``set_rank``: an evaluation's requests rank last only where the engines schedule by priority (a
    server that does not may refuse a priority: vLLM's FCFS does); under --oldest-groups-first a group
    ranks by its start version; where an evaluation beside the rollout turned priorities on, every
    training request ranks 0 (one without a priority would come after the evaluation's)."""

    def rank(*args) -> int | None:
        context = contextvars.copy_context()
        context.run(set_rank, *args)
        return context.run(group_version.get)

    assert rank(False, False, 3, False) is None
    assert rank(False, False, 3, True) is None
    assert rank(True, False, 3, False) == 0
    assert rank(True, False, 3, True) == EVALUATION
    assert rank(True, True, 3, False) == 3
    assert rank(True, True, 3, True) == EVALUATION
