"""The engine's numbers are the model's numbers: sampled log-probs equal a teacher-forced forward,
and greedy outputs equal ``model.generate``."""

import asyncio

import pytest
import torch
from engine_helpers import data_uri, diagram, run
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

from slime_mt.engine.clients.sglang import EngineClient
from slime_mt.engine.embedded.server import LocalEngine
from slime_mt.engine.protocol import collapse_image_pads
from slime_mt.processing import load_tokenizer_or_processor

TEMPERATURE = 0.7


def teacher_forced_logprobs(model, ids: list[int], n_out: int, temperature: float, **vision) -> list[float]:
    """log_softmax(logits / T) of each output token given everything before it, one forward pass."""
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **vision).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    positions = range(len(ids) - n_out - 1, len(ids) - 1)
    return [float(logp[p, ids[p + 1]]) for p in positions]


def chat_ids(tokenizer, question: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.fixture(scope="module")
def smollm2_engine(smollm2_path):
    with LocalEngine(smollm2_path, max_batch_size=8, seed=3) as engine:
        yield engine


@pytest.mark.parametrize("temperature", [1.0, TEMPERATURE])
@pytest.mark.parametrize("model", ["smollm2", "qwen2", "vllm"])
def test_text_logprobs_equal_teacher_forcing(
    model, temperature, smollm2_engine, smollm2_path, farm, tiny_paths, request
):
    if model == "smollm2":
        client, path = EngineClient(smollm2_engine.url), smollm2_path
    else:
        target = (
            request.getfixturevalue("vllm_target")
            if model == "vllm"
            else farm.target("text-direct", tiny_paths["qwen2"])
        )
        client, path = target.client(), target.model_path
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    prompts = [chat_ids(tokenizer, q) for q in ("Name a prime number.", "What is 12 times 7?", "Say hi.")]

    async def go():
        async with client:
            return await asyncio.gather(
                *(
                    client.generate(p, {"max_new_tokens": 24, "temperature": temperature, "sampling_seed": 11 + i})
                    for i, p in enumerate(prompts)
                )
            )

    outs = run(go())
    worst = 0.0
    for prompt, out in zip(prompts, outs):
        engine_lp = [x[0] for x in out["meta_info"]["output_token_logprobs"]]
        ref = teacher_forced_logprobs(hf, prompt + out["output_ids"], len(out["output_ids"]), temperature)
        worst = max(worst, max(abs(a - b) for a, b in zip(engine_lp, ref)))
    assert worst < 1e-4


@pytest.mark.parametrize("kind", ["qwen2.5-vl", "qwen3-vl"])
def test_vlm_logprobs_equal_teacher_forcing(kind, tiny_paths):
    path = tiny_paths[kind]
    processor = load_tokenizer_or_processor(path)
    hf = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32).eval()
    images = [diagram(5), diagram(6, (64, 112))]
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Find x and"}, {"type": "image"}]}],
        add_generation_prompt=True,
    )
    inputs = processor(text=text, images=images)
    expanded = inputs["input_ids"][0].tolist()
    engine_ids, _ = collapse_image_pads(expanded, processor.image_token_id)

    async def go(url):
        async with EngineClient(url) as client:
            return await asyncio.gather(
                *(
                    client.generate(
                        engine_ids,
                        {"max_new_tokens": 12, "temperature": TEMPERATURE, "sampling_seed": s, "ignore_eos": True},
                        image_data=[data_uri(i) for i in images],
                    )
                    for s in (1, 2)
                )
            )

    with LocalEngine(path, max_batch_size=4) as engine:
        outs = run(go(engine.url))
    for out in outs:
        ids = expanded + out["output_ids"]
        mm = (torch.tensor([ids]) == processor.image_token_id).long()
        ref = teacher_forced_logprobs(
            hf,
            ids,
            len(out["output_ids"]),
            TEMPERATURE,
            pixel_values=inputs["pixel_values"],
            image_grid_thw=inputs["image_grid_thw"],
            mm_token_type_ids=mm,
        )
        engine_lp = [x[0] for x in out["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(engine_lp, ref)) < 1e-4


def test_greedy_equals_model_generate(smollm2_engine, smollm2_path):
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_path))
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_path), dtype=torch.float32).eval()
    questions = ["What is the capital of France?", "List three colors.", "What is 2+2?", "Who wrote Hamlet?"]
    prompts = [chat_ids(tokenizer, q) for q in questions]

    async def go():
        async with EngineClient(smollm2_engine.url) as client:
            return await asyncio.gather(
                *(client.generate(p, {"max_new_tokens": 24, "temperature": 0.0}) for p in prompts)
            )

    outs = run(go())  # concurrent: decoded together in one batch
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt) :].tolist()
        assert out["output_ids"] == ref
    assert "Paris" in outs[0]["text"]


def test_vlm_text_only_prompt_matches_generate(tiny_paths):
    path = tiny_paths["qwen3-vl"]
    processor = load_tokenizer_or_processor(path)
    hf = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32).eval()
    text = processor.apply_chat_template([{"role": "user", "content": "No picture today."}], add_generation_prompt=True)
    ids = processor(text=text)["input_ids"][0].tolist()

    async def go(url):
        async with EngineClient(url) as client:
            return await client.generate(ids, {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True})

    with LocalEngine(path, max_batch_size=2) as engine:
        out = run(go(engine.url))
    with torch.no_grad():
        ref = hf.generate(
            input_ids=torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=10,
            do_sample=False,
        )[0, len(ids) :].tolist()
    assert out["output_ids"][: len(ref)] == ref
