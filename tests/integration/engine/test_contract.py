"""The same client code against the embedded engine, directly and behind the real sglang-router."""

import asyncio
import math

import pytest
import torch
from engine_helpers import data_uri, diagram, run
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from slime_mt.engine.protocol import collapse_image_pads
from slime_mt.processing import load_tokenizer_or_processor

PROMPT = [9707, 1879, 11, 1128, 525, 498, 30]  # "Hello world, how are you?"
GREEDY = {"temperature": 0.0}


async def _greedy(client, ids=PROMPT, n=8, **extra):
    return await client.generate(ids, {**GREEDY, "max_new_tokens": n, **extra})


def test_single_request(text_target):
    async def go():
        async with text_target.client() as client:
            return await _greedy(client)

    out = run(go())
    meta = out["meta_info"]
    assert len(out["output_ids"]) == 8 == meta["completion_tokens"]
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["prompt_tokens"] == len(PROMPT)
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(lp <= 0 for lp, _, _ in meta["output_token_logprobs"])
    assert meta["weight_version"] == "0"


def test_batched_request_equals_single_requests(text_target):
    prompts = [PROMPT, PROMPT[:3], [151644, 872, 198, 9707]]

    async def go():
        async with text_target.client() as client:
            batch = await client.generate_batch(prompts, {**GREEDY, "max_new_tokens": 6})
            singles = [await _greedy(client, p, 6) for p in prompts]
            return batch, singles

    batch, singles = run(go())
    assert isinstance(batch, list) and len(batch) == 3
    assert [b["output_ids"] for b in batch] == [s["output_ids"] for s in singles]


def test_concurrent_requests_equal_sequential(text_target):
    prompts = [PROMPT[: k + 2] for k in range(6)]

    async def go():
        async with text_target.client() as client:
            together = await asyncio.gather(*(_greedy(client, p, 10) for p in prompts))
            alone = [await _greedy(client, p, 10) for p in prompts]
            return together, alone

    together, alone = run(go())
    assert [t["output_ids"] for t in together] == [a["output_ids"] for a in alone]
    for t, a in zip(together, alone):
        lp_t = [x[0] for x in t["meta_info"]["output_token_logprobs"]]
        lp_a = [x[0] for x in a["meta_info"]["output_token_logprobs"]]
        assert max(abs(x - y) for x, y in zip(lp_t, lp_a)) < 1e-4


def test_stop_string_trims_text(text_target):
    async def go():
        async with text_target.client() as client:
            free = await _greedy(client, n=12)
            tokenizer = load_tokenizer_or_processor(text_target.model_path)
            pieces = [tokenizer.decode(free["output_ids"][:k]) for k in range(1, 13)]
            # a stop string completed by the 4th token: the 4th token's own text
            stop = pieces[3][len(pieces[2]) :].strip() or pieces[3]
            stopped = await _greedy(client, n=12, stop=[stop])
            return free, stop, stopped

    free, stop, stopped = run(go())
    meta = stopped["meta_info"]
    assert meta["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in stopped["text"]
    assert stopped["output_ids"] == free["output_ids"][: len(stopped["output_ids"])]
    assert len(stopped["output_ids"]) <= 4


def test_stop_token_ids(text_target):
    async def go():
        async with text_target.client() as client:
            free = await _greedy(client, n=10)
            stop_id = free["output_ids"][2]
            return free, stop_id, await _greedy(client, n=10, stop_token_ids=[stop_id])

    free, stop_id, stopped = run(go())
    first = free["output_ids"].index(stop_id)
    assert stopped["output_ids"] == free["output_ids"][: first + 1]  # the stop token is kept in output_ids
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}


def test_max_new_tokens_gives_length(text_target):
    async def go():
        async with text_target.client() as client:
            return await client.generate(PROMPT, {"max_new_tokens": 3, "temperature": 1.0, "ignore_eos": True})

    out = run(go())
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    assert len(out["output_ids"]) == 3


def test_abort_gives_abort(text_target):
    async def go():
        async with text_target.client() as client:
            task = asyncio.create_task(
                client.generate(PROMPT, {"max_new_tokens": 3000, "ignore_eos": True}, rid="to-abort")
            )
            await asyncio.sleep(1.0)
            await client.abort("to-abort")
            return await task

    out = run(go())
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(out["output_ids"]) < 3000


def test_pause_and_continue_lose_no_request(text_target):
    async def go():
        async with text_target.client() as client:
            tasks = [
                asyncio.create_task(
                    client.generate(PROMPT, {"max_new_tokens": 30, "ignore_eos": True, "sampling_seed": i})
                )
                for i in range(8)
            ]
            await asyncio.sleep(0.3)
            await client.pause(mode="in_place")
            await asyncio.sleep(0.3)
            paused = await client.paused()
            paused_done = sum(t.done() for t in tasks)
            await asyncio.sleep(0.7)
            still_done = sum(t.done() for t in tasks)
            await client.resume()
            results = await asyncio.gather(*tasks)
            return paused, paused_done, still_done, results

    paused, paused_done, still_done, results = run(go())
    assert all(paused) and len(paused) == len(text_target.workers)
    assert paused_done == still_done  # nothing progressed while paused
    assert all(r["meta_info"]["finish_reason"] == {"type": "length", "length": 30} for r in results)


def test_weight_update_from_disk_changes_outputs_and_version(text_target, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(str(text_target.model_path))
    original = {k: v.clone().contiguous() for k, v in model.state_dict().items()}
    torch.manual_seed(1)
    perturbed = {k: (v + 0.5 * torch.randn_like(v)).contiguous() for k, v in original.items() if k != "lm_head.weight"}
    (tmp_path / "new").mkdir()
    (tmp_path / "old").mkdir()
    save_file(perturbed, str(tmp_path / "new" / "model.safetensors"))
    save_file({k: v for k, v in original.items() if k != "lm_head.weight"}, str(tmp_path / "old" / "model.safetensors"))

    async def go():
        async with text_target.client() as client:
            before = await _greedy(client)
            unversioned = await client.update_weights_from_disk(str(tmp_path / "old"))  # SGLang: version kept
            answers = await client.update_weights_from_disk(str(tmp_path / "new"), weight_version="1")
            after = await _greedy(client)
            await client.update_weights_from_disk(str(tmp_path / "old"), weight_version="restored")
            restored = await _greedy(client)
            return before, unversioned, answers, after, restored

    before, unversioned, answers, after, restored = run(go())
    assert [a["weight_version"] for a in unversioned] == ["0"] * len(text_target.workers)
    assert all(a["success"] for a in answers) and len(answers) == len(text_target.workers)
    assert after["output_ids"] != before["output_ids"]
    assert before["meta_info"]["weight_version"] == "0" and after["meta_info"]["weight_version"] == "1"
    assert restored["output_ids"] == before["output_ids"]
    assert restored["meta_info"]["weight_version"] == "restored"
    # leave the shared engines at version 0 for later tests
    run(text_target.client().update_weights_from_disk(str(tmp_path / "old"), weight_version="0"))


def test_image_requests_expand_one_pad_per_image(vl_target):
    processor = load_tokenizer_or_processor(vl_target.model_path)
    images = [diagram(1), diagram(2, (120, 64))]
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Compare"}, {"type": "image"}]}
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    expanded = processor(text=text, images=images)["input_ids"][0].tolist()
    engine_ids, counts = collapse_image_pads(expanded, processor.image_token_id)
    assert counts == [math.prod(r) // 4 for r in processor.image_processor(images=images)["image_grid_thw"].tolist()]

    async def go():
        async with vl_target.client() as client:
            out = await client.generate(
                engine_ids, {**GREEDY, "max_new_tokens": 5}, image_data=[data_uri(i) for i in images]
            )
            batch = await client.generate_batch(
                [engine_ids, engine_ids[:]],
                {**GREEDY, "max_new_tokens": 5},
                image_data=[[data_uri(i) for i in images]] * 2,
            )
            swapped = await client.generate(
                engine_ids, {**GREEDY, "max_new_tokens": 5}, image_data=[data_uri(images[1]), data_uri(images[0])]
            )
            return out, batch, swapped

    out, batch, swapped = run(go())
    assert out["meta_info"]["prompt_tokens"] == len(expanded)
    assert [b["output_ids"] for b in batch] == [out["output_ids"]] * 2
    # the images reach the model: swapping them changes the log-probs
    lp = [x[0] for x in out["meta_info"]["output_token_logprobs"]]
    lp_swapped = [x[0] for x in swapped["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(lp, lp_swapped)) > 1e-5


def test_expanded_pads_are_rejected(vl_target):
    processor = load_tokenizer_or_processor(vl_target.model_path)
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}]}], add_generation_prompt=True)
    expanded = processor(text=text, images=[diagram(3)])["input_ids"][0].tolist()
    from slime_mt.errors import EngineRequestError

    async def go():
        async with vl_target.client() as client:
            await client.generate(expanded, {"max_new_tokens": 2}, image_data=[data_uri(diagram(3))])

    with pytest.raises(EngineRequestError, match="send ONE pad per image"):
        run(go())


def test_router_spreads_load_over_workers(farm, tiny_paths):
    target = farm.target("text-router", tiny_paths["qwen2"])

    async def go():
        async with target.client() as client:
            before = [s["internal_states"][0]["#finished_req"] for s in await client.server_info()]
            await asyncio.gather(*(_greedy(client, n=2) for _ in range(6)))
            after = [s["internal_states"][0]["#finished_req"] for s in await client.server_info()]
            return before, after

    before, after = run(go())
    served = [a - b for a, b in zip(after, before)]
    assert sum(served) == 6 and all(n > 0 for n in served)  # round robin used both workers
