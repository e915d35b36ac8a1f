"""The gateway's request and answer in one shape for both APIs, and the OpenAI Chat Completions
side of it: request validation (every refusal a ``GatewayError`` naming the field), the response,
and its server-sent-event chunks.

Messages are kept as the chat template renders them: ``role`` (system, user, assistant, tool),
``content`` (a string, or a list of ``{"type": "text", "text"}`` / ``{"type": "image", "image"}``
parts), an assistant's ``tool_calls`` (``function.arguments`` parsed into an object) and
``reasoning_content``, a tool message's ``tool_call_id``. Images are data URIs, raw base64 or file
paths (file paths only while the gateway listens on loopback); http(s) URLs are refused.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

from slime_mt.errors import GatewayError
from slime_mt.gateway.parsers import ParsedOutput

MAX_MESSAGES = 1024
MAX_IMAGES = 16  # per request
MAX_CHOICES = 8  # n
MAX_STOPS = 8


def bad(field_name: str, message: str) -> GatewayError:
    return GatewayError(400, f"{field_name}: {message}", param=field_name)


@dataclass
class ChatRequest:
    """One call as the gateway serves it, whichever API it came through."""

    messages: list[dict]
    tools: list[dict] | None = None  # OpenAI function schemas, as the chat template takes them
    tool_choice: str = "auto"  # auto | none
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    n: int = 1
    logprobs: bool = False
    return_token_ids: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    include_usage: bool = False
    parallel_tool_calls: bool = True
    model: str = ""


@dataclass
class Choice:
    """One generated answer: the engine's ids, log-probs and finish, and the parsed message."""

    output_ids: list[int]
    log_probs: list[float]
    token_texts: list[str]
    parsed: ParsedOutput
    finish_reason: str  # stop | length | tool_calls
    matched_stop: str | None = None
    call_ids: list[str] = field(default_factory=list)  # one per tool call


@dataclass
class Completion:
    """What one call produced: its choices, the prompt the engine got, and what was applied."""

    id: str
    model: str
    prompt_ids: list[int]  # as the engine received them (one pad per image)
    choices: list[Choice]
    applied: dict  # the sampling the engine got (max_tokens, temperature, top_p, seed)
    weight_version: str | None = None
    cached_tokens: int = 0

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.output_ids) for c in self.choices)


# ---------------------------------------------------------------- validation helpers


def check_text(body: Any, where: str = "body") -> None:
    """Every string of a decoded body is Unicode text (JSON's ``\\ud800`` escapes decode to lone
    surrogates, which no answer that echoes them, no tokenizer and no log can encode): else 400 naming it."""
    stack = [(body, where)]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise bad(path.removeprefix("body."), "holds a lone surrogate, which is not Unicode text") from None
        elif isinstance(value, dict):
            for key, item in value.items():
                stack.append((key, f"{path} (a key)"))
                stack.append((item, f"{path}.{key}"))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(value))


def text_chars(messages: list[dict], tools: list[dict] | None) -> int:
    """The characters of text a request asks the template to render (images not counted)."""
    total = len(json.dumps(tools, ensure_ascii=False)) if tools else 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(part.get("text") or "") for part in content if isinstance(part, dict))
        total += len(message.get("reasoning_content") or "")
        total += sum(len(json.dumps(c, ensure_ascii=False)) for c in message.get("tool_calls") or [])
    return total


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def number(body: dict, key: str, low: float, high: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise bad(key, f"must be a number, got {json.dumps(value)[:60]}")
    if not low <= value <= high:
        raise bad(key, f"must be between {low} and {high}, got {value}")
    return float(value)


def integer(body: dict, key: str, low: int, high: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not _is_int(value):
        raise bad(key, f"must be an integer, got {json.dumps(value)[:60]}")
    if value < low or (high is not None and value > high):
        raise bad(key, f"must be between {low} and {high}, got {value}" if high else f"must be >= {low}, got {value}")
    return value


def boolean(body: dict, key: str, default: bool = False) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(key, f"must be true or false, got {json.dumps(value)[:60]}")
    return value


def stops(value, key: str) -> list[str]:
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise bad(key, "must be a non-empty string or a list of them")
    if len(items) > MAX_STOPS:
        raise bad(key, f"at most {MAX_STOPS} stop strings, got {len(items)}")
    return list(items)


def image_ref(url: Any, where: str, allow_paths: bool) -> str:
    """An image reference the engine can load: a data URI, raw base64, or (on loopback) a file path."""
    if not isinstance(url, str) or not url:
        raise bad(where, "an image must be a data URI, base64 string or file path")
    if url.startswith(("http://", "https://")):
        raise bad(where, "http(s) image URLs are not fetched by the gateway; send the image as a data URI")
    looks_like_path = url.startswith(("file://", "/", "./", "../"))
    if looks_like_path and not allow_paths:
        raise bad(where, "file paths are accepted only while the gateway listens on loopback; send a data URI")
    return url


def tool_schemas(value, key: str = "tools") -> list[dict] | None:
    """OpenAI ``tools`` -> the same list, checked: ``{"type": "function", "function": {"name", ...}}``."""
    if value is None:
        return None
    if not isinstance(value, list) or len(value) > 128:
        raise bad(key, "must be a list of at most 128 function tools")
    for k, tool in enumerate(value):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise bad(f"{key}[{k}]", 'must be {"type": "function", "function": {...}}')
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise bad(f"{key}[{k}].function.name", "must be a non-empty string")
        if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
            raise bad(f"{key}[{k}].function.parameters", "must be a JSON schema object")
    return value or None


def sampling_fields(body: dict, stop_key: str) -> dict:
    """The ChatRequest fields both APIs spell alike (stop strings under ``stop_key``)."""
    return {
        "temperature": number(body, "temperature", 0.0, 2.0),
        "top_p": number(body, "top_p", 0.0, 1.0),
        "top_k": integer(body, "top_k", -1),
        "stop": stops(body.get(stop_key), stop_key),
        "seed": integer(body, "seed", -(2**63), 2**63 - 1),
        "stream": boolean(body, "stream"),
        "model": body.get("model") or "",
    }


# ---------------------------------------------------------------- OpenAI requests

OPENAI_FIELDS = {
    "model", "messages", "tools", "tool_choice", "temperature", "top_p", "top_k", "max_tokens",
    "max_completion_tokens", "stop", "seed", "n", "logprobs", "top_logprobs", "stream", "stream_options",
    "return_token_ids", "skip_special_tokens", "user", "parallel_tool_calls", "frequency_penalty",
    "presence_penalty", "response_format", "metadata", "store",
}  # fmt: skip
# Accepted only at their defaults: anything else is a 400 rather than silently ignored.
OPENAI_DEFAULTS = {"frequency_penalty": 0, "presence_penalty": 0, "top_logprobs": 0}


def _openai_content(content, where: str, allow_paths: bool) -> tuple[str | list[dict], int]:
    """A message's content -> (the template's content, images in it)."""
    if isinstance(content, str):
        return content, 0
    if not isinstance(content, list):
        raise bad(where, "must be a string or a list of content parts")
    parts, images = [], 0
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else image
            parts.append({"type": "image", "image": image_ref(url, f"{where}[{k}].image_url.url", allow_paths)})
            images += 1
        else:
            raise bad(f"{where}[{k}]", 'must be {"type": "text", "text": ...} or {"type": "image_url", ...}')
    return parts, images


def text_only(content, where: str) -> str:
    """A string, or a list of text parts (the Anthropic API's text blocks too), as one string."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise bad(where, "must be a string or a list of text parts")


def openai_tool_calls(value, where: str) -> list[dict]:
    if not isinstance(value, list):
        raise bad(where, "must be a list")
    calls = []
    for k, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad(f"{where}[{k}]", 'must be {"id", "type": "function", "function": {"name", "arguments"}}')
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except ValueError:
                raise bad(f"{where}[{k}].function.arguments", "must be a JSON object encoded as a string") from None
        if not isinstance(arguments, dict):
            raise bad(f"{where}[{k}].function.arguments", "must encode a JSON object")
        calls.append(tool_call(call.get("id"), function["name"], arguments))
    return calls


def tool_call(call_id, name: str, arguments: dict) -> dict:
    """An assistant tool call as the chat template takes it (arguments an object)."""
    return {"id": str(call_id or ""), "type": "function", "function": {"name": name, "arguments": arguments}}


def openai_messages(value, allow_paths: bool) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise bad("messages", "must be a non-empty list")
    if len(value) > MAX_MESSAGES:
        raise bad("messages", f"at most {MAX_MESSAGES} messages, got {len(value)}")
    out, images = [], 0
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad(where, "must be an object")
        role = message.get("role")
        if role == "developer":
            role = "system"
        if role in ("system", "user"):
            content, count = _openai_content(message.get("content"), f"{where}.content", allow_paths)
            if role == "system" and count:
                raise bad(f"{where}.content", "a system message cannot hold images")
            images += count
            out.append({"role": role, "content": content})
        elif role == "assistant":
            content = message.get("content")
            text = "" if content is None else text_only(content, f"{where}.content")
            entry: dict = {"role": "assistant", "content": text}
            if message.get("tool_calls"):
                entry["tool_calls"] = openai_tool_calls(message["tool_calls"], f"{where}.tool_calls")
            reasoning = message.get("reasoning_content", message.get("reasoning"))
            if reasoning is not None:
                if not isinstance(reasoning, str):
                    raise bad(f"{where}.reasoning_content", "must be a string")
                entry["reasoning_content"] = reasoning
            out.append(entry)
        elif role == "tool":
            content = text_only(message.get("content", ""), f"{where}.content")
            out.append({"role": "tool", "content": content, "tool_call_id": str(message.get("tool_call_id") or "")})
        else:
            raise bad(
                f"{where}.role", f"must be system, developer, user, assistant or tool, got {json.dumps(role)[:40]}"
            )
    if images > MAX_IMAGES:
        raise bad("messages", f"at most {MAX_IMAGES} images per request, got {images}")
    return out


def parse_openai(body: dict, allow_paths: bool) -> ChatRequest:
    """A Chat Completions body -> ChatRequest; GatewayError names the first field it cannot honour."""
    unknown = sorted(set(body) - OPENAI_FIELDS)
    if unknown:
        raise bad(unknown[0], "is not supported by the slime_mt gateway")
    for key, default in OPENAI_DEFAULTS.items():
        if body.get(key) not in (None, default):
            raise bad(key, f"only {default} is supported (the gateway returns the sampled token's log-prob)")
    if body.get("response_format") not in (None, {"type": "text"}):
        raise bad("response_format", 'only {"type": "text"} is supported')
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise bad("model", "must be a string")
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise bad("tool_choice", 'only "auto" and "none" are supported')
    max_tokens = integer(body, "max_completion_tokens", 1)
    max_tokens = max_tokens if max_tokens is not None else integer(body, "max_tokens", 1)
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise bad("stream_options", 'only {"include_usage": bool} is supported')
    return ChatRequest(
        messages=openai_messages(body.get("messages"), allow_paths),
        tools=tool_schemas(body.get("tools")),
        tool_choice=choice or "auto",
        max_tokens=max_tokens,
        n=integer(body, "n", 1, MAX_CHOICES) or 1,
        logprobs=boolean(body, "logprobs"),
        return_token_ids=boolean(body, "return_token_ids"),
        skip_special_tokens=boolean(body, "skip_special_tokens", True),
        include_usage=boolean(options or {}, "include_usage"),
        parallel_tool_calls=boolean(body, "parallel_tool_calls", True),
        **sampling_fields(body, "stop"),
    )


# ---------------------------------------------------------------- OpenAI answers


def _message(choice: Choice) -> dict:
    parsed = choice.parsed
    message: dict = {
        "role": "assistant",
        "content": parsed.content if (parsed.content or not parsed.tool_calls) else None,
    }
    if parsed.reasoning is not None:
        message["reasoning_content"] = parsed.reasoning
    if parsed.tool_calls:
        message["tool_calls"] = [
            {"id": call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments_json()}}
            for call_id, call in zip(choice.call_ids, parsed.tool_calls)
        ]
    return message


def _logprobs(choice: Choice) -> dict:
    return {
        "content": [
            {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8")), "top_logprobs": []}
            for text, lp in zip(choice.token_texts, choice.log_probs)
        ]
    }


def usage(completion: Completion) -> dict:
    prompt = len(completion.prompt_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion.completion_tokens,
        "total_tokens": prompt + completion.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": completion.cached_tokens},
    }


def openai_response(completion: Completion, request: ChatRequest) -> dict:
    choices = []
    for index, choice in enumerate(completion.choices):
        entry = {
            "index": index,
            "message": _message(choice),
            "finish_reason": choice.finish_reason,
            "logprobs": _logprobs(choice) if request.logprobs else None,
        }
        if request.return_token_ids:
            entry["token_ids"] = list(choice.output_ids)
        choices.append(entry)
    out = {
        "id": completion.id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": completion.model,
        "choices": choices,
        "usage": usage(completion),
        "slime_mt": {"applied": completion.applied, "weight_version": completion.weight_version},
    }
    if request.return_token_ids:
        out["prompt_token_ids"] = list(completion.prompt_ids)
    return out


def openai_chunks(completion: Completion, request: ChatRequest) -> list[dict]:
    """The answer as ``chat.completion.chunk`` objects: per choice a role chunk, the reasoning and
    content token by token, each tool call whole, and the finish; then usage when asked for. Joined,
    they give the non-streaming message."""
    created = int(time.time())
    chunks: list[dict] = []

    def chunk(index: int, delta: dict, finish: str | None = None, extra: dict | None = None) -> None:
        choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None, **(extra or {})}
        chunks.append(
            {"id": completion.id, "object": "chat.completion.chunk", "created": created, "model": completion.model,
             "choices": [choice]}
        )  # fmt: skip

    for index, choice in enumerate(completion.choices):
        message = _message(choice)
        chunk(index, {"role": "assistant", "content": ""})
        if message.get("reasoning_content"):
            chunk(index, {"reasoning_content": message["reasoning_content"]})
        if message["content"]:
            for piece in content_pieces(message["content"], choice.token_texts):
                chunk(index, {"content": piece})
        for k, call in enumerate(message.get("tool_calls", [])):
            chunk(index, {"tool_calls": [{"index": k, **call}]})
        extra = {"token_ids": list(choice.output_ids)} if request.return_token_ids else None
        chunk(index, {}, choice.finish_reason, extra)
        if request.logprobs:
            chunks[-1]["choices"][0]["logprobs"] = _logprobs(choice)
    if request.return_token_ids and chunks:
        chunks[0]["prompt_token_ids"] = list(completion.prompt_ids)
    if request.include_usage:
        chunks.append(
            {"id": completion.id, "object": "chat.completion.chunk", "created": created, "model": completion.model,
             "choices": [], "usage": usage(completion)}
        )  # fmt: skip
    return chunks


def content_pieces(content: str, token_texts: list[str]) -> list[str]:
    """``content`` cut where the tokens' texts cut it, as far as they spell it; the rest in one piece."""
    pieces, position = [], 0
    for text in token_texts:
        if text and content.startswith(text, position):
            pieces.append(text)
            position += len(text)
    if position < len(content):
        pieces.append(content[position:])
    return pieces
