"""Context policies: what the model sees at each turn, given the conversation so far.

A policy is ``policy(args, sample, prompt, turns) -> messages`` (sync or ``async``): ``prompt`` is
the sample's prompt messages, ``turns[k]`` the k-th turn's messages (the assistant message with the
decoded output, then the observation messages the env answered with). It returns the messages the
next engine call renders; it must not mutate its inputs. It runs before every engine call after the
first. ``args`` is the slime-style namespace, so a policy may call the engine
(``args.rollout_context.client``), e.g. to summarise.

When the returned messages equal the append-only conversation, the turn is token-in/token-out on
the running token sequence. Otherwise the context is rendered by the chat template, except that
assistant messages the policy left unchanged keep their generated ids, and the turn records the
exact ids sent (``Turn.context_ids``) and the images they hold (``Turn.image_indices``).

Built-ins (``--context-policy``):
  append              the whole conversation (default; token-in/token-out throughout)
  strip_thinking      earlier assistant turns without their ``<think>...</think>`` block, as Qwen3's
                      template renders turns before the last user query
  keep_last_images:K  images older than the last K become the text ``[image omitted]``
  window:N            the prompt (system + first user message) and the last N turns
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from slime_mt.config.rollout import CONTEXT_POLICIES, parse_context_policy
from slime_mt.errors import ContextPolicyError
from slime_mt.plugins import load_function

IMAGE_PLACEHOLDER = {"type": "text", "text": "[image omitted]"}

ContextPolicy = Callable[[Any, Any, list, list], Any]


def append(args, sample, prompt: list[dict], turns: list[list[dict]]) -> list[dict]:
    return list(prompt) + [m for turn in turns for m in turn]


def strip_think(content: Any) -> Any:
    """Assistant content without its reasoning, as Qwen3's template drops it: everything up to the
    last ``</think>`` and the newlines after it."""
    if isinstance(content, str) and "</think>" in content:
        return content.split("</think>")[-1].lstrip("\n")
    return content


def strip_thinking(args, sample, prompt: list[dict], turns: list[list[dict]]) -> list[dict]:
    out = list(prompt)
    for assistant, *observations in turns:
        stripped = strip_think(assistant.get("content"))
        out.append(assistant if stripped == assistant.get("content") else dict(assistant, content=stripped))
        out.extend(observations)
    return out


def keep_last_images(args, sample, prompt: list[dict], turns: list[list[dict]], k: int) -> list[dict]:
    # imported here: tokenization loads transformers, and the config imports this module
    from slime_mt.tokenization import image_parts, is_image_part

    messages = append(args, sample, prompt, turns)
    drop = len(image_parts(messages)) - k
    out = []
    for message in messages:
        content = message.get("content")
        if drop <= 0 or not isinstance(content, list) or not any(is_image_part(p) for p in content):
            out.append(message)
            continue
        parts = []
        for part in content:
            if is_image_part(part) and drop > 0:
                parts.append(dict(IMAGE_PLACEHOLDER))
                drop -= 1
            else:
                parts.append(part)
        out.append(dict(message, content=parts))
    return out


def window(args, sample, prompt: list[dict], turns: list[list[dict]], n: int) -> list[dict]:
    return list(prompt) + [m for turn in (turns[-n:] if n else []) for m in turn]


_BUILTINS: dict[str, Callable] = {  # config.rollout.CONTEXT_POLICIES names them and their counts' keywords
    "append": append,
    "strip_thinking": strip_thinking,
    "keep_last_images": keep_last_images,
    "window": window,
}


def load_policy(spec: str = "append", path: str | None = None) -> ContextPolicy:
    """The policy of ``--context-policy-path`` (a user function) or of ``--context-policy``."""
    if path:
        return load_function(path, append, "--context-policy-path")
    name, value = parse_context_policy(spec)
    keyword = CONTEXT_POLICIES[name]
    return functools.partial(_BUILTINS[name], **{keyword: value}) if keyword else _BUILTINS[name]


def kept_outputs(messages: list[dict], turns: list[list[dict]], outputs: list[list[int]]) -> dict[int, list[int]]:
    """The assistant messages a policy returned unchanged -> their generated ids: message index ->
    ``outputs[k]`` of the turn whose answer it equals (turns matched in order, each at most once)."""
    kept, next_turn = {}, 0
    for i, message in enumerate(messages):
        if message.get("role") != "assistant" or message.get("tool_calls"):
            continue
        for k in range(next_turn, len(turns)):
            if turns[k][0]["content"] == message.get("content"):
                kept[i], next_turn = outputs[k], k + 1
                break
    return kept


async def apply_policy(policy: ContextPolicy, args, sample, prompt: list[dict], turns: list[list[dict]]) -> list[dict]:
    """Run a sync or async policy and check that it returned a list of messages."""
    result = policy(args, sample, list(prompt), [list(t) for t in turns])
    if inspect.isawaitable(result):
        result = await result
    if not isinstance(result, list) or not all(isinstance(m, dict) and "role" in m for m in result):
        raise ContextPolicyError(
            f"context policy {getattr(policy, '__name__', policy)!r} must return a list of "
            f"messages with a 'role', got {result!r:.200}"
        )
    return result
