"""The gateway through the real ``openai`` client, against the scripted model on the embedded engine
(it answers every call with " ans" + "wer", a tool call, and <|im_end|>)."""

import json

import pytest
from gateway_helpers import ANS, ANSWER, TOOLS, WER, openai

from slime_mt.rollout.finalize import finalize


def _client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="EMPTY", max_retries=0)


@pytest.fixture
def sent(harness, monkeypatch):
    """Every input_ids list the rollout's engine client posts to /generate (the real call goes on)."""
    calls = []
    generate = harness.ctx.client.generate

    async def spy(input_ids=None, *args, **kwargs):
        calls.append(list(input_ids))
        return await generate(input_ids, *args, **kwargs)

    monkeypatch.setattr(harness.ctx.client, "generate", spy)
    return calls


def _tool_session(harness, keep_last: int | None = None, calls: int = 3):
    """A harness that answers each tool call with its result; ``keep_last``: it sends only the
    system prompt and the last ``keep_last`` messages. -> (session, answers)."""
    session, base_url = harness.open()
    client = _client(base_url)
    system = {"role": "system", "content": "You add numbers with the add tool."}
    history = [{"role": "user", "content": "What is 2 + 3?"}]
    answers = []
    for _ in range(calls):
        shown = history if keep_last is None else history[-keep_last:]
        answer = client.chat.completions.create(model="m", messages=[system, *shown], tools=TOOLS)
        answers.append(answer)
        message = answer.choices[0].message
        history.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            result = sum(json.loads(call.function.arguments).values())
            history.append({"role": "tool", "tool_call_id": call.id, "content": str(result)})
    harness.close(session)
    return session, answers


def test_a_chat_completion_with_tools_returns_tool_calls(harness):
    session, base_url = harness.open()
    answer = _client(base_url).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "What is 2 + 3?"}], tools=TOOLS
    )
    harness.close(session)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert (call.type, call.function.name, call.function.arguments) == ("function", "add", '{"a": 2, "b": 3}')
    assert call.id.startswith("call_")
    assert choice.message.content == "answer"
    assert answer.usage.completion_tokens == len(session.sample.tokens) - session.sample.prompt_length
    assert answer.usage.prompt_tokens == session.sample.prompt_length


def test_an_appending_agent_merges_into_one_sequence_and_each_call_got_what_was_recorded(harness, sent):
    session, answers = _tool_session(harness)
    sample = session.sample
    sample.validate()
    assert [t.context_ids for t in sample.turns] == [None, None, None]  # the history only grew
    for k, turn in enumerate(sample.turns):
        assert sent[k] == sample.tokens[: turn.output_start]  # what the engine received
        assert sample.tokens[turn.output_start : turn.output_start + 2] == [ANS, WER]
    assert ANSWER not in sample.tokens  # the answers went back as generated, never re-tokenized
    assert session.metrics["kept_messages"] == 0 + 1 + 2
    sample.reward = 1.0
    steps, _ = finalize([sample], "step_wise", merge=False)
    merged, metrics = finalize([sample], "step_wise", merge=True)
    assert len(steps) == 3 and len(merged) == 1
    assert merged[0].prompt_ids + merged[0].response_ids == sample.tokens
    assert merged[0].loss_mask == sample.loss_mask


def test_an_agent_that_keeps_the_last_two_messages_trains_each_call_on_its_own_context(harness, sent):
    session, _ = _tool_session(harness, keep_last=2)
    sample = session.sample
    sample.validate()
    turns = sample.turns
    assert turns[0].context_ids is None and all(t.context_ids is not None for t in turns[1:])
    sample.reward = 1.0
    steps, _ = finalize([sample], "step_wise", merge=True)
    assert len(steps) == 3  # no call extends the one before
    for k, (step, turn) in enumerate(zip(steps, turns)):
        assert step.prompt_ids == sent[k]  # each step trains on exactly what the engine received
        assert step.response_ids == sample.tokens[turn.output_start : turn.output_end]
        assert (
            step.rollout_log_probs
            == sample.rollout_log_probs[
                turn.output_start - sample.prompt_length : turn.output_end - sample.prompt_length
            ]
        )
    assert ANSWER not in sent[2] and [ANS, WER] == sent[2][sent[2].index(ANS) : sent[2].index(ANS) + 2]


def test_return_token_ids_through_extra_body(harness, sent):
    session, base_url = harness.open()
    messages = [{"role": "user", "content": "Say it."}]
    answer = _client(base_url).chat.completions.create(
        model="m", messages=messages, extra_body={"return_token_ids": True}
    )
    harness.close(session)
    sample = session.sample
    assert answer.prompt_token_ids == sent[0] == sample.tokens[: sample.prompt_length]
    assert answer.choices[0].token_ids == sample.tokens[sample.prompt_length :]
    assert answer.choices[0].token_ids[:2] == [ANS, WER]


def test_an_answer_sent_back_as_text_keeps_its_generated_ids(harness, sent, qwen_tokenizer):
    """The drift case: the engine wrote " ans"+"wer"; the harness sends the message back as plain text
    (no tools, so the tool call is text too); the next engine request holds the generated ids."""
    session, base_url = harness.open()
    client = _client(base_url)
    messages = [{"role": "user", "content": "Say it."}]
    first = client.chat.completions.create(model="m", messages=messages)
    text = first.choices[0].message.content
    assert text.startswith(" answer")
    assert qwen_tokenizer(text, add_special_tokens=False)["input_ids"][0] == ANSWER  # what re-tokenizing gives
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Again."}]
    client.chat.completions.create(model="m", messages=messages)
    harness.close(session)
    first_out = session.sample.tokens[session.sample.turns[0].output_start : session.sample.turns[0].output_end]
    assert sent[1][len(sent[0]) : len(sent[0]) + len(first_out)] == first_out
    assert ANSWER not in sent[1]
    assert session.sample.turns[1].context_ids is None


def test_an_edited_answer_is_rendered_by_the_template(harness, sent, qwen_tokenizer):
    session, base_url = harness.open()
    client = _client(base_url)
    messages = [{"role": "user", "content": "Say it."}]
    client.chat.completions.create(model="m", messages=messages)
    messages += [{"role": "assistant", "content": " answer (edited)"}, {"role": "user", "content": "Again."}]
    client.chat.completions.create(model="m", messages=messages)
    harness.close(session)
    assert ANSWER in sent[1]  # not the model's words: tokenized as the template renders them
    assert session.sample.turns[1].context_ids == sent[1]
    assert session.metrics["rewritten_calls"] == 1


def test_with_oldest_groups_first_an_agents_calls_carry_its_groups_start_version(scripted_path, scripted_engine):
    """--oldest-groups-first: the gateway answers a call in a task of its own, outside the trajectory's,
    and still asks the engine for the priority of the sample's group (minus its start version); an
    evaluation's agent (its session opened in an evaluated trajectory's task) asks for the lowest."""
    from gateway_helpers import Harness

    from slime_mt.engine.clients.priority import EVALUATION

    flags = ["--rollout-max-response-len", "64", "--fully-async", "--oldest-groups-first"]
    harness = Harness(scripted_path, scripted_engine.url, flags)
    seen = []
    submit = scripted_engine.scheduler.submit

    def recording(request):
        seen.append(request.priority)
        return submit(request)

    scripted_engine.scheduler.submit = recording
    try:
        session, base_url = harness.open()
        session.sample.metadata["start_version"] = 4
        answer = _client(base_url).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "What is 2 + 3?"}], tools=TOOLS
        )
        harness.close(session)
        evaluated, base_url = harness.open(index=1, rank=EVALUATION)
        _client(base_url).chat.completions.create(model="m", messages=[{"role": "user", "content": "What is 2 + 3?"}])
        harness.close(evaluated)
    finally:
        del scripted_engine.scheduler.submit
        harness.stop()
    assert answer.choices[0].finish_reason == "tool_calls"
    assert seen == [-4, -EVALUATION]
