"""The Anthropic Messages API side of the gateway: ``POST /v1/messages`` bodies -> ``ChatRequest``,
and the answer as a ``message`` or as its stream of events.

Blocks map onto the chat template's messages as the OpenAI side's do, so one session renders the
same ids through either API: ``system`` -> a system message; a user message's ``tool_result`` blocks
-> ``tool`` messages (first, as the API orders them), its ``text`` and ``image`` blocks -> one user
message; an assistant message's ``text`` -> content, ``thinking`` -> ``reasoning_content``,
``tool_use`` -> ``tool_calls``; ``tools`` (``input_schema``) -> function schemas. ``tool_choice`` auto
and none are served; ``thinking`` is accepted (the reasoning comes from ``--reasoning-parser``; a
budget is not enforced). ``seed`` is accepted as an extension.
"""

from __future__ import annotations

import json

from slime_mt.gateway.chat import (
    MAX_IMAGES,
    MAX_MESSAGES,
    ChatRequest,
    Completion,
    bad,
    content_pieces,
    image_ref,
    integer,
    sampling_fields,
    text_only,
    tool_call,
)

FIELDS = {
    "model", "max_tokens", "messages", "system", "tools", "tool_choice", "temperature", "top_p", "top_k",
    "stop_sequences", "stream", "metadata", "thinking", "seed", "service_tier",
}  # fmt: skip
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _image(block: dict, where: str, allow_paths: bool) -> str:
    source = block.get("source")
    if not isinstance(source, dict):
        raise bad(f"{where}.source", "must be an object")
    if source.get("type") == "base64" and isinstance(source.get("data"), str):
        media = source.get("media_type") or "image/png"
        return image_ref(f"data:{media};base64,{source['data']}", f"{where}.source.data", allow_paths)
    if source.get("type") == "url":
        return image_ref(source.get("url"), f"{where}.source.url", allow_paths)
    raise bad(f"{where}.source.type", "must be base64 (or url with a data URI)")


def _user(content, where: str, allow_paths: bool) -> tuple[list[dict], int]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}], 0
    if not isinstance(content, list) or not content:
        raise bad(where, "must be a string or a non-empty list of blocks")
    tools, parts, images = [], [], 0
    for k, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}[{k}]"
        if kind == "tool_result":
            text = text_only(block.get("content", ""), f"{at}.content")
            tools.append({"role": "tool", "content": text, "tool_call_id": str(block.get("tool_use_id") or "")})
        elif kind == "text" and isinstance(block.get("text"), str):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            parts.append({"type": "image", "image": _image(block, at, allow_paths)})
            images += 1
        else:
            raise bad(at, "a user message holds text, image and tool_result blocks")
    messages = list(tools)
    if parts:
        only_text = all(p["type"] == "text" for p in parts)
        messages.append({"role": "user", "content": "".join(p["text"] for p in parts) if only_text else parts})
    return messages, images


def _assistant(content, where: str) -> dict:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise bad(where, "must be a string or a list of blocks")
    message: dict = {"role": "assistant", "content": ""}
    texts, calls = [], []
    for k, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}[{k}]"
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            message["reasoning_content"] = block["thinking"]
        elif kind == "tool_use" and isinstance(block.get("name"), str):
            arguments = block.get("input", {})
            if not isinstance(arguments, dict):
                raise bad(f"{at}.input", "must be an object")
            calls.append(tool_call(block.get("id"), block["name"], arguments))
        else:
            raise bad(at, "an assistant message holds text, thinking and tool_use blocks")
    message["content"] = "".join(texts)
    if calls:
        message["tool_calls"] = calls
    return message


def _tools(value) -> list[dict] | None:
    if value is None:
        return None
    if not isinstance(value, list) or len(value) > 128:
        raise bad("tools", "must be a list of at most 128 tools")
    out = []
    for k, tool in enumerate(value):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or not tool["name"]:
            raise bad(f"tools[{k}].name", "must be a non-empty string")
        schema = tool.get("input_schema", {"type": "object", "properties": {}})
        if not isinstance(schema, dict):
            raise bad(f"tools[{k}].input_schema", "must be a JSON schema object")
        function = {"name": tool["name"], "parameters": schema}
        if isinstance(tool.get("description"), str):
            function = {"name": tool["name"], "description": tool["description"], "parameters": schema}
        out.append({"type": "function", "function": function})
    return out or None


def parse_anthropic(body: dict, allow_paths: bool) -> ChatRequest:
    """A Messages API body -> ChatRequest; GatewayError names the first field it cannot honour."""
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise bad(unknown[0], "is not supported by the slime_mt gateway")
    max_tokens = integer(body, "max_tokens", 1)
    if max_tokens is None:
        raise bad("max_tokens", "is required")
    choice = body.get("tool_choice")
    kind = choice.get("type") if isinstance(choice, dict) else None
    if choice is not None and kind not in ("auto", "none"):
        raise bad("tool_choice", 'only {"type": "auto"} and {"type": "none"} are supported')
    if isinstance(choice, dict) and set(choice) - {"type", "disable_parallel_tool_use"}:
        raise bad("tool_choice", f"{sorted(set(choice) - {'type', 'disable_parallel_tool_use'})[0]} is not supported")
    single = choice.get("disable_parallel_tool_use", False) if isinstance(choice, dict) else False
    if not isinstance(single, bool):
        raise bad("tool_choice.disable_parallel_tool_use", "must be true or false")
    thinking = body.get("thinking")
    if thinking is not None and (not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled")):
        raise bad("thinking", 'must be {"type": "enabled", ...} or {"type": "disabled"}')
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad("messages", "must be a non-empty list")
    if len(raw) > MAX_MESSAGES:
        raise bad("messages", f"at most {MAX_MESSAGES} messages, got {len(raw)}")
    messages, images = [], 0
    system = body.get("system")
    if system is not None:
        messages.append({"role": "system", "content": text_only(system, "system")})
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role == "user":
            converted, count = _user(message.get("content"), f"{where}.content", allow_paths)
            messages.extend(converted)
            images += count
        elif role == "assistant":
            messages.append(_assistant(message.get("content"), f"{where}.content"))
        else:
            raise bad(f"{where}.role", f"must be user or assistant, got {json.dumps(role)[:40]}")
    if images > MAX_IMAGES:
        raise bad("messages", f"at most {MAX_IMAGES} images per request, got {images}")
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise bad("model", "must be a string")
    return ChatRequest(
        messages=messages,
        tools=_tools(body.get("tools")),
        tool_choice=kind or "auto",
        parallel_tool_calls=not single,  # at most one tool_use block when disabled, as Anthropic answers
        max_tokens=max_tokens,
        **sampling_fields(body, "stop_sequences"),
    )


def _blocks(completion: Completion) -> list[dict]:
    choice = completion.choices[0]
    parsed = choice.parsed
    blocks: list[dict] = []
    if parsed.reasoning is not None:
        blocks.append({"type": "thinking", "thinking": parsed.reasoning, "signature": ""})
    if parsed.content or not parsed.tool_calls:
        blocks.append({"type": "text", "text": parsed.content})
    for call_id, call in zip(choice.call_ids, parsed.tool_calls):
        blocks.append(
            {
                "type": "tool_use",
                "id": call_id.replace("call_", "toolu_", 1),
                "name": call.name,
                "input": call.arguments,
            }
        )
    return blocks


def _stop(completion: Completion) -> tuple[str, str | None]:
    choice = completion.choices[0]
    if choice.matched_stop is not None and choice.finish_reason == "stop":
        return "stop_sequence", choice.matched_stop
    return STOP_REASONS[choice.finish_reason], None


def _usage(completion: Completion) -> dict:
    return {
        "input_tokens": len(completion.prompt_ids),
        "output_tokens": completion.completion_tokens,
        "cache_read_input_tokens": completion.cached_tokens,
    }


def anthropic_response(completion: Completion) -> dict:
    stop_reason, stop_sequence = _stop(completion)
    return {
        "id": completion.id.replace("chatcmpl-", "msg_", 1),
        "type": "message",
        "role": "assistant",
        "model": completion.model,
        "content": _blocks(completion),
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": _usage(completion),
        "slime_mt": {"applied": completion.applied, "weight_version": completion.weight_version},
    }


def anthropic_events(completion: Completion) -> list[tuple[str, dict]]:
    """The answer as the Messages API streams it: (event name, data) pairs, one block at a time."""
    message = anthropic_response(completion)
    start = dict(
        message, content=[], stop_reason=None, stop_sequence=None, usage=dict(message["usage"], output_tokens=0)
    )
    events: list[tuple[str, dict]] = [("message_start", {"type": "message_start", "message": start})]
    texts = completion.choices[0].token_texts
    for index, block in enumerate(message["content"]):
        if block["type"] == "text":
            opening, deltas = (
                {"type": "text", "text": ""},
                [{"type": "text_delta", "text": t} for t in _split(block["text"], texts)],
            )
        elif block["type"] == "thinking":
            opening = {"type": "thinking", "thinking": "", "signature": ""}
            deltas = [
                {"type": "thinking_delta", "thinking": block["thinking"]},
                {"type": "signature_delta", "signature": ""},
            ]
        else:
            opening = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
            deltas = [{"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}]
        events.append(
            ("content_block_start", {"type": "content_block_start", "index": index, "content_block": opening})
        )
        events.extend(
            ("content_block_delta", {"type": "content_block_delta", "index": index, "delta": d}) for d in deltas
        )
        events.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
    delta = {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]}
    events.append(
        (
            "message_delta",
            {"type": "message_delta", "delta": delta, "usage": {"output_tokens": completion.completion_tokens}},
        )
    )
    events.append(("message_stop", {"type": "message_stop"}))
    return events


def _split(text: str, token_texts: list[str]) -> list[str]:
    return [p for p in content_pieces(text, token_texts) if p] or [text]
