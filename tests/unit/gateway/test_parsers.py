"""Tool-call and reasoning parsers, and what the gateway keeps of an answer whose reasoning the
harness dropped (the real Qwen3 tokenizer and template)."""

import pytest

from slime_mt.gateway.chat import ChatRequest, Choice
from slime_mt.gateway.parsers import ToolCall, parse_output

CASES = [
    # (text, reasoning parser, tool parser, content, reasoning, calls, malformed)
    ("plain", "none", "qwen", "plain", None, [], 0),
    ('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>', "none", "qwen", "", None, [("f", {"x": 1})], 0),
    (
        'a<tool_call>{"name": "f", "arguments": {}}</tool_call>b<tool_call>{"name": "g", "arguments": {"y": "z"}}</tool_call>',
        "none", "qwen", "ab", None, [("f", {}), ("g", {"y": "z"})], 0,
    ),
    ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call>', "none", "qwen", "", None, [("f", {"x": 2})], 0),
    ("<tool_call>{not json}</tool_call>", "none", "qwen", "<tool_call>{not json}</tool_call>", None, [], 1),
    ('<tool_call>{"arguments": {}}</tool_call>', "none", "qwen", '<tool_call>{"arguments": {}}</tool_call>', None, [], 1),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "none", "qwen", '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', None, [], 1),
    ('<tool_call>{"name": "f"', "none", "qwen", '<tool_call>{"name": "f"', None, [], 1),
    ('<tool_call>{"name": "f", "arguments": {}}</tool_call>', "none", "none", '<tool_call>{"name": "f", "arguments": {}}</tool_call>', None, [], 0),
    ('{"name": "f", "parameters": {"x": 1}}', "none", "llama3_json", "", None, [("f", {"x": 1})], 0),
    ('<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "arguments": {"a": 1}}', "none", "llama3_json", "", None,
     [("f", {}), ("g", {"a": 1})], 0),
    ('{"name": 3}', "none", "llama3_json", '{"name": 3}', None, [], 1),
    ("hello", "none", "llama3_json", "hello", None, [], 0),
    ("<think>\nplan\n</think>\n\nanswer", "qwen3", "none", "answer", "plan", [], 0),
    ("plan\n</think>\n\nanswer", "qwen3", "none", "answer", "plan", [], 0),  # <think> was in the prompt
    ("<think>\nstill thinking", "qwen3", "none", "", "still thinking", [], 0),
    ("no reasoning here", "qwen3", "none", "no reasoning here", None, [], 0),
    ('<think>x</think><tool_call>{"name": "f", "arguments": {}}</tool_call>', "qwen3", "qwen", "", "x", [("f", {})], 0),
]  # fmt: skip


@pytest.mark.parametrize("text, reasoning_parser, tool_parser, content, reasoning, calls, malformed", CASES)
def test_parse_output(text, reasoning_parser, tool_parser, content, reasoning, calls, malformed):
    parsed = parse_output(text, reasoning_parser, tool_parser, tools_enabled=True)
    assert parsed.content == content
    assert parsed.reasoning == reasoning
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == calls
    assert parsed.malformed_tool_calls == malformed


def test_tools_off_leave_the_text_alone():
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    assert parse_output(text, "none", "qwen", tools_enabled=False).content == text


def test_an_answer_whose_reasoning_the_harness_dropped_keeps_the_ids_after_think(tiny_paths, qwen3_tokenizer):
    from slime_mt.config_parsing import parse_config
    from slime_mt.gateway.session import Session
    from slime_mt.rollout.context import RolloutContext
    from slime_mt.types import Sample

    cfg = parse_config(["--hf-checkpoint", str(tiny_paths["qwen3"]), "--reasoning-parser", "qwen3"])
    ctx = RolloutContext.create(cfg, str(tiny_paths["qwen3"]), "http://127.0.0.1:1")
    try:
        session = Session(ctx, Sample(index=0), ctx.sampling_params(), cfg.gateway)
        tok = qwen3_tokenizer
        ids = tok("<think>\nadd them\n</think>\n\nIt is 5.<|im_end|>", add_special_tokens=False)["input_ids"]
        text = tok.decode(ids, skip_special_tokens=True)
        parsed = parse_output(text, "qwen3", "qwen", tools_enabled=False)
        session._remember(Choice(ids, [0.0] * len(ids), [], parsed, "stop"), ids)
        answer_ids = ids[ids.index(tok.convert_tokens_to_ids("</think>")) + 2 :]
        assert tok.decode(answer_ids) == "It is 5.<|im_end|>"
        question = {"role": "user", "content": "2 + 3?"}
        follow = {"role": "user", "content": "Thanks."}
        with_reasoning = {"role": "assistant", "content": "It is 5.", "reasoning_content": "add them"}
        without = {"role": "assistant", "content": "It is 5."}
        rendered = session.render(ChatRequest(messages=[question, with_reasoning, follow]))
        prompt = tok.apply_chat_template([question], tokenize=False, add_generation_prompt=True)
        assert rendered.ids[: rendered.ids.index(ids[0])] == tok(prompt, add_special_tokens=False)["input_ids"]
        assert _contains(rendered.ids, ids) and rendered.kept == 1  # reasoning and all, as generated
        rendered = session.render(ChatRequest(messages=[question, without, follow]))
        assert _contains(rendered.ids, answer_ids) and not _contains(rendered.ids, ids[:3])  # the answer's ids only
        assert rendered.kept == 1
        edited = session.render(
            ChatRequest(messages=[question, {"role": "assistant", "content": "It is six."}, follow])
        )
        assert edited.kept == 0
    finally:
        ctx.close()


def _contains(ids: list[int], part: list[int]) -> bool:
    return any(ids[i : i + len(part)] == part for i in range(len(ids) - len(part) + 1))


def test_tool_call_arguments_serialise_as_a_json_object():
    assert ToolCall("f", {"x": [1, "é"]}).arguments_json() == '{"x": [1, "é"]}'


@pytest.mark.parametrize("disable", [True, False])
def test_anthropic_disable_parallel_tool_use_answers_one_tool_use_block(qwen_tokenizer, disable):
    """Issue 44 item 8: ``tool_choice.disable_parallel_tool_use`` keeps the first of the model's tool
    calls (one ``tool_use`` block), as OpenAI's ``parallel_tool_calls: false`` does."""
    from types import SimpleNamespace

    from slime_mt.gateway.anthropic import anthropic_response, parse_anthropic
    from slime_mt.gateway.chat import Completion
    from slime_mt.gateway.session import Session

    body = {
        "model": "m",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "add twice"}],
        "tools": [{"name": "add", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": disable},
    }
    request = parse_anthropic(body, allow_paths=False)
    assert request.parallel_tool_calls is not disable
    two = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call><tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'
    ids = qwen_tokenizer(two, add_special_tokens=False)["input_ids"]
    session = SimpleNamespace(
        ctx=SimpleNamespace(tokenizer=qwen_tokenizer),
        settings=SimpleNamespace(reasoning_parser="none", tool_call_parser="qwen"),
    )
    choice = Session._choice(session, request, ids, [0.0] * len(ids), {"finish_reason": {"type": "stop"}})
    answer = anthropic_response(Completion("chatcmpl-x", "m", [1], [choice], {}))
    blocks = [(b["name"], b["input"]) for b in answer["content"] if b["type"] == "tool_use"]
    assert blocks == ([("add", {"a": 1})] if disable else [("add", {"a": 1}), ("add", {"a": 2})])
    with pytest.raises(Exception, match="disable_parallel_tool_use"):
        parse_anthropic({**body, "tool_choice": {"type": "auto", "disable_parallel_tool_use": "yes"}}, False)
