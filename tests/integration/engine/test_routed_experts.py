"""The embedded engine returns routed experts as SGLang does (integration tier, ~10 s: one MoE engine with
its prefix cache on, transformers' own router logits as the reference). Rows cover tokens
[routed_experts_start_len, prompt + output - 1); requests decoded in one batch each get their own rows;
a prefix served from the cache reports the routes it was computed with; a request that samples nothing
has no row for its last token; an aborted request keeps the rows of what it processed; a dense model
and a start past the prompt are refused by name."""

import asyncio
import json

import httpx
import pytest
import torch
from engine_helpers import run
from transformers import AutoModelForCausalLM

from slime_mt.engine.clients.sglang import EngineClient
from slime_mt.engine.embedded.server import LocalEngine
from slime_mt.routes import RouteLayout

PROMPTS = [[9707, 1879, 11, 1128, 525, 498, 30], [40, 1079, 264, 3460, 13], [3838, 374, 220, 17, 10, 17, 30, 1207]]


@pytest.fixture(scope="module")
def moe(tiny_paths):
    path = tiny_paths["qwen3-moe"]
    with LocalEngine(path, max_batch_size=4, cache_tokens=4096) as engine:
        model = AutoModelForCausalLM.from_pretrained(str(path), experts_implementation="eager").eval()
        yield engine, model, RouteLayout.of(json.loads((path / "config.json").read_text()))


def _reference(model, layout: RouteLayout, tokens: list[int]) -> torch.Tensor:
    """transformers' routing of every token: the top k of each MoE layer's router logits, as a set."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens]), output_router_logits=True).router_logits
    per_layer = [lg.topk(layout.top_k, dim=-1).indices for lg in logits if lg is not None]
    return torch.stack(per_layer, 1).sort(-1).values  # [tokens, moe_layers, k]


def _same(rows: torch.Tensor, reference: torch.Tensor) -> bool:
    return rows.shape == reference.shape and torch.equal(rows.long().sort(-1).values, reference)


def _body(ids, **extra):
    sampling = {"temperature": 1.0, "max_new_tokens": 7, "ignore_eos": True, "sampling_seed": 11}
    return {
        "input_ids": ids,
        "return_logprob": True,
        "return_routed_experts": True,
        "sampling_params": sampling,
        **extra,
    }


def test_batched_requests_each_get_their_rows_and_a_next_turn_from_the_cache_appends_its_own(moe):
    engine, model, layout = moe

    async def go():
        async with EngineClient(engine.url) as client:
            batch = asyncio.gather(
                *(client.generate(p, _body(p)["sampling_params"], return_routed_experts=True) for p in PROMPTS)
            )
            running = 0
            while not batch.done():  # they decode in one batch: rows of one forward pass split per request
                running = max(running, engine.scheduler.load()["#running_req"])
                await asyncio.sleep(0.002)
            first = await batch
            turns = []
            for prompt, answer in zip(PROMPTS, first):
                context = prompt + answer["output_ids"] + [198, 13]
                start = len(prompt) + len(answer["output_ids"]) - 1
                turns.append(
                    await client.generate(
                        context,
                        _body(context)["sampling_params"],
                        return_routed_experts=True,
                        routed_experts_start_len=start,
                    )
                )
            return first, turns, running

    first, turns, running = run(go())
    assert running >= 2
    for prompt, answer, turn in zip(PROMPTS, first, turns):
        meta = answer["meta_info"]
        rows = layout.decode(meta["routed_experts"])
        assert meta["routed_experts_start_len"] == 0 and rows.dtype == torch.uint8
        sequence = prompt + answer["output_ids"]
        assert len(rows) == len(sequence) - 1  # the last token was sampled, never processed
        assert _same(rows, _reference(model, layout, sequence[:-1]))
        # the next turn reused the cached prefix and returns only the rows past the held ones
        context = sequence + [198, 13]
        assert turn["meta_info"]["cached_tokens"] == len(sequence) - 1
        more = layout.decode(turn["meta_info"]["routed_experts"])
        whole = context + turn["output_ids"]
        assert len(rows) + len(more) == len(whole) - 1
        assert _same(torch.cat([rows, more]), _reference(model, layout, whole[:-1]))


def test_the_wire_holds_every_layer_with_no_expert_in_dense_ones(moe):
    engine, _, layout = moe
    meta = httpx.post(f"{engine.url}/generate", json=_body(PROMPTS[0]), timeout=60).json()["meta_info"]
    import base64

    import numpy as np

    raw = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32).reshape(-1, layout.num_layers, 2)
    assert layout.num_layers == 2 and layout.moe_layers == (0,)
    assert (raw[:, 1] == -1).all() and (raw[:, 0] >= 0).all() and (raw[:, 0] < 8).all()


def test_a_request_that_samples_nothing_gets_no_row_for_its_last_token(moe):
    """``max_new_tokens`` 0: the prefill processed every prompt token, but SGLang's rows stop at
    ``seqlen - 1`` (seqlen = prompt + output tokens) all the same."""
    engine, model, layout = moe
    body = _body(PROMPTS[2], sampling_params={"max_new_tokens": 0}, routed_experts_start_len=2)
    meta = httpx.post(f"{engine.url}/generate", json=body, timeout=60).json()["meta_info"]
    rows = layout.decode(meta["routed_experts"])
    assert meta["routed_experts_start_len"] == 2 and len(rows) == len(PROMPTS[2]) - 1 - 2
    assert _same(rows, _reference(model, layout, PROMPTS[2])[2:-1])


def test_an_aborted_request_keeps_the_rows_of_what_it_processed(moe):
    engine, model, layout = moe

    async def go():
        async with EngineClient(engine.url) as client:
            long = {"temperature": 1.0, "max_new_tokens": 500, "ignore_eos": True, "sampling_seed": 5}
            pending = asyncio.ensure_future(client.generate(PROMPTS[2], long, return_routed_experts=True))
            while engine.scheduler.load()["generated_tokens"] == 0 or not engine.scheduler.load()["#running_req"]:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)
            await client.abort(abort_all=True)
            return await pending

    partial = run(go())
    assert partial["meta_info"]["finish_reason"]["type"] == "abort"
    sequence = PROMPTS[2] + partial["output_ids"]
    rows = layout.decode(partial["meta_info"]["routed_experts"])
    assert 0 < len(partial["output_ids"]) < 500 and len(rows) == len(sequence) - 1
    assert _same(rows, _reference(model, layout, sequence[:-1]))


def test_routes_are_refused_by_name_past_the_prompt_and_on_a_dense_model(moe, tiny_paths):
    engine, _, _ = moe
    past = httpx.post(f"{engine.url}/generate", json=_body(PROMPTS[0], routed_experts_start_len=8), timeout=60)
    assert past.status_code == 400 and "routed_experts_start_len=8 is past the 7 input tokens" in past.text
    negative = httpx.post(f"{engine.url}/generate", json=_body(PROMPTS[0], routed_experts_start_len=-1), timeout=60)
    assert negative.status_code == 400 and "routed_experts_start_len must be an integer >= 0" in negative.text
    with LocalEngine(tiny_paths["qwen2"]) as dense:
        refused = httpx.post(f"{dense.url}/generate", json=_body(PROMPTS[0]), timeout=60)
    assert refused.status_code == 400 and "has no experts" in refused.text


def test_behind_sglang_router_routes_are_asked_of_the_trajectorys_own_worker(tiny_paths, tmp_path):
    """sglang-router 0.3.2 drops return_routed_experts from the body it forwards (its response has
    none); the client asks a trajectory's routes of its worker directly, the same worker each time."""
    from slime_mt.engine.launch import Router

    path = tiny_paths["qwen3-moe"]
    layout = RouteLayout.of(json.loads((path / "config.json").read_text()))
    with LocalEngine(path) as first, LocalEngine(path) as second:
        router = Router(tmp_path)
        try:
            for engine in (first, second):
                router.add_worker(engine.url)
            through = httpx.post(f"{router.url}/generate", json=_body(PROMPTS[0]), timeout=60).json()
            assert "routed_experts" not in through["meta_info"]  # what the router does with the field

            async def go():
                async with EngineClient(router.url, [first.url, second.url]) as client:
                    sampling = _body(PROMPTS[0])["sampling_params"]
                    return [
                        await client.generate(PROMPTS[0], sampling, route=route, return_routed_experts=True)
                        for route in ("trajectory-a", "trajectory-a", "trajectory-b", "trajectory-b")
                    ]

            served = [e.scheduler.finished_requests for e in (first, second)]
            answers = run(go())
            served = [e.scheduler.finished_requests - s for e, s in zip((first, second), served)]
        finally:
            router.stop()
    for answer in answers:
        rows = layout.decode(answer["meta_info"]["routed_experts"])
        assert len(rows) == len(PROMPTS[0]) + len(answer["output_ids"]) - 1
    assert sorted(served) in ([0, 4], [2, 2])  # each trajectory on one worker, whichever it hashes to
