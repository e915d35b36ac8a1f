"""The embedded engine's prefix cache (``--engine-cache-tokens``): the cache's own rules on real
tensors, then a real SmolLM2 engine over HTTP: an 8-turn episode reuses the whole previous context
on every turn and generates exactly what the uncached engine does; an aborted turn resumes from the
tokens it generated; a weight update and ``/flush_cache`` invalidate it."""

import asyncio

import pytest
import torch
from engine_helpers import run

from slime_mt.engine.clients.sglang import EngineClient
from slime_mt.engine.embedded.server import LocalEngine

GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def engines(smollm2_path):
    """The same model with the prefix cache on and off."""
    cached = LocalEngine(smollm2_path, max_batch_size=8, cache_tokens=4096).start()
    plain = LocalEngine(smollm2_path, max_batch_size=8).start()
    yield cached, plain
    cached.stop()
    plain.stop()


def observation_ids(tokenizer, turn: int) -> list[int]:
    """A user message after an assistant turn, as a multi-turn rollout appends it."""
    text = f"\n<|im_start|>user\nTurn {turn}: the grid moved. What next?<|im_end|>\n<|im_start|>assistant\n"
    return tokenizer(text, add_special_tokens=False)["input_ids"]


async def episode(url: str, tokenizer, turns: int = 8) -> list[dict]:
    prompt = tokenizer(
        "<|im_start|>user\nPlay the grid game.<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )["input_ids"]
    out = []
    async with EngineClient(url) as client:
        for turn in range(turns):
            answer = await client.generate(prompt, {**GREEDY, "max_new_tokens": 12}, return_logprob=True)
            out.append({"prompt": list(prompt), **answer})
            prompt = prompt + answer["output_ids"] + observation_ids(tokenizer, turn)
    return out


def test_an_8_turn_episode_reuses_the_previous_context_and_generates_the_same_tokens(engines):
    from transformers import AutoTokenizer

    cached, plain = engines
    tokenizer = AutoTokenizer.from_pretrained(cached.model_path)
    with_cache = run(episode(cached.url, tokenizer))
    without = run(episode(plain.url, tokenizer))
    assert [t["output_ids"] for t in with_cache] == [t["output_ids"] for t in without]  # greedy: identical
    assert with_cache[0]["meta_info"]["cached_tokens"] == 0
    for before, turn in zip(with_cache, with_cache[1:]):
        # everything the previous turn computed: its prompt and its output but the last token (sampled,
        # never fed back), as SGLang's radix cache counts it
        assert turn["meta_info"]["cached_tokens"] == len(before["prompt"]) + len(before["output_ids"]) - 1
    assert all(t["meta_info"]["cached_tokens"] == 0 for t in without)
    for a, b in zip(with_cache, without):  # the reused state gives the same log-probs, to rounding
        got = torch.tensor([x[0] for x in a["meta_info"]["output_token_logprobs"]])
        want = torch.tensor([x[0] for x in b["meta_info"]["output_token_logprobs"]])
        assert torch.allclose(got, want, atol=1e-4), (got, want)


def test_an_aborted_turn_resumes_from_its_tokens_and_updates_invalidate(engines):
    cached, _ = engines
    prompt = [1, 504, 3458, 282, 260, 1345, 30, 198]

    async def go():
        async with EngineClient(cached.url) as client:
            first = asyncio.ensure_future(
                client.generate(prompt, {**GREEDY, "max_new_tokens": 400, "ignore_eos": True})
            )
            while cached.scheduler.load()["generated_tokens"] == 0 or not cached.scheduler.load()["#running_req"]:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)
            await client.abort(abort_all=True)
            partial = await first
            resumed = await client.generate(prompt + partial["output_ids"], {**GREEDY, "max_new_tokens": 4})
            cached.update_weights_from_tensors({}, weight_version="after-update")
            after_update = await client.generate(prompt + partial["output_ids"], {**GREEDY, "max_new_tokens": 4})
            again = await client.generate(prompt + partial["output_ids"], {**GREEDY, "max_new_tokens": 4})
            await client.flush_cache()
            flushed = await client.generate(prompt + partial["output_ids"], {**GREEDY, "max_new_tokens": 4})
            return partial, resumed, after_update, again, flushed

    partial, resumed, after_update, again, flushed = run(go())
    assert partial["meta_info"]["finish_reason"]["type"] == "abort"
    generated = len(partial["output_ids"])
    assert 0 < generated < 400
    assert resumed["meta_info"]["cached_tokens"] == len(prompt) + generated - 1
    assert (
        after_update["meta_info"]["cached_tokens"] == 0
        and after_update["meta_info"]["weight_version"] == "after-update"
    )
    assert again["meta_info"]["cached_tokens"] == len(prompt) + generated - 1  # from the request before it
    assert flushed["meta_info"]["cached_tokens"] == 0
    assert resumed["output_ids"] == after_update["output_ids"] == flushed["output_ids"]


def test_behind_the_cache_aware_router_every_turn_finds_its_prefix(tiny_paths, tmp_path):
    """Two cached engines behind the real sglang-router with the run's default policy (cache_aware):
    six concurrent 4-turn trajectories; every turn after the first lands on the worker that holds
    its previous context, and both workers serve trajectories."""
    from slime_mt.config import EngineConfig
    from slime_mt.engine.launch import start_engines

    cfg = EngineConfig(num_engines=2, engine_cache_tokens=100_000)
    group = start_engines(cfg, str(tiny_paths["qwen2"]), tmp_path)

    async def trajectory(client, k):
        ids, cached, expected = [100 + 7 * k + i for i in range(30)], [], [0]
        for _ in range(4):
            response = await client.generate(ids, {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True})
            cached.append(response["meta_info"]["cached_tokens"])
            expected.append(len(ids) + len(response["output_ids"]) - 1)  # all but the last sampled token
            ids = ids + response["output_ids"] + [11, 12, 13]
        return cached, expected[:4]

    async def main():
        async with EngineClient(group.url, group.worker_urls) as client:
            return await asyncio.gather(*(trajectory(client, k) for k in range(6)))

    try:
        assert cfg.sglang_router_policy == "cache_aware" and group.url not in group.worker_urls
        for cached, expected in run(main()):
            assert cached == expected
        served = [engine.scheduler.load()["#finished_req"] for engine in group.local_engines]
        assert min(served) > 0 and sum(served) == 24
    finally:
        group.stop()
