"""One gateway session = one sample: every call rendered with the exact ids the model generated
earlier, sent to the engine, and recorded as a turn of the sample.

Rendering a call (``Session.render``): the request's messages through the chat template, except that
an assistant message the gateway produced earlier in this session keeps its generated ids
(``ObservationEncoder.encode_context``): same content and tool calls, and the same reasoning or none
(a harness that dropped the reasoning keeps the ids of the answer after ``</think>``; the template
renders what it renders around them). Nothing the model generated is tokenized again.

Recording a call (``Session.record``), in the order calls finish:
  - the first call's context becomes the sample's prompt;
  - a call whose context extends the sample's running sequence (previous context + output, append-only)
    adds the difference as observation tokens (loss mask 0) and its output: one token sequence;
  - any other call (history rewritten, or the 2nd..n-th choice of ``n``) is a turn with its own
    ``context_ids``; its output still joins ``sample.tokens`` (so step-wise training and merging see
    every output), and ``--merge-step-wise`` merges the calls that extend one another again.
Each turn keeps its image indices (``Turn.image_indices``) into the sample's images, its finish
reason, weight version and engine time; ``sample.metadata["gateway"]`` counts calls, kept messages,
rewritten contexts and malformed tool calls.
"""

from __future__ import annotations

import asyncio
import collections
import json
import secrets
import time
import uuid
from dataclasses import dataclass

from slime_mt.engine.clients.priority import EVALUATION, group_version, set_rank
from slime_mt.engine.images import encode_image
from slime_mt.engine.protocol import collapse_image_pads
from slime_mt.errors import EncodingError, GatewayError
from slime_mt.gateway.chat import ChatRequest, Choice, Completion, bad, text_chars
from slime_mt.gateway.parsers import ParsedOutput, parse_output
from slime_mt.multimodal import MultimodalBuffer
from slime_mt.rollout.context import RolloutContext
from slime_mt.rollout.finalize import image_rows
from slime_mt.rollout.multi_turn import generate_turn, turn_seed, version_name
from slime_mt.types import Sample, Turn

# a request with more characters of text than this many per token of the context budget is refused
# unread: no tokenizer's tokens are that long on average (a real context is 3-5 characters a token)
MAX_CHARS_PER_TOKEN = 32


@dataclass
class Produced:
    """An assistant message the gateway answered with, and the ids that spell it."""

    content: str
    tool_calls: list[tuple[str, str]]  # (name, arguments as canonical JSON)
    reasoning: str | None
    ids: list[int]
    answer_ids: list[int] | None  # the ids after the reasoning; None: no reasoning, or no clean cut


@dataclass
class Rendered:
    engine_ids: list[int]  # one pad per image, what the engine gets
    ids: list[int]  # pads expanded, what training sees
    images: list  # PIL images, in order
    image_data: list[str]  # the same as data URIs
    tensors: dict
    kept: int  # assistant messages whose generated ids were kept


def _calls_key(tool_calls) -> list[tuple[str, str]]:
    return [
        (call["function"]["name"], json.dumps(call["function"]["arguments"], sort_keys=True, ensure_ascii=False))
        for call in tool_calls or []
    ]


def _tools_text(tools: list[dict]) -> str:
    """Tool schemas in the Qwen/Hermes system-prompt format, for templates that do not render tools."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{lines}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
        "</tool_call>"
    )


def _call_text(call: dict) -> str:
    body = json.dumps(
        {"name": call["function"]["name"], "arguments": call["function"]["arguments"]}, ensure_ascii=False
    )
    return f"<tool_call>\n{body}\n</tool_call>"


def for_template(messages: list[dict], tools: list[dict] | None, template: str, has_processor: bool) -> list[dict]:
    """Messages a template that knows no tools (SmolLM2's) can render: the tool schemas join the system
    message in the Qwen/Hermes format and an assistant's tool calls its content, as the model would
    write them; text parts become one string where the model has no image processor."""
    knows_tools = "tool_calls" in template and "tools" in template
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list) and not has_processor:
            if any(p.get("type") == "image" for p in content):
                raise bad("messages", "the served model takes no images")
            m = dict(m, content="".join(p["text"] for p in content))
        if not knows_tools and m.get("tool_calls"):
            text = "\n".join([m["content"]] * bool(m["content"]) + [_call_text(c) for c in m["tool_calls"]])
            m = {"role": "assistant", "content": text}
        out.append(m)
    if tools and not knows_tools:
        if out and out[0]["role"] == "system" and isinstance(out[0]["content"], str):
            out[0] = dict(out[0], content=out[0]["content"] + "\n\n" + _tools_text(tools))
        else:
            out.insert(0, {"role": "system", "content": _tools_text(tools)})
    return out


class Session:
    """One sample's calls. Created by the gateway (``Gateway.open``), closed when the agent ends."""

    def __init__(self, ctx: RolloutContext, sample: Sample, sampling_params: dict, settings, model_name: str = ""):
        self.sid = secrets.token_urlsafe(24)
        self.evaluation = group_version.get() == EVALUATION  # opened in its trajectory's task (set_rank)
        self.ctx, self.sample, self.settings, self.model_name = ctx, sample, settings, model_name
        self.sampling_params = dict(sampling_params)
        self.buffer = MultimodalBuffer()
        self.token_images: list[int] = []  # buffer indices of the images in sample.tokens, in order
        self.produced: list[Produced] = []
        self.metrics: collections.Counter = collections.Counter()
        self.calls = 0  # seeds: the k-th call of the session
        self.in_flight: set[asyncio.Task] = set()
        self.closed = False
        self.termination: str | None = None  # set when a call was refused for the context budget
        self._record = asyncio.Lock()
        self._segments: dict[str, list[int]] = {}  # text between kept messages -> its ids, reused by later calls
        sample.tokens, sample.response_length = [], 0  # the agent's calls define the prompt
        sample.loss_mask, sample.rollout_log_probs, sample.token_versions = [], [], []
        sample.turns, sample.weight_versions, sample.response = [], [], ""

    # ------------------------------------------------------------ rendering

    def _kept(self, messages: list[dict]) -> dict[int, list[int]]:
        """Message index -> generated ids, for the assistant messages this session produced (an output
        holding an image pad is never kept: the engine would read the pad as an image)."""
        pad = getattr(self.ctx.processor, "image_token_id", None)
        kept = {}
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            key = (m.get("content") or "", _calls_key(m.get("tool_calls")))
            reasoning = m.get("reasoning_content")
            for p in reversed(self.produced):
                if (p.content, p.tool_calls) != key or pad in p.ids:
                    continue
                if reasoning == p.reasoning or (p.reasoning is None and not reasoning):
                    kept[i] = p.ids
                elif reasoning is None and p.answer_ids is not None:
                    kept[i] = p.answer_ids
                else:
                    continue
                break
        return kept

    def render(self, request: ChatRequest) -> Rendered:
        encoder = self.ctx.encoder(request.tools)
        template = encoder.template_kwargs.get("chat_template") or encoder.tokenizer.chat_template or ""
        messages = for_template(request.messages, request.tools, template, encoder.processor is not None)
        shift = len(messages) - len(request.messages)  # a system message of tools put in front
        kept = {i + shift: ids for i, ids in self._kept(request.messages).items()}
        try:
            encoded = encoder.encode_context(messages, kept, self._segments)
        except (EncodingError, ValueError, TypeError) as e:  # a template or processor that cannot render them
            raise bad("messages", f"the chat template cannot render them: {e}") from None
        pad = getattr(self.ctx.processor, "image_token_id", None)
        engine_ids = collapse_image_pads(encoded.ids, pad)[0] if pad is not None else list(encoded.ids)
        return Rendered(
            engine_ids,
            encoded.ids,
            encoded.images,
            [encode_image(im) for im in encoded.images],
            encoded.tensors,
            len(kept),
        )

    # ------------------------------------------------------------ generating

    def _params(self, request: ChatRequest, room: int) -> dict:
        r = self.ctx.rollout
        params = dict(self.sampling_params)
        if not self.settings.gateway_enforce_sampling:
            for key, value in (
                ("temperature", request.temperature),
                ("top_p", request.top_p),
                ("top_k", request.top_k),
            ):
                if value is not None:
                    params[key] = value
        limit = request.max_tokens or r.rollout_max_response_len
        params["max_new_tokens"] = min(limit, r.rollout_max_response_len, room)
        params["stop"] = list(request.stop) or params.get("stop") or []
        if not params["stop"]:
            params.pop("stop")
        params["skip_special_tokens"] = request.skip_special_tokens
        params["no_stop_trim"] = True  # the ids keep the stop string; the content is cut here
        return params

    def _rank(self) -> None:
        """This call's engine requests rank as its trajectory's (``set_rank``): by its group's age, an
        evaluation's last (the gateway answers in a task of its own, outside the trajectory's)."""
        ctx = self.ctx
        start_version = self.sample.metadata.get("start_version")
        set_rank(ctx.priority_scheduling, ctx.rollout.oldest_groups_first, start_version, self.evaluation)

    async def complete(self, request: ChatRequest) -> Completion:
        """Render, generate (``n`` choices), record -> the answer. GatewayError for what the request
        asks that cannot be served (the context budget included). A request whose text cannot fit the
        context budget is refused before it is tokenized; the rest is rendered in a worker thread (the
        tokenizer lets the event loop go on), so one huge request does not stall the other sessions."""
        budget = self.ctx.rollout.rollout_max_context_len
        chars = text_chars(request.messages, request.tools)
        if chars > budget * MAX_CHARS_PER_TOKEN:
            self.termination = "context_exhausted"
            raise GatewayError(
                400,
                f"messages: {chars} characters of text cannot fit this run's context of {budget} tokens "
                f"(--rollout-max-context-len; at most {MAX_CHARS_PER_TOKEN} characters a token are taken)",
                kind="context_length_exceeded",
                param="messages",
            )
        rendered = await asyncio.to_thread(self.render, request)
        room = budget - len(rendered.ids)
        if room <= 0:
            self.termination = "context_exhausted"
            raise GatewayError(
                400,
                f"messages: the context is {len(rendered.ids)} tokens; this run allows "
                f"{self.ctx.rollout.rollout_max_context_len} with the answer (--rollout-max-context-len)",
                kind="context_length_exceeded",
                param="messages",
            )
        params = self._params(request, room)
        call_index = self.calls
        self.calls += 1
        seed = request.seed
        if seed is None:  # a seed per (run seed, step, sample, call), as the turn loop draws them
            seed = turn_seed(
                self.ctx.data.rollout_seed,
                self.sample.metadata.get("rollout_id", 0),
                self.sample.index or 0,
                call_index,
            )
        started = time.perf_counter()
        self._rank()
        results = await asyncio.gather(
            *(
                generate_turn(
                    self.ctx,
                    self.sample,
                    rendered.engine_ids,
                    dict(params, sampling_seed=(seed + k) % (2**31 - 1)),
                    rendered.image_data,
                )
                for k in range(request.n)
            )
        )
        engine_seconds = time.perf_counter() - started
        choices = [self._choice(request, ids, logprobs, meta) for ids, logprobs, _, _, meta in results]
        async with self._record:
            for k, (ids, logprobs, versions, _, meta) in enumerate(results):
                self._add_turn(rendered, ids, logprobs, versions, meta, engine_seconds, extends=k == 0)
                self._remember(choices[k], ids)
        self.metrics["calls"] += 1
        self.metrics["choices"] += request.n
        self.metrics["kept_messages"] += rendered.kept
        self.metrics["malformed_tool_calls"] += sum(c.parsed.malformed_tool_calls for c in choices)
        self.metrics["tool_calls"] += sum(len(c.parsed.tool_calls) for c in choices)
        meta = results[0][4]
        return Completion(
            id=f"chatcmpl-{uuid.uuid4().hex}",
            model=request.model or self.model_name,
            prompt_ids=list(rendered.engine_ids),
            choices=choices,
            applied={
                "max_tokens": params["max_new_tokens"],
                "temperature": params.get("temperature"),
                "top_p": params.get("top_p"),
                "top_k": params.get("top_k"),
                "seed": seed,
            },
            weight_version=version_name(self.ctx, meta.get("weight_version")),
            cached_tokens=int(meta.get("cached_tokens") or 0),
        )

    def _choice(self, request: ChatRequest, ids: list[int], logprobs: list[float], meta: dict) -> Choice:
        tokenizer = self.ctx.tokenizer
        text = tokenizer.decode(ids, skip_special_tokens=request.skip_special_tokens)
        finish = meta["finish_reason"]
        matched = finish.get("matched") if isinstance(finish.get("matched"), str) else None
        if matched and matched in text:
            text = text[: text.index(matched)]
        tools_on = bool(request.tools) and request.tool_choice != "none"
        parsed = parse_output(text, self.settings.reasoning_parser, self.settings.tool_call_parser, tools_on)
        if parsed.tool_calls and not request.parallel_tool_calls:
            parsed.tool_calls = parsed.tool_calls[:1]
        reason = "length" if finish["type"] == "length" else "tool_calls" if parsed.tool_calls else "stop"
        texts = [tokenizer.decode([i], skip_special_tokens=request.skip_special_tokens) for i in ids]
        call_ids = [f"call_{uuid.uuid4().hex[:24]}" for _ in parsed.tool_calls]
        return Choice(list(ids), list(logprobs), texts, parsed, reason, matched, call_ids)

    # ------------------------------------------------------------ recording

    def _answer_ids(self, ids: list[int], parsed: ParsedOutput) -> list[int] | None:
        """The ids after ``</think>`` and the newlines that follow it (what Qwen3's template keeps)."""
        if parsed.reasoning is None:
            return None
        end = self.ctx.tokenizer.convert_tokens_to_ids("</think>")
        if not isinstance(end, int) or end not in ids:
            return None
        cut = ids.index(end) + 1
        while cut < len(ids) and self.ctx.tokenizer.decode([ids[cut]]).strip("\n") == "":
            cut += 1
        return ids[cut:]

    def _remember(self, choice: Choice, ids: list[int]) -> None:
        parsed = choice.parsed
        calls = [{"function": {"name": c.name, "arguments": c.arguments}} for c in parsed.tool_calls]
        self.produced.append(
            Produced(parsed.content, _calls_key(calls), parsed.reasoning, list(ids), self._answer_ids(ids, parsed))
        )

    def _image_indices(self, rendered: Rendered, append_only: bool) -> list[int]:
        """Buffer indices of the call's images: an append-only call keeps the sequence's images and adds
        the rest; another call finds each among the session's images (same pixels) or adds it."""
        known = self.buffer.image_data
        indices, new = [], []
        for k, data in enumerate(rendered.image_data):
            if append_only and k < len(self.token_images):
                indices.append(self.token_images[k])
            elif not append_only and data in known:
                indices.append(known.index(data))
            else:
                indices.append(len(known) + len(new))
                new.append(k)
        if new:
            self.buffer.append(image_rows(rendered.tensors, new), [rendered.images[k] for k in new])
        return indices

    def _extends(self, rendered: Rendered) -> bool:
        """The call's context is the sample's running sequence plus more (images included)."""
        tokens = self.sample.tokens
        if not tokens:
            return True
        if len(rendered.ids) < len(tokens) or rendered.ids[: len(tokens)] != tokens:
            return False
        data = self.buffer.image_data
        return len(rendered.image_data) >= len(self.token_images) and all(
            data[i] == rendered.image_data[k] for k, i in enumerate(self.token_images)
        )

    def _add_turn(self, rendered, ids, logprobs, versions, meta, engine_seconds, extends: bool) -> None:
        sample = self.sample
        append_only = extends and self._extends(rendered)
        indices = self._image_indices(rendered, append_only)
        if not sample.tokens:
            sample.set_prompt_tokens(rendered.ids)
        elif append_only:
            sample.append_observation_tokens(rendered.ids[len(sample.tokens) :])
            if sample.turns:
                sample.turns[-1].observation_end = len(sample.tokens)
        else:
            self.metrics["rewritten_calls"] += 1
        if append_only:
            self.token_images = list(indices)
        start = len(sample.tokens)
        sample.append_model_runs(ids, logprobs, versions)
        turn = Turn(
            output_start=start,
            output_end=len(sample.tokens),
            observation_end=len(sample.tokens),
            finish_reason=meta["finish_reason"]["type"],
            weight_version=version_name(self.ctx, meta.get("weight_version")),
            engine_seconds=engine_seconds,
            num_images=len(indices),
            context_ids=None if append_only else list(rendered.ids),
            image_indices=indices,
        )
        sample.turns.append(turn)
        if turn.weight_version is not None:
            sample.weight_versions.append(turn.weight_version)

    # ------------------------------------------------------------ the end

    def finish(self) -> None:
        """Put the session's images and counters on the sample (once, when the agent is done)."""
        sample = self.sample
        sample.multimodal_train_inputs = self.buffer.finalize()
        if self.buffer.num_images:
            sample.multimodal_inputs = {**(sample.multimodal_inputs or {}), "image_data": self.buffer.image_data}
        sample.metadata["gateway"] = dict(self.metrics)
