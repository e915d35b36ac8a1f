"""The same sessions through the real ``anthropic`` client, and streamed through both clients."""

import json

from gateway_helpers import TOOLS, openai

ANTHROPIC_TOOLS = [
    {
        "name": t["function"]["name"],
        "description": t["function"]["description"],
        "input_schema": t["function"]["parameters"],
    }
    for t in TOOLS
]
SYSTEM = "You add numbers with the add tool."
QUESTION = "What is 2 + 3?"


def _openai_session(harness, stream: bool = False):
    session, base_url = harness.open(index=3, rollout_id=1)
    client = openai.OpenAI(base_url=base_url, api_key="EMPTY", max_retries=0)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    for _ in range(2):
        answer = client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        message = answer.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "5"})
    harness.close(session)
    return session


def anthropic_client(base_url: str):
    """The real ``anthropic`` client on a session's URL (imported here, not at collection: it takes seconds)."""
    import anthropic

    return anthropic.Anthropic(base_url=base_url.removesuffix("/v1"), api_key="EMPTY", max_retries=0)


def _anthropic_session(harness):
    session, base_url = harness.open(index=3, rollout_id=1)
    client = anthropic_client(base_url)
    messages = [{"role": "user", "content": QUESTION}]
    for _ in range(2):
        answer = client.messages.create(
            model="m", max_tokens=64, system=SYSTEM, messages=messages, tools=ANTHROPIC_TOOLS
        )
        assert answer.stop_reason == "tool_use"
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in answer.content]})
        results = [
            {"type": "tool_result", "tool_use_id": b.id, "content": "5"} for b in answer.content if b.type == "tool_use"
        ]
        messages.append({"role": "user", "content": results})
    harness.close(session)
    return session, answer


def test_the_anthropic_path_records_what_the_openai_path_records(harness):
    through_openai = _openai_session(harness)
    through_anthropic, last = _anthropic_session(harness)
    text, tool = last.content
    assert (text.type, text.text) == ("text", "answer")
    assert (tool.type, tool.name, tool.input) == ("tool_use", "add", {"a": 2, "b": 3})
    a, b = through_openai.sample, through_anthropic.sample
    b.validate()
    assert a.tokens == b.tokens and a.loss_mask == b.loss_mask
    assert a.rollout_log_probs == b.rollout_log_probs
    assert [(t.output_start, t.output_end, t.context_ids) for t in a.turns] == [
        (t.output_start, t.output_end, t.context_ids) for t in b.turns
    ]
    assert through_anthropic.metrics["kept_messages"] == 1  # the second call kept the first answer's ids


def test_openai_stream_joins_to_the_non_streaming_answer_tool_calls_included(harness):
    session, base_url = harness.open()
    client = openai.OpenAI(base_url=base_url, api_key="EMPTY", max_retries=0)
    messages = [{"role": "user", "content": QUESTION}]
    whole = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, seed=7)
    chunks = list(
        client.chat.completions.create(
            model="m", messages=messages, tools=TOOLS, seed=7, stream=True, stream_options={"include_usage": True}
        )
    )
    harness.close(session)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    message = whole.choices[0].message
    assert content == message.content
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls
    ]
    assert finish == [whole.choices[0].finish_reason] == ["tool_calls"]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # streamed in pieces


def test_openai_stream_equals_the_answer_on_a_sampling_model(tiny_harness):
    """A random tiny model at temperature 1: the same seed gives the same text, streamed or not."""
    session, base_url = tiny_harness.open()
    client = openai.OpenAI(base_url=base_url, api_key="EMPTY", max_retries=0)
    messages = [{"role": "user", "content": "Tell me a story."}]
    whole = client.chat.completions.create(model="m", messages=messages, seed=11, max_tokens=24, logprobs=True)
    stream = client.chat.completions.create(model="m", messages=messages, seed=11, max_tokens=24, stream=True)
    content = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    tiny_harness.close(session)
    assert content == whole.choices[0].message.content
    assert len(whole.choices[0].logprobs.content) == whole.usage.completion_tokens
    sample = session.sample
    assert [x.logprob for x in whole.choices[0].logprobs.content] == sample.rollout_log_probs[
        : whole.usage.completion_tokens
    ]


def test_anthropic_stream_joins_to_the_non_streaming_message(harness):
    session, base_url = harness.open()
    client = anthropic_client(base_url)
    kwargs = dict(model="m", max_tokens=64, messages=[{"role": "user", "content": QUESTION}], tools=ANTHROPIC_TOOLS)
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        streamed = stream.get_final_message()
    harness.close(session)
    strip = lambda blocks: [{k: v for k, v in b.model_dump().items() if k != "id"} for b in blocks]  # noqa: E731
    assert strip(streamed.content) == strip(whole.content)
    assert streamed.stop_reason == whole.stop_reason == "tool_use"
    assert json.dumps(streamed.content[1].input) == json.dumps({"a": 2, "b": 3})
