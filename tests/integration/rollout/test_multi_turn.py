"""Token fidelity of multi-turn episodes against the embedded engine, per tokenizer/template.

Invariant: the sample's tokens are exactly the prompt, then for each turn what the engine generated
followed by the delta-encoded observation; loss mask 1 exactly on generated tokens; log-probs equal
the engine's. For prefix-stable templates the tokens also render the final conversation.
"""

import asyncio
import math

import pytest
import torch
from rollout_helpers import ScriptedEnv, make_ctx, picture

from slime_mt.engine.protocol import collapse_image_pads
from slime_mt.rollout.finalize import finalize
from slime_mt.rollout.multi_turn import run_episode
from slime_mt.types import Sample, Status

# ids that end a turn for the random tiny models: ~6% of the vocabulary plus <|im_end|>
RANDOM_STOPS = list(range(3, 151643, 16)) + [151645]


CASES = {
    # name: (model, prompt, observations, stop ids, prefix-stable template)
    "qwen2.5": (
        "qwen2",
        [{"role": "user", "content": "Solve 3x = 12. Use the tool."}],
        [{"text": "Tool says: x is 4"}, {"text": "Please give the final answer."}],
        RANDOM_STOPS,
        True,
    ),
    "qwen3": (
        "qwen3",
        [
            {"role": "user", "content": "Earlier question"},
            {"role": "assistant", "content": "<think>\nfirst thoughts\n</think>\n\nEarlier answer"},
            {"role": "user", "content": "Think step by step: 2+5?"},
        ],
        [{"text": "Wrong, think again."}, {"text": "Closer."}],
        RANDOM_STOPS,
        False,
    ),
    "smollm2": (
        "smollm2",
        [{"role": "user", "content": "Name one color. Answer with one word."}],
        [{"text": "Name another color, one word."}, {"text": "And one more, one word."}],
        None,
        True,
    ),
    # the same conversation on a real vLLM server (the tiny Qwen2 at head size 64)
    "qwen2.5-vllm": (
        "vllm",
        [{"role": "user", "content": "Solve 3x = 12. Use the tool."}],
        [{"text": "Tool says: x is 4"}, {"text": "Please give the final answer."}],
        RANDOM_STOPS,
        True,
    ),
    "qwen2.5-vl": (
        "qwen2.5-vl",
        [
            {
                "role": "user",
                "content": [{"type": "image", "image": picture(1)}, {"type": "text", "text": "What shape is this?"}],
            }
        ],
        [{"text": "Look at this one too.", "images": [picture(2)]}, {"text": "And this.", "images": [picture(3)]}],
        RANDOM_STOPS,
        True,
    ),
}


@pytest.fixture(scope="module")
def engines(farm, tiny_paths, smollm2_path, request):
    paths = dict(tiny_paths, smollm2=smollm2_path)

    def target(model):
        if model == "vllm":
            return request.getfixturevalue("vllm_target")
        return farm.target(f"{model.replace('-', '')}-direct", paths[model])

    return target


@pytest.mark.parametrize("name", list(CASES))
def test_episode_tokens_are_engine_outputs_plus_observation_deltas(name, engines):
    model, prompt, observations, stops, prefix_stable = CASES[name]
    target = engines(model)
    ctx = make_ctx(
        target.url,
        target.model_path,
        engine=target.engine,
        max_turns=4,
        rollout_max_response_len=48,
        rollout_max_context_len=4096,
        rollout_temperature=0.6,
        rollout_stop_token_ids=stops,
    )
    env = ScriptedEnv(observations, done_after=3)
    sample = Sample(index=0, group_index=0, prompt=prompt)
    # seeded: what an unseeded request samples on a shared server depends on the requests served before
    sampling = {**ctx.sampling_params(), "sampling_seed": 0}
    asyncio.run(run_episode(ctx, sample, sampling, env=env))
    sample.validate()
    assert sample.status == Status.COMPLETED, sample.metadata
    assert len(sample.turns) == 3 and len(env.steps) == 3

    calls = ctx.client.calls
    encoder = ctx.encoder()
    image_id = getattr(ctx.processor, "image_token_id", -1)
    expected = encoder.encode_prompt(prompt).ids
    mask, logprobs = [], []
    for k, call in enumerate(calls):
        # the engine saw exactly the context so far, with one pad per image
        assert call["input_ids"] == collapse_image_pads(expected, image_id)[0]
        out = call["response"]["output_ids"]
        lps = [x[0] for x in call["response"]["meta_info"]["output_token_logprobs"]]
        expected = expected + out
        mask += [1] * len(out)
        logprobs += lps
        if k < len(observations):
            delta = encoder.encode_observation(
                env.format_observation(observations[k]), model_ended_turn=out[-1] == encoder.eot_id
            ).ids
            expected = expected + delta
            mask += [0] * len(delta)
            logprobs += [0.0] * len(delta)
    assert sample.tokens == expected
    assert sample.loss_mask == mask
    assert sample.rollout_log_probs == logprobs
    assert [t.output_tokens for t in sample.turns] == [len(c["response"]["output_ids"]) for c in calls]
    _assert_steps_and_merge_train_what_the_engine_generated(sample, calls, image_id)

    if prefix_stable:
        _assert_renders_final_conversation(
            ctx, sample, prompt, observations, calls, env, exact_tokens=name == "smollm2"
        )


def _assert_steps_and_merge_train_what_the_engine_generated(sample, calls, image_id):
    """Step-wise: step k is call k's context and its output, trained on exactly the output with the
    engine's log-probs. Merged: the trajectory again, as concat trains it."""
    steps, _ = finalize([sample], "step_wise", merge=False)
    assert len(steps) == len(calls)
    for step, call in zip(steps, calls):
        out = call["response"]["output_ids"]
        assert collapse_image_pads(step.tokens, image_id)[0] == call["input_ids"] + out
        trained = [t for t, m in zip(step.response_ids, step.loss_mask) if m]
        assert trained == out == step.response_ids[-len(out) :]
        engine_lps = [x[0] for x in call["response"]["meta_info"]["output_token_logprobs"]]
        assert [lp for lp, m in zip(step.rollout_log_probs, step.loss_mask) if m] == engine_lps
    (merged,), _ = finalize([sample], "step_wise", merge=True)
    (concat,), _ = finalize([sample], "concat", merge=False)
    assert merged.tokens == concat.tokens == sample.tokens
    assert merged.loss_mask == concat.loss_mask and merged.rollout_log_probs == concat.rollout_log_probs


def _assert_renders_final_conversation(ctx, sample, prompt, observations, calls, env, exact_tokens):
    """tokens == chat template of (prompt, assistant_1, obs_1, ..., assistant_n), modulo the final
    end-of-turn suffix. Text-level (lossless decode) for random models, whose outputs need not be
    canonical tokenisations; token-level for the real SmolLM2."""
    tokenizer = ctx.tokenizer
    encoder = ctx.encoder()
    messages = list(prompt)
    for k, call in enumerate(calls):
        out = call["response"]["output_ids"]
        ended = out[-1] == encoder.eot_id
        messages.append({"role": "assistant", "content": tokenizer.decode(out[:-1] if ended else out)})
        if k < len(observations):
            messages.append(env.format_observation(observations[k]))
    rendered = encoder.render(messages, add_generation_prompt=False)
    image_id = getattr(ctx.processor, "image_token_id", -1)
    ours = tokenizer.decode(collapse_image_pads(sample.tokens, image_id)[0])
    suffix = rendered[len(ours) :]
    assert rendered.startswith(ours)
    assert suffix in ("\n", encoder.eot_text + "\n")
    if exact_tokens:
        assert tokenizer(rendered, add_special_tokens=False)["input_ids"][: len(sample.tokens)] == sample.tokens


def test_vlm_episode_images_and_tensors(engines):
    model, prompt, observations, stops, _ = CASES["qwen2.5-vl"]
    target = engines(model)
    ctx = make_ctx(
        target.url,
        target.model_path,
        engine=target.engine,
        max_turns=4,
        rollout_max_response_len=48,
        rollout_temperature=0.6,
        rollout_stop_token_ids=stops,
    )
    env = ScriptedEnv(observations, done_after=3)
    sample = Sample(index=0, prompt=prompt)
    asyncio.run(run_episode(ctx, sample, ctx.sampling_params(), env=env))
    assert sample.status == Status.COMPLETED
    # later turns' requests carry every earlier image
    assert [len(c["image_data"]) for c in ctx.client.calls] == [1, 2, 3]
    # per-image pad counts match image_grid_thw, and the final tensors are the per-turn concatenation
    processor = ctx.processor
    images = [picture(1), picture(2), picture(3)]
    per_turn = [processor.image_processor(images=[im], return_tensors="pt") for im in images]
    mm = sample.multimodal_train_inputs
    assert torch.equal(mm["image_grid_thw"], torch.cat([t["image_grid_thw"] for t in per_turn]))
    assert torch.equal(mm["pixel_values"], torch.cat([t["pixel_values"] for t in per_turn]))
    _, counts = collapse_image_pads(sample.tokens, processor.image_token_id)
    assert counts == [math.prod(row) // 4 for row in mm["image_grid_thw"].tolist()]
    assert [t.num_images for t in sample.turns] == [1, 2, 3]
