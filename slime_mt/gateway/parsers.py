"""Turn a model's decoded output into an assistant message: reasoning, content and tool calls.

Reasoning parsers (``--reasoning-parser``):
  qwen3   ``<think>...</think>`` at the start of the output (the opening tag may be in the prompt:
          Qwen3's generation prompt with thinking on ends inside the block); without ``</think>``
          the whole output is reasoning only when it opened with ``<think>``
  none    no reasoning

Tool-call parsers (``--tool-call-parser``):
  qwen         Qwen/Hermes: every ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in the
               content is a call, in order; the text outside them stays content
  llama3_json  Llama 3's JSON tool calls: the content is one ``{"name", "parameters"|"arguments"}``
               object, or several separated by ``;``, optionally after ``<|python_tag|>``
  none         no tool calls

A call that does not parse (bad JSON, no name, arguments not an object) leaves the whole content as
plain text, and ``ParsedOutput.malformed_tool_calls`` counts it (the gateway's metrics).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

TOOL_PARSERS = ("qwen", "llama3_json", "none")
REASONING_PARSERS = ("qwen3", "none")

_QWEN_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: dict  # the parsed JSON object; the API gives it as a JSON string

    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass
class ParsedOutput:
    content: str
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    malformed_tool_calls: int = 0


def split_reasoning(text: str, parser: str) -> tuple[str | None, str]:
    """(reasoning or None, the rest) of a decoded output."""
    if parser == "none":
        return None, text
    opened = text.lstrip().startswith("<think>")
    body = text.lstrip()[len("<think>") :] if opened else text
    if "</think>" not in body:
        return (body.strip("\n"), "") if opened else (None, text)
    reasoning, _, rest = body.partition("</think>")
    return reasoning.strip("\n"), rest.lstrip("\n")


def _call_of(obj) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return ToolCall(obj["name"], arguments) if isinstance(arguments, dict) else None


def _parse_qwen(content: str) -> tuple[str, list[ToolCall], int]:
    matches = list(_QWEN_CALL.finditer(content))
    unclosed = content.count("<tool_call>") != len(matches)
    if not matches:
        return content, [], int(unclosed)
    calls = []
    for match in matches:
        try:
            call = _call_of(json.loads(match.group(1)))
        except ValueError:
            call = None
        if call is None:
            return content, [], 1
        calls.append(call)
    if unclosed:
        return content, [], 1
    text = _QWEN_CALL.sub("", content).strip()
    return text, calls, 0


def _parse_llama3(content: str) -> tuple[str, list[ToolCall], int]:
    body = content.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return content, [], 0
    calls = []
    for piece in body.split(";"):
        try:
            call = _call_of(json.loads(piece))
        except ValueError:
            call = None
        if call is None:
            return content, [], 1
        calls.append(call)
    return "", calls, 0


def parse_output(text: str, reasoning_parser: str, tool_parser: str, tools_enabled: bool) -> ParsedOutput:
    """A decoded output -> the assistant message's parts; tool calls only when ``tools_enabled``."""
    reasoning, content = split_reasoning(text, reasoning_parser)
    if not tools_enabled or tool_parser == "none":
        return ParsedOutput(content, reasoning)
    parse = _parse_qwen if tool_parser == "qwen" else _parse_llama3
    content, calls, malformed = parse(content)
    return ParsedOutput(content, reasoning, calls, malformed)
