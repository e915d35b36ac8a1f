"""Prompt and observation encoding. The framework encodes only prompts and observations (plus the
template glue around them); model output is never re-tokenized.

``ObservationEncoder`` uses the fixed-base trick: the chat template renders a fixed base conversation
``[user, assistant]`` followed by the new observation message(s) and the generation prompt; everything
after the base assistant turn's end-of-turn token is the delta. So no system or tool preamble is
repeated, templates that inject a default system prompt (SmolLM2) or render earlier turns
differently (Qwen3's think stripping) are handled, and glue after the end-of-turn token (Qwen's
``\\n`` after ``<|im_end|>``) starts the delta, because the model stops AT ``<|im_end|>``. When the
model's turn did not end with the end-of-turn token (a stop string matched), the delta starts with it.
Images in observations go through the processor: pads expanded, tensors returned.

``encode_context`` renders a whole conversation (a context a policy rewrote) with the template,
keeping the generated ids of the assistant messages it is told to keep: each is rendered as a
sentinel, and the text between sentinels is tokenized piecewise, as the turn loop tokenizes the
text around model output.

``encode_raw_observation`` (``--no-conversation-multi-turn``) wraps an observation's text in a
template and tokenizes it as is, to continue the one assistant message. ``encode_with_assistant_mask``
(``--retokenize-chat-history``) tokenizes a whole render in one piece and marks the assistant
messages' tokens: from the template's ``{% generation %}`` blocks when it has them, else from the
character span of each assistant body (after the generation prompt's role line, through the
end-of-turn token).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from slime_mt.engine.images import load_image
from slime_mt.errors import EncodingError
from slime_mt.processing import QwenVLProcessor, tokenizer_of

_BASE_USER = "slime_mt base question"
_BASE_ASSISTANT = "slime_mt base answer 7f3a"
_KEPT = "\ue000slime_mt kept {}\ue001"  # private-use code points: no template or text contains them
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass
class Encoded:
    """Token ids (image pads expanded), the images they reference, and processor tensors."""

    ids: list[int]
    images: list[Any] = field(default_factory=list)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    text: str = ""


def is_image_part(part: Any) -> bool:
    """A content part that holds an image (``{"type": "image", "image": ...}`` or ``image_url``)."""
    return isinstance(part, dict) and (part.get("type") in ("image", "image_url") or "image" in part)


def image_parts(messages: list[dict]) -> list[Any]:
    """Images of the messages' content parts, in order (``{"type": "image", "image": ...}``)."""
    images = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            for part in content:
                if is_image_part(part):
                    image = part.get("image", part.get("image_url"))
                    if image is None:
                        raise EncodingError(f"image part without an 'image' value in message {message}")
                    images.append(image)
    return images


class ObservationEncoder:
    """Built once per run from a tokenizer (or a QwenVLProcessor) and its chat template."""

    def __init__(
        self, tokenizer_or_processor: Any, tools: list[dict] | None = None, chat_template_kwargs: dict | None = None
    ):
        self.processor = tokenizer_or_processor if isinstance(tokenizer_or_processor, QwenVLProcessor) else None
        self.tokenizer = tokenizer_of(tokenizer_or_processor)
        self.tools = tools
        self.template_kwargs = dict(chat_template_kwargs or {})
        self.eot_id = self._end_of_turn_id()
        self.eot_text = self.tokenizer.convert_ids_to_tokens(self.eot_id)
        self._base = [{"role": "user", "content": _BASE_USER}, {"role": "assistant", "content": _BASE_ASSISTANT}]
        base_text = self.render(self._base, add_generation_prompt=False)
        anchor = base_text.find(_BASE_ASSISTANT)
        if anchor < 0 or base_text.find(self.eot_text, anchor) < 0:
            raise EncodingError(f"chat template does not end assistant turns with {self.eot_text!r}: {base_text!r}")
        self._image_placeholder: str | None = None

    def _end_of_turn_id(self) -> int:
        """The token that closes an assistant turn: the template's ``<|im_end|>`` (Qwen, SmolLM2) or eos."""
        for candidate in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>"):
            token_id = self.tokenizer.convert_tokens_to_ids(candidate)
            if isinstance(token_id, int) and token_id != self.tokenizer.unk_token_id and token_id is not None:
                return token_id
        if self.tokenizer.eos_token_id is None:
            raise EncodingError("tokenizer has no end-of-turn or eos token")
        return self.tokenizer.eos_token_id

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            tools=self.tools,
            **self.template_kwargs,
        )

    def _tokenize(self, text: str, images: list[Any]) -> Encoded:
        if images:
            if self.processor is None:
                raise EncodingError(f"{len(images)} images in a conversation but the model has no image processor")
            pil = [
                load_image(im, f"image {k}") if not hasattr(im, "convert") else im.convert("RGB")
                for k, im in enumerate(images)
            ]
            out = self.processor(text=text, images=pil)
            tensors = {k: out[k] for k in ("pixel_values", "image_grid_thw")}
            return Encoded(out["input_ids"][0].tolist(), pil, tensors, text)
        return Encoded(self.tokenizer(text, add_special_tokens=False)["input_ids"], [], {}, text)

    def encode_prompt(self, messages: list[dict] | str, apply_chat_template: bool = True) -> Encoded:
        """The first context: the conversation with the generation prompt (or a raw string as is)."""
        if isinstance(messages, str) and not apply_chat_template:
            return self._tokenize(messages, [])
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        return self._tokenize(self.render(messages, add_generation_prompt=True), image_parts(messages))

    def encode_observation(self, messages: dict | list[dict], model_ended_turn: bool = True) -> Encoded:
        """Delta tokens that follow the model's turn: template glue, the observation message(s), and
        the next generation prompt. ``model_ended_turn``: the model's output ended with the
        end-of-turn token; if not, the delta starts with it."""
        messages = [messages] if isinstance(messages, dict) else list(messages)
        full = self.render(self._base + messages, add_generation_prompt=True)
        anchor = full.find(_BASE_ASSISTANT)
        eot_at = full.find(self.eot_text, anchor)
        if anchor < 0 or eot_at < 0:
            raise EncodingError(f"base assistant turn not found in the rendered observation: {full[:300]!r}")
        cut = eot_at if not model_ended_turn else eot_at + len(self.eot_text)
        return self._tokenize(full[cut:], image_parts(messages))

    def encode_context(
        self, messages: list[dict], kept: dict[int, list[int]], segment_cache: dict[str, list[int]] | None = None
    ) -> Encoded:
        """``messages`` rendered with the generation prompt, where ``messages[i]`` for ``i`` in ``kept``
        (assistant messages) is ``kept[i]``, its generated ids, verbatim (the message's tool calls and
        reasoning are not rendered again: the ids hold them): those end the turn themselves
        when they end with the end-of-turn token; otherwise the template's end-of-turn follows.
        ``segment_cache`` (text -> ids) keeps the tokenization of image-free text between kept
        messages across calls of one conversation, where the same long prefix comes back every call."""
        # a kept message is its ids alone: its tool calls and reasoning are inside them, not rendered again
        marked = [{"role": m["role"], "content": _KEPT.format(i)} if i in kept else m for i, m in enumerate(messages)]
        text = self.render(marked, add_generation_prompt=True)
        images = image_parts(messages)
        image_text = getattr(self.processor, "image_token", None)
        pieces: list[Encoded | list[int]] = []
        position, used = 0, 0

        def add_text(segment: str) -> None:
            nonlocal used
            count = segment.count(image_text) if image_text else 0
            if segment_cache is not None and not count:
                if segment not in segment_cache:
                    segment_cache[segment] = self._tokenize(segment, []).ids
                pieces.append(Encoded(segment_cache[segment], [], {}, segment))
                return
            pieces.append(self._tokenize(segment, images[used : used + count]))
            used += count

        for i in sorted(kept):
            sentinel = _KEPT.format(i)
            at = text.find(sentinel, position)
            if at < 0 or text.find(sentinel, at + 1) >= 0:
                raise EncodingError(
                    f"the chat template did not render assistant message {i} exactly once as given; "
                    f"its generated ids cannot be kept: {text[:300]!r}"
                )
            add_text(text[position:at])
            pieces.append(list(kept[i]))
            position = at + len(sentinel)
            if kept[i] and kept[i][-1] == self.eot_id:
                if not text.startswith(self.eot_text, position):
                    raise EncodingError(
                        f"assistant message {i} ends with {self.eot_text!r} but the template renders "
                        f"{text[position : position + 40]!r} after it"
                    )
                position += len(self.eot_text)
        add_text(text[position:])
        if used != len(images):
            raise EncodingError(f"{len(images)} images in the messages but {used} image placeholders rendered")
        ids, tensors = [], {}
        for piece in pieces:
            if isinstance(piece, Encoded):
                ids.extend(piece.ids)
                for key, value in piece.tensors.items():
                    tensors.setdefault(key, []).append(value)
            else:
                ids.extend(piece)
        joined = {key: torch.cat(parts) for key, parts in tensors.items()}
        return Encoded(ids, [im for p in pieces if isinstance(p, Encoded) for im in p.images], joined, text)

    # ------------------------------------------------------------ --no-conversation-multi-turn

    @property
    def image_placeholder(self) -> str:
        """How the template renders one image inside a message (Qwen-VL: vision start, pad, vision end)."""
        if self._image_placeholder is None:
            if self.processor is None:
                raise EncodingError("an image in an observation but the model has no image processor")
            left, right = "\ue000slime_mt left\ue001", "\ue000slime_mt right\ue001"
            text = self.render(
                [
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": left}, {"type": "image"}, {"type": "text", "text": right}],
                    }
                ],
                False,
            )
            start, end = text.find(left), text.find(right)
            placeholder = text[start + len(left) : end] if 0 <= start < end else ""
            if placeholder.count(self.processor.image_token) != 1:
                raise EncodingError(
                    f"the chat template renders no single {self.processor.image_token} for an image "
                    f"part: {text[:300]!r}"
                )
            self._image_placeholder = placeholder
        return self._image_placeholder

    def encode_raw_observation(self, messages: dict | list[dict], template: str) -> Encoded:
        """Observation messages as raw text inside the running assistant message: their contents (text
        parts as is, images as the template renders them), joined by newlines, put in ``template``
        at ``{observation}``."""
        messages = [messages] if isinstance(messages, dict) else list(messages)
        pieces = []
        for message in messages:
            content = message.get("content", "")
            if isinstance(content, str):
                pieces.append(content)
            elif isinstance(content, list):
                pieces.append(
                    "".join(
                        self.image_placeholder if is_image_part(part) else str(part.get("text", "")) for part in content
                    )
                )
            else:
                raise EncodingError(f"observation content must be a string or a list of parts, got {content!r:.100}")
        return self._tokenize(template.replace("{observation}", "\n".join(pieces)), image_parts(messages))

    # ------------------------------------------------------------ --retokenize-chat-history

    def encode_with_assistant_mask(self, messages: list[dict]) -> tuple[Encoded, list[int]]:
        """The whole conversation rendered (no generation prompt) and tokenized in one piece, with a
        mask that is 1 on the tokens of every assistant message: from the template's generation
        blocks, else from each assistant body's character span. Image pads are expanded (mask 0)."""
        text = self.render(messages, add_generation_prompt=False)
        images = image_parts(messages)
        assistants = sum(1 for m in messages if m.get("role") == "assistant")
        template = self.template_kwargs.get("chat_template") or self.tokenizer.chat_template
        if isinstance(template, str) and _GENERATION_TAG.search(template):
            out = self.tokenizer.apply_chat_template(
                messages,
                tools=self.tools,
                tokenize=True,
                return_dict=True,
                return_assistant_tokens_mask=True,
                **self.template_kwargs,
            )
            ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
        else:
            out = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            ids, spans = list(out["input_ids"]), self.assistant_spans(text, assistants)
            mask = [int(any(start < b and end > a for a, b in spans)) for start, end in out["offset_mapping"]]
        runs = mask_runs(mask)
        if len(runs) != assistants:
            raise EncodingError(
                f"the chat template marks {len(runs)} assistant spans for {assistants} assistant "
                f"messages: {text[:300]!r}"
            )
        if not images:
            return Encoded(ids, [], {}, text), mask
        encoded = self._tokenize(text, images)
        counts = iter(self.processor.num_image_tokens(encoded.tensors["image_grid_thw"]))
        pad = self.processor.image_token_id
        expanded_mask = [m for t, m in zip(ids, mask) for _ in range(next(counts) if t == pad else 1)]
        if len(expanded_mask) != len(encoded.ids):
            raise EncodingError(
                f"{len(expanded_mask)} mask entries after expanding image pads but the processor "
                f"gave {len(encoded.ids)} tokens"
            )
        return encoded, expanded_mask

    @functools.cached_property
    def _assistant_header(self) -> tuple[str, str]:
        """(the generation prompt's role line, the rest of it), from the template once."""
        prompt = self.render([{"role": "user", "content": _BASE_USER}], add_generation_prompt=False)
        generation = self.render([{"role": "user", "content": _BASE_USER}], add_generation_prompt=True)
        if not generation.startswith(prompt) or len(generation) == len(prompt):
            raise EncodingError(
                f"the chat template's generation prompt is not an extension of the render: "
                f"{prompt[-80:]!r} vs {generation[-80:]!r}"
            )
        role_line, newline, rest = generation[len(prompt) :].lstrip().partition("\n")
        return role_line + newline, rest

    def assistant_spans(self, text: str, count: int) -> list[tuple[int, int]]:
        """Character spans of the first ``count`` assistant bodies of a render: each starts after the
        generation prompt's role line (and the rest of the generation prompt when the template put it
        there too) and ends after the next end-of-turn token."""
        role_line, rest = self._assistant_header
        spans, position = [], 0
        for k in range(count):
            at = text.find(role_line, position)
            if at < 0:
                raise EncodingError(
                    f"assistant message {k}: {role_line!r} not found in the render after character {position}"
                )
            start = at + len(role_line)
            if rest and text.startswith(rest, start):
                start += len(rest)
            end = text.find(self.eot_text, start)
            if end < 0:
                raise EncodingError(f"assistant message {k}: no {self.eot_text!r} after its body")
            spans.append((start, end + len(self.eot_text)))
            position = end + len(self.eot_text)
        return spans


def mask_runs(mask: list[int]) -> list[tuple[int, int]]:
    """The ``[start, end)`` runs of 1s in a 0/1 mask."""
    runs, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs
