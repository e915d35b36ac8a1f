"""The two other tokenization paths against the embedded engine: one assistant message for every
turn (``--no-conversation-multi-turn``) and a re-rendered history (``--retokenize-chat-history``).

The models are "chain" copies of the tiny Qwen3 (see ``rollout_helpers.chain_model``) with the real
Qwen tokenizer: the Qwen2.5 template, and Qwen3's official one. They answer "Direct answer" as the
non-canonical split ``" ans" + "wer"`` (re-tokenizing gives ``" answer"``), or "Calling tool", or
think first, so re-tokenization drift has a known size.
"""

import asyncio

import pytest
from rollout_helpers import (
    ANS,
    CALLING,
    CHECK,
    DIRECT,
    END_THINK,
    EOT,
    LET,
    ME,
    NL,
    NL2,
    PROMPT,
    RESULTS,
    THINK,
    THINKING,
    TOOL,
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
from slime_mt.assets import qwen3_reference_tokenizer_dir, qwen_tokenizer_dir
from slime_mt.config import DataConfig
from slime_mt.engine.embedded.server import LocalEngine
from slime_mt.rollout.finalize import finalize
from slime_mt.rollout.metrics import rollout_metrics
from slime_mt.rollout.multi_turn import run_episode
from slime_mt.tokenization import mask_runs
from slime_mt.types import Sample, Status

OBS_END = 397  # ">\n", the last token of the default observation template
DIRECT_ANSWER = {NL: [DIRECT], OBS_END: [DIRECT], DIRECT: [ANS], ANS: [WER], WER: [EOT]}
EITHER = {**DIRECT_ANSWER, NL: [DIRECT, CALLING], CALLING: [TOOL], TOOL: [EOT]}
TEMPLATES = {"qwen2.5": lambda: qwen_tokenizer_dir("qwen2.5"), "qwen3": qwen3_reference_tokenizer_dir}


@pytest.fixture(scope="module")
def engines(tiny_paths, tmp_path_factory):
    """(template, chain) -> a started engine on that chain model with that tokenizer."""
    started = {}

    def get(template, chain):
        if (template, chain) not in started:
            transitions = {"direct": DIRECT_ANSWER, "either": EITHER, "thinking": THINKING}[chain]
            path = chain_model(
                tiny_paths["qwen3"], tmp_path_factory.mktemp(f"{template}-{chain}"), TEMPLATES[template](), transitions
            )
            started[template, chain] = LocalEngine(path, max_batch_size=8).start()
        return started[template, chain]

    yield get
    for engine in started.values():
        engine.stop()


def episode(engine, seed=0, index=0, turns=3, role="tool", **rollout):
    ctx = make_ctx(
        engine.url,
        engine.model_path,
        max_turns=4,
        rollout_max_response_len=16,
        rollout_max_context_len=4096,
        data=DataConfig(apply_chat_template=True, rollout_seed=seed),
        **rollout,
    )
    sample = Sample(index=index, group_index=0, prompt=PROMPT, metadata={"tools": TOOLS, "rollout_id": 0})
    asyncio.run(run_episode(ctx, sample, ctx.sampling_params(), env=ScriptedEnv(RESULTS, role=role, done_after=turns)))
    assert sample.status == Status.COMPLETED and len(sample.turns) == turns, sample.metadata
    sample.validate()
    return ctx, sample


def outputs_of(ctx):
    return [call["response"]["output_ids"] for call in ctx.client.calls]


def logprobs_of(call):
    return [lp for lp, *_ in call["response"]["meta_info"]["output_token_logprobs"]]


# ---------------------------------------------------------------- --no-conversation-multi-turn


@pytest.mark.parametrize("template", ["qwen2.5", "qwen3"])
def test_no_conversation_multi_turn_is_one_assistant_message(engines, template):
    engine = engines(template, "direct")
    tokenizer = AutoTokenizer.from_pretrained(engine.model_path)
    ctx, sample = episode(engine, conversation_multi_turn=False)
    calls, outputs = ctx.client.calls, outputs_of(ctx)
    assert outputs == [[DIRECT, ANS, WER, EOT]] * 3
    # token-in/token-out: each call's context is the running sequence, every turn's end-of-turn but the last dropped
    for k, (turn, call) in enumerate(zip(sample.turns, calls)):
        assert turn.context_ids is None and call["input_ids"] == sample.tokens[: turn.output_start], k
        kept = outputs[k] if k == 2 else outputs[k][:-1]
        assert sample.tokens[turn.output_start : turn.output_end] == kept, k
        start = turn.output_start - sample.prompt_length
        assert sample.rollout_log_probs[start : start + len(kept)] == logprobs_of(call)[: len(kept)], k
    # the loss mask is 1 exactly on the generated tokens that stayed
    generated = {i for t in sample.turns for i in range(t.output_start, t.output_end)}
    assert [i for i, m in enumerate(sample.loss_mask, sample.prompt_length) if m] == sorted(generated)
    assert sum(sample.loss_mask) == 3 * 3 + 1
    # the text is the render of the final conversation, with every turn inside ONE assistant message
    response = sample.tokens[sample.prompt_length :]
    content = tokenizer.decode(response[:-1])
    assert content == "Direct answer" + "".join(
        f"\n<observation>partial result {k}</observation>\nDirect answer" for k in (1, 2)
    )
    rendered = tokenizer.apply_chat_template(
        PROMPT + [{"role": "assistant", "content": content}], tools=TOOLS, tokenize=False
    )
    prompt_text = tokenizer.decode(sample.tokens[: sample.prompt_length])
    # Qwen3's official template gives the last assistant message an empty think block the model never made
    opening = "<think>\n\n</think>\n\n" if template == "qwen3" else ""
    assert rendered == prompt_text + opening + tokenizer.decode(response) + "\n"
    assert tokenizer.decode(response).count("<|im_start|>") == 0
    # concat trains that sequence; step-wise steps merge back into it
    (concat,), _ = finalize([sample], "concat", merge=False)
    assert concat.response_ids == response and concat.loss_mask == sample.loss_mask
    merged, metrics = finalize([sample], "step_wise", merge=True)
    assert metrics["train/sequences_before_merge"] == 3 and len(merged) == 1
    assert merged[0].response_ids == response and merged[0].loss_mask == sample.loss_mask


def test_a_custom_observation_template_and_a_stop_string_turn(engines):
    engine = engines("qwen2.5", "direct")
    tokenizer = AutoTokenizer.from_pretrained(engine.model_path)
    # "wer" is a stop string: no turn ends with the end-of-turn token, so nothing is dropped
    ctx, sample = episode(
        engine, conversation_multi_turn=False, rollout_stop=["wer"], observation_template="\nResult: {observation}\n"
    )
    assert outputs_of(ctx) == [[DIRECT, ANS, WER]] * 3
    assert (
        tokenizer.decode(sample.tokens[sample.prompt_length :])
        == "Direct answer\nResult: partial result 1\nDirect answer\nResult: partial result 2\nDirect answer"
    )


# ---------------------------------------------------------------- --retokenize-chat-history


def history(outputs, tokenizer, upto, role="tool"):
    """The conversation before turn ``upto``, written independently: decoded answers, env results."""
    messages = list(PROMPT)
    for k in range(upto):
        messages += [
            {"role": "assistant", "content": tokenizer.decode(outputs[k][:-1])},
            {"role": role, "content": RESULTS[k]["text"]},
        ]
    return messages


@pytest.mark.parametrize("sample_format", ["concat", "step_wise"])
def test_retokenize_contexts_are_the_render_and_drift_counts_the_split(engines, sample_format):
    engine = engines("qwen2.5", "either")
    tokenizer = AutoTokenizer.from_pretrained(engine.model_path)
    samples, expected_drift = [], []
    for seed in range(8):
        ctx, sample = episode(engine, seed=seed, index=seed, retokenize_chat_history=True, sample_format=sample_format)
        outputs = outputs_of(ctx)
        for k, call in enumerate(ctx.client.calls):
            text = tokenizer.apply_chat_template(
                history(outputs, tokenizer, k), tools=TOOLS, tokenize=False, add_generation_prompt=True
            )
            assert call["input_ids"] == tokenizer.encode(text, add_special_tokens=False), k  # one-piece render
            if sample_format == "step_wise":  # the context differs from token-in/token-out after a split answer
                split = any(out[1:3] == [ANS, WER] for out in outputs[:k])
                assert (sample.turns[k].context_ids is not None) == split, k
        # independent count: each generated " ans"+"wer" is 2 tokens where the render has " answer"
        expected_drift.append(2 * sum(out[1:3] == [ANS, WER] for out in outputs))
        assert sample.metadata["retokenize_drift_tokens"] == expected_drift[-1]
        samples.append((ctx, sample))
    assert 0 < sum(d > 0 for d in expected_drift) < 8, expected_drift  # the seeds give both kinds
    metrics = rollout_metrics([[s for _, s in samples]])
    assert metrics["rollout/retokenize_drift_tokens"] == sum(expected_drift)
    assert metrics["rollout/retokenize_drift_samples"] == sum(d > 0 for d in expected_drift)
    for ctx, sample in samples:
        outputs = outputs_of(ctx)
        if sample_format == "step_wise":  # every step is exactly what the engine saw and made, with its log-probs
            steps, _ = finalize([sample], "step_wise", merge=False)
            for step, call in zip(steps, ctx.client.calls):
                assert step.prompt_ids == call["input_ids"] and step.response_ids == call["response"]["output_ids"]
                assert step.rollout_log_probs == logprobs_of(call)
            continue
        # concat: the final render, assistant spans masked, no rollout log-probs
        final = tokenizer.apply_chat_template(history(outputs, tokenizer, 3)[:-1], tools=TOOLS, tokenize=False)
        assert sample.tokens == tokenizer.encode(final, add_special_tokens=False)
        assert sample.rollout_log_probs is None
        assert [tokenizer.decode(sample.tokens[t.output_start : t.output_end]) for t in sample.turns] == [
            tokenizer.decode(out) for out in outputs
        ]
        spans = [(t.output_start - sample.prompt_length, t.output_end - sample.prompt_length) for t in sample.turns]
        assert mask_runs(sample.loss_mask) == spans
        (concat,), _ = finalize([sample], "concat", merge=False)
        assert concat.rollout_log_probs is None and concat.loss_mask == sample.loss_mask


def test_retokenize_gives_qwen3_its_official_render_and_counts_stripped_thinking(engines):
    engine = engines("qwen3", "thinking")
    reference = AutoTokenizer.from_pretrained(engine.model_path)
    # user observations: every earlier answer precedes the last user query, so the template drops its thinking
    ctx, sample = episode(engine, retokenize_chat_history=True, sample_format="step_wise", role="user")
    outputs = outputs_of(ctx)
    assert outputs == [[THINK, LET, ME, CHECK, END_THINK, NL2, CALLING, TOOL, EOT]] * 3
    for k, call in enumerate(ctx.client.calls):
        text = reference.apply_chat_template(
            history(outputs, reference, k, "user"), tools=TOOLS, tokenize=False, add_generation_prompt=True
        )
        assert call["input_ids"] == reference.encode(text, add_special_tokens=False), k
        assert call["input_ids"].count(THINK) == 0, k
    # drift, counted independently: an earlier turn keeps only "Calling tool<|im_end|>" (6 of 9 tokens
    # stripped); the last keeps its thinking, with the newlines the template adds inside the block
    last = reference.encode("<think>\nLet me check\n</think>\n\nCalling tool<|im_end|>", add_special_tokens=False)
    assert sample.metadata["retokenize_drift_tokens"] == 2 * 6 + (len(last) - 9)


def test_retokenized_concat_samples_train_with_recomputed_old_log_probs(engines, tiny_paths, tmp_path):
    engine = engines("qwen2.5", "direct")
    samples = [episode(engine, seed=seed, index=seed, retokenize_chat_history=True)[1] for seed in range(2)]
    for k, sample in enumerate(samples):
        sample.group_index, sample.reward = k, float(k)
    train, _ = finalize(samples, "concat", merge=False)
    assert all(s.rollout_log_probs is None for s in train)
    # two groups, one per optimizer step: the old log-probs are recomputed before the first
    trained = train_in_megatron(
        tmp_path,
        {
            "path": str(tiny_paths["qwen3"]),
            "samples": train,
            "prompts_per_step": 1,
            "advantages": compute_advantages(train, "dr_grpo"),
            "algo": {"use_tis": False},
        },
    )
    assert trained["optimizer_steps"] == 2 and trained["finite"] and trained["grad_norm"] > 0
    assert "train/train_rollout_logprob_abs_diff" not in trained["metrics"]  # nothing to compare with


@pytest.mark.parametrize("kind", ["qwen2.5-vl", "qwen3-vl"])
def test_retokenize_with_images_sends_every_image_and_trains_the_render(farm, tiny_paths, kind):
    from slime_mt.engine.images import encode_image
    from slime_mt.processing import load_tokenizer_or_processor

    ctx, sample = image_episode(farm, tiny_paths[kind], kind, 3, retokenize_chat_history=True)
    sample.validate()
    processor = load_tokenizer_or_processor(tiny_paths[kind])
    pad = processor.image_token_id
    pictures = [picture(k + 1) for k in range(3)]
    messages = list(sample.prompt)
    for k, call in enumerate(ctx.client.calls):
        assert call["image_data"] == [encode_image(p) for p in pictures[: k + 1]], k  # every image of the history
        assert call["input_ids"].count(pad) == k + 1, k
        out = call["response"]["output_ids"]
        messages.append({"role": "assistant", "content": processor.decode(out[:-1] if out[-1] == EOT else out)})
        if k < 2:
            messages.append(
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "image": pictures[k + 1]},
                        {"type": "text", "text": f"Now this one ({k})."},
                    ],
                }
            )
    text = processor.apply_chat_template(messages, tokenize=False)
    expected = processor(text=text, images=pictures)
    assert sample.tokens == expected["input_ids"][0].tolist() and sample.rollout_log_probs is None
    assert sample.multimodal_train_inputs["image_grid_thw"].tolist() == expected["image_grid_thw"].tolist()
    assert sample.multimodal_train_inputs["pixel_values"].equal(expected["pixel_values"])
    assert len(mask_runs(sample.loss_mask)) == 3 and all(
        sample.tokens[i] != pad for i, m in enumerate(sample.loss_mask, sample.prompt_length) if m
    )
