"""Weight updates in the middle of a turn (``--fully-async``): a real embedded engine over HTTP, the
client's UpdateGate, new weights pushed while the turn generates. With ``--partial-rollout`` the
turn keeps what it generated under version 0 and continues under version 1; without it the turn is
generated again. Text and VLM (the images go with the resumed call); with routing replay (the tiny
Qwen3-MoE, ~6 s) each route row keeps the version that routed it."""

import asyncio
import json

import httpx
import pytest
import torch
from rollout_helpers import make_ctx, picture

from slime_mt.algo.losses import off_policy_weights
from slime_mt.engine.clients.sglang import UPDATE_ABORT, EngineClient
from slime_mt.engine.clients.update_gate import UpdateGate
from slime_mt.engine.embedded.server import LocalEngine
from slime_mt.rollout.finalize import finalize
from slime_mt.rollout.multi_turn import run_episode
from slime_mt.rollout.staleness import route_staleness_metrics, route_versions
from slime_mt.routes import RouteLayout
from slime_mt.safetensors_files import load_hf_state
from slime_mt.types import Sample

BUDGET = 160
GREEDY = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": BUDGET}


def new_weights(path) -> dict:
    """Version 1: the model with its final norm scaled, so every log-prob moves, and (MoE) each router's
    rows shifted by one expert, so every route of the first MoE layer moves (expert e -> e - 1)."""
    named = load_hf_state(path)
    norm = next(k for k in named if k.endswith("model.norm.weight") or k == "model.language_model.norm.weight")
    named[norm] = named[norm] * 1.7
    for router in [k for k in named if k.endswith("mlp.gate.weight")]:
        named[router] = named[router].roll(1, dims=0)
    return named


def prompt_of(kind):
    if "vl" in kind:
        return [
            {
                "role": "user",
                "content": [{"type": "image", "image": picture(1)}, {"type": "text", "text": "Describe the shape."}],
            }
        ]
    return [{"role": "user", "content": "Count from one to a hundred."}]


def interrupted_episode(kind, path, partial, layout: RouteLayout | None = None):
    """One single-turn episode whose turn a weight update interrupts after >= 8 generated tokens (with
    the routes of ``layout``, R3) -> (ctx, sample, engine); the engine (now version 1) is left running
    for the caller to stop."""
    engine = LocalEngine(path, max_batch_size=4).start()
    ctx = make_ctx(
        engine.url,
        path,
        partial_rollout=partial,
        fully_async=True,
        max_turns=1,
        rollout_max_response_len=BUDGET,
        rollout_max_context_len=4096,
    )
    ctx.client.gate = UpdateGate()
    ctx.route_layout = layout
    named = new_weights(path)

    async def main():
        sample = Sample(index=0, group_index=0, prompt=prompt_of(kind))
        episode = asyncio.ensure_future(run_episode(ctx, sample, dict(GREEDY)))
        while engine.scheduler.load()["generated_tokens"] < 8:
            assert not episode.done(), sample.metadata
            await asyncio.sleep(0.002)
        await ctx.client.gate.close(ctx.client)
        await asyncio.get_running_loop().run_in_executor(None, lambda: engine.update_weights_from_tensors(named, "1"))
        await ctx.client.gate.open(ctx.client)
        return await episode

    try:
        return ctx, asyncio.run(main()), engine
    except BaseException:
        engine.stop()
        raise


async def call(url, ids, image_data=None, **params):
    async with EngineClient(url) as client:
        return await client.generate(ids, dict(GREEDY, **params), image_data=image_data)


async def score(url, ids, image_data=None):
    """The engine's log-probs of ``ids[1:]`` under its current weights."""
    async with EngineClient(url) as client:
        response = await client.generate(ids, {"max_new_tokens": 0}, image_data=image_data, logprob_start_len=0)
    return [lp for lp, *_ in response["meta_info"]["input_token_logprobs"][1:]]


@pytest.mark.parametrize("kind", ["qwen3", "qwen2.5-vl"])
def test_a_turn_resumed_across_a_weight_update_keeps_each_tokens_version_and_log_prob(tiny_paths, kind):
    path = tiny_paths[kind]
    ctx, sample, engine = interrupted_episode(kind, path, partial=True)
    try:
        sample.validate()
        assert len(sample.turns) == 1 and sample.metadata["termination"] == "engine_length"  # the whole budget
        assert sample.metadata["partial_resumes"] == 1
        first, second = ctx.client.calls
        assert first["response"]["meta_info"][UPDATE_ABORT] is True
        assert first["response"]["meta_info"]["weight_version"] == "0"
        assert second["response"]["meta_info"]["weight_version"] == "1"
        a, b = first["response"]["output_ids"], second["response"]["output_ids"]
        assert len(a) >= 8 and len(b) >= 1 and len(a) + len(b) == BUDGET
        assert sample.response_length == BUDGET
        assert sample.token_versions == [0] * len(a) + [1] * len(b)
        # the resumed call continued from the turn's tokens, with the same images and what was left of the budget
        assert second["input_ids"] == first["input_ids"] + a
        assert second["image_data"] == first["image_data"] and len(first["image_data"]) == ("vl" in kind)
        assert second["sampling_params"]["max_new_tokens"] == BUDGET - len(a)
        if "vl" in kind:
            assert sample.multimodal_train_inputs["image_grid_thw"].shape[0] == 1
        # every token is what the engine produced: the response's tokens and log-probs, call by call
        start = sample.prompt_length
        assert sample.tokens[start:] == a + b
        engine_logprobs = [
            lp for c in (first, second) for lp, *_ in c["response"]["meta_info"]["output_token_logprobs"]
        ]
        assert sample.rollout_log_probs == engine_logprobs
        # ... and what each version's greedy decoding gives from the same context
        images = first["image_data"] or None
        assert asyncio.run(call(engine.url, second["input_ids"], images, max_new_tokens=len(b)))["output_ids"] == b
        with LocalEngine(path, max_batch_size=2) as original:
            assert asyncio.run(call(original.url, first["input_ids"], images, max_new_tokens=len(a)))["output_ids"] == a

        # finalize carries the versions; the TIS weight of each token uses that token's behaviour log-prob
        for fmt in ("concat", "step_wise"):
            (train,), _ = finalize([sample], fmt, merge=False)
            assert train.token_versions == sample.token_versions
            assert train.rollout_log_probs == sample.rollout_log_probs
        old = torch.tensor(asyncio.run(score(engine.url, second["input_ids"] + b, images))[-BUDGET:])
        behaviour = torch.tensor(train.rollout_log_probs)
        mask = torch.ones(BUDGET)
        weights, keep, _ = off_policy_weights(
            old, behaviour, mask, torch.zeros(BUDGET, dtype=torch.long), 1, "token", 0.0, 1e9
        )
        assert torch.allclose(weights, torch.exp(old - behaviour), rtol=1e-5)
        assert torch.allclose(weights[len(a) :], torch.ones(len(b)), atol=2e-3)  # version 1 scored by version 1
        assert (weights[: len(a)] - 1).abs().max() > 0.05  # version 0 tokens against their own, older log-probs
    finally:
        engine.stop()


def routes_of(url, ids, layout: RouteLayout) -> torch.Tensor:
    """The engine's routes of every token of ``ids`` but the last, under its current weights."""
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "return_routed_experts": True}
    return layout.decode(httpx.post(f"{url}/generate", json=body, timeout=60).json()["meta_info"]["routed_experts"])


def test_routes_of_a_turn_resumed_across_a_weight_update_keep_the_version_that_routed_them(tiny_paths):
    """R3 with --partial-rollout on the tiny Qwen3-MoE, version 1 routing every token elsewhere: the
    rows the turn's first call returned are version 0's routing, the rest (from the last token before
    the update on) version 1's, and ``route_versions`` says which is which."""
    path = tiny_paths["qwen3-moe"]
    layout = RouteLayout.of(json.loads((path / "config.json").read_text()))
    ctx, sample, engine = interrupted_episode("qwen3-moe", path, partial=True, layout=layout)
    try:
        sample.validate()
        first, second = ctx.client.calls
        assert first["response"]["meta_info"][UPDATE_ABORT] is True and sample.metadata["partial_resumes"] == 1
        a, b = first["response"]["output_ids"], second["response"]["output_ids"]
        prompt = len(first["input_ids"])
        # the resumed call asked for the rows from the first call's last token (which it did not process) on
        assert second["response"]["meta_info"]["routed_experts_start_len"] == prompt + len(a) - 1
        routes = sample.routed_experts
        assert routes.shape == (len(sample.tokens) - 1, 1, 2)
        before = prompt + len(a) - 1  # rows of the tokens the first call processed
        assert route_versions(sample) == [0] * before + [1] * len(b)
        now = routes_of(engine.url, sample.tokens, layout)
        with LocalEngine(path, max_batch_size=2) as original:
            then = routes_of(original.url, sample.tokens, layout)
        assert now.shape == then.shape == routes.shape  # as SGLang: no row for the last token, even unsampled
        assert (now.sort(-1).values != then.sort(-1).values).any(-1).all()  # the versions route every token apart
        assert torch.equal(routes[:before], then[:before]) and torch.equal(routes[before:], now[before:])
        assert route_staleness_metrics([sample], 1) == {
            "rollout/route_version_gap_max": 1.0,
            "rollout/route_version_gap_mean": before / len(routes),
        }
    finally:
        engine.stop()


@pytest.mark.parametrize("kind", ["qwen3"])
def test_without_partial_rollout_an_interrupted_turn_is_generated_again(tiny_paths, kind):
    ctx, sample, engine = interrupted_episode(kind, tiny_paths[kind], partial=False)
    try:
        sample.validate()
        first, second = ctx.client.calls
        assert first["response"]["meta_info"][UPDATE_ABORT] is True and first["response"]["output_ids"]
        assert second["input_ids"] == first["input_ids"]  # the turn's context again, nothing kept
        assert second["sampling_params"]["max_new_tokens"] == BUDGET
        assert sample.metadata["regenerated_turns"] == 1 and "partial_resumes" not in sample.metadata
        assert sample.tokens[sample.prompt_length :] == second["response"]["output_ids"]
        assert sample.token_versions == [1] * BUDGET
    finally:
        engine.stop()


VLLM_BUDGET = 1500  # vLLM decodes the tiny model fast: a budget long enough for the update to land mid-turn


def _vllm_generated_tokens(url) -> float:
    """vLLM's count of tokens it has generated (its Prometheus metrics)."""
    import httpx

    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:generation_tokens_total"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("vllm:generation_tokens_total not in /metrics")


def test_on_vllm_a_turn_resumed_across_a_weight_update_keeps_each_segments_weights(vllm_target, tmp_path):
    """--fully-async --partial-rollout against a real vLLM server: the gate pauses vLLM (abort), the
    new weights load from disk mid-turn, the turn continues from its tokens; versions [0]*a + [1]*b,
    each segment is greedy decoding by its own weights, every log-prob is vLLM's."""
    from safetensors.torch import load_file, save_file

    from slime_mt.engine.clients.vllm import VLLMClient

    path = vllm_target.model_path
    served = load_file(str(path / "model.safetensors"))
    (tmp_path / "v0").mkdir()
    (tmp_path / "v1").mkdir()
    save_file(served, str(tmp_path / "v0" / "model.safetensors"))
    save_file(
        {k: v * 1.7 if k == "model.norm.weight" else v for k, v in served.items()},
        str(tmp_path / "v1" / "model.safetensors"),
    )
    ctx = make_ctx(
        vllm_target.url,
        path,
        engine="vllm",
        partial_rollout=True,
        fully_async=True,
        max_turns=1,
        rollout_max_response_len=VLLM_BUDGET,
        rollout_max_context_len=4096,
    )
    ctx.client.gate = UpdateGate()
    before = _vllm_generated_tokens(vllm_target.url)

    async def main():
        sample = Sample(index=0, group_index=0, prompt=prompt_of("qwen2"))
        episode = asyncio.ensure_future(run_episode(ctx, sample, dict(GREEDY, max_new_tokens=VLLM_BUDGET)))
        while _vllm_generated_tokens(vllm_target.url) - before < 8:
            assert not episode.done(), sample.metadata
            await asyncio.sleep(0.005)
        await ctx.client.gate.close(ctx.client)
        await ctx.client.update_weights_from_disk(str(tmp_path / "v1"), weight_version="1")
        await ctx.client.gate.open(ctx.client)
        return await episode

    async def greedy(ids, n):
        async with VLLMClient(vllm_target.url) as client:
            return (await client.generate(ids, dict(GREEDY, max_new_tokens=n)))["output_ids"]

    try:
        sample = asyncio.run(main())
        sample.validate()
        assert sample.metadata["partial_resumes"] == 1
        first, second = ctx.client.calls
        assert first["response"]["meta_info"][UPDATE_ABORT] is True
        assert first["response"]["meta_info"]["weight_version"] == "0"
        assert second["response"]["meta_info"]["weight_version"] == "1"
        a, b = first["response"]["output_ids"], second["response"]["output_ids"]
        assert len(a) >= 8 and len(b) >= 1 and len(a) + len(b) == VLLM_BUDGET
        assert sample.token_versions == [0] * len(a) + [1] * len(b)
        assert second["input_ids"] == first["input_ids"] + a
        assert sample.tokens[sample.prompt_length :] == a + b
        engine_logprobs = [
            lp for c in (first, second) for lp, *_ in c["response"]["meta_info"]["output_token_logprobs"]
        ]
        assert sample.rollout_log_probs == engine_logprobs
        assert asyncio.run(greedy(second["input_ids"], len(b))) == b  # version 1's greedy decoding
    finally:
        asyncio.run(VLLMClient(vllm_target.url).update_weights_from_disk(str(tmp_path / "v0"), weight_version="0"))
    assert asyncio.run(greedy(first["input_ids"], len(a))) == a  # version 0's, the weights put back
