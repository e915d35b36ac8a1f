"""Request fields the gateway honours: n, stop, tool_choice none, max_tokens clamping, enforced
sampling, and the context budget."""

import pytest
from gateway_helpers import ANS, TOOLS, WER, openai

QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]


def _client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="EMPTY", max_retries=0)


def test_n_choices_are_each_a_turn_on_the_same_context(harness):
    session, base_url = harness.open()
    answer = _client(base_url).chat.completions.create(model="m", messages=QUESTION, n=3, tools=TOOLS)
    harness.close(session)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert all(c.message.tool_calls[0].function.name == "add" for c in answer.choices)
    sample = session.sample
    sample.validate()
    first, *others = sample.turns
    assert first.context_ids is None
    assert [t.context_ids for t in others] == [sample.tokens[: first.output_start]] * 2
    assert answer.usage.completion_tokens == sum(t.output_tokens for t in sample.turns)


def test_a_stop_string_cuts_the_content_and_the_ids_stay(harness):
    session, base_url = harness.open()
    answer = _client(base_url).chat.completions.create(model="m", messages=QUESTION, stop=["wer"])
    harness.close(session)
    assert answer.choices[0].message.content == " ans"
    assert answer.choices[0].finish_reason == "stop"
    sample = session.sample
    assert sample.tokens[sample.prompt_length :] == [ANS, WER]  # what the model generated, stop included


def test_tool_choice_none_leaves_tool_calls_as_text(harness):
    session, base_url = harness.open()
    answer = _client(base_url).chat.completions.create(model="m", messages=QUESTION, tools=TOOLS, tool_choice="none")
    harness.close(session)
    assert answer.choices[0].message.tool_calls is None
    assert "<tool_call>" in answer.choices[0].message.content and answer.choices[0].finish_reason == "stop"


def test_max_tokens_is_clamped_to_the_run_and_reported(harness):
    session, base_url = harness.open()
    answer = _client(base_url).chat.completions.create(model="m", messages=QUESTION, max_tokens=10_000)
    short = _client(base_url).chat.completions.create(model="m", messages=QUESTION, max_tokens=2)
    harness.close(session)
    assert answer.model_extra["slime_mt"]["applied"]["max_tokens"] == 64  # --rollout-max-response-len
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 2


@pytest.mark.parametrize("enforce", [False, True])
def test_enforced_sampling_overrides_the_harness(harness, enforce):
    harness.gateway.settings.gateway_enforce_sampling = enforce
    try:
        session, base_url = harness.open()
        answer = _client(base_url).chat.completions.create(model="m", messages=QUESTION, temperature=0.3, top_p=0.5)
        harness.close(session)
    finally:
        harness.gateway.settings.gateway_enforce_sampling = False
    applied = answer.model_extra["slime_mt"]["applied"]
    assert (applied["temperature"], applied["top_p"]) == ((1.0, 1.0) if enforce else (0.3, 0.5))


def test_a_context_past_the_budget_is_a_400_and_truncates_the_sample(harness):
    session, base_url = harness.open()
    with pytest.raises(openai.BadRequestError) as raised:
        _client(base_url).chat.completions.create(model="m", messages=[{"role": "user", "content": "word " * 5000}])
    harness.close(session)
    assert raised.value.body["type"] == "context_length_exceeded"
    assert "--rollout-max-context-len" in raised.value.body["message"]
    assert session.termination == "context_exhausted" and not session.sample.turns
