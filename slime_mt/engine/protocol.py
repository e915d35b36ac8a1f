"""SGLang's native ``/generate`` protocol (0.5.x), parsed and validated; the two views of image pads.

Request (``GenerateReqInput``): ``text`` or ``input_ids`` (one, or a batch -> the response is a
list), ``image_data`` (per request a list: data URI, raw base64, path or ``file://``),
``sampling_params``, ``return_logprob``, ``logprob_start_len``, ``return_text_in_logprobs``,
``return_prompt_token_ids``, ``return_routed_experts`` with ``routed_experts_start_len`` (MoE models:
``slime_mt/routes.py``), ``priority`` (an integer; served as SGLang serves it with
``--enable-priority-scheduling``: higher first; a request without one after every request with one),
``rid`` (a batch's string rid is a prefix: ``rid_0``, ``rid_1``, ...).
As in SGLang, null means the default for every field; numbers are range- and finiteness-checked as
``SamplingParams.verify`` does. Unknown top-level keys are ignored, but SGLang features this engine
does not serve (streaming, top log-probs, LoRA, ...) are a 400 rather than silently dropped; unknown
``sampling_params`` keys are a 400, as SGLang does.

Response: ``text``, ``output_ids``, ``meta_info`` = {``id``, ``finish_reason`` ({"type": "stop",
"matched": id|str} | {"type": "length", "length": N} | {"type": "abort", "message": ...}),
``prompt_tokens``, ``completion_tokens``, ``cached_tokens``, ``weight_version``,
``output_token_logprobs`` = [[logprob, token_id, text|None], ...] and ``input_token_logprobs``
(from ``logprob_start_len``, the last prompt token by default; the first entry's log-prob is None)
when ``return_logprob``, ``routed_experts`` (base64 int32, rows from ``routed_experts_start_len``,
echoed) when ``return_routed_experts``, ``e2e_latency``}.

Parsing raises ``ProtocolError`` (a client error) and nothing else, whatever the body.

VLM token-in: the engine gets ONE ``<|image_pad|>`` per image and expands it; the trainer keeps the
expanded ids. ``collapse_image_pads`` / ``expand_image_pads`` convert between the two views.
"""

from __future__ import annotations

import json
import math
import reprlib
import uuid
from dataclasses import dataclass, field
from typing import Any

from slime_mt.errors import ProtocolError

MAX_JSON_DEPTH = 32
SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed accepts

SAMPLING_KEYS = {
    "max_new_tokens": int,
    "min_new_tokens": int,
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "stop": (str, list),
    "stop_token_ids": list,
    "ignore_eos": bool,
    "skip_special_tokens": bool,
    "spaces_between_special_tokens": bool,
    "no_stop_trim": bool,
    "sampling_seed": int,
    "n": int,
    "frequency_penalty": float,
    "presence_penalty": float,
    "repetition_penalty": float,
    "json_schema": (str, type(None)),
    "regex": (str, type(None)),
    "ebnf": (str, type(None)),
    "structural_tag": (str, type(None)),
    "stop_regex": (str, list, type(None)),
    "custom_params": (dict, type(None)),
    "stream_interval": int,
    "logit_bias": (dict, type(None)),
}
# Accepted for compatibility but not implemented by the embedded engine: a value other than the
# default (or null) is a 400.
UNSUPPORTED_DEFAULTS = {
    "n": 1,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "stop_regex": None,
    "custom_params": None,
    "logit_bias": None,
}
# Top-level /generate fields of SGLang that change what the answer holds; the embedded engine serves
# only their default (or null) and answers 400 otherwise, rather than silently ignoring them.
UNSUPPORTED_TOP_LEVEL = {
    "stream": False,
    "top_logprobs_num": 0,
    "token_ids_logprob": None,
    "input_embeds": None,
    "video_data": None,
    "audio_data": None,
    "session_params": None,
    "custom_logit_processor": None,
    "return_hidden_states": False,
}

_shown = reprlib.Repr()
_shown.maxlevel, _shown.maxstring, _shown.maxother, _shown.maxlist, _shown.maxdict, _shown.maxlong = 3, 60, 60, 6, 6, 40


def show(value: Any) -> str:
    """A short, bounded repr of a client value for error messages (never recurses deeply)."""
    return _shown.repr(value)


@dataclass
class SamplingParams:
    max_new_tokens: int | None = 128  # None: up to the context length (SGLang's null)
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-6 or self.top_k == 1


@dataclass
class GenerateRequest:
    """One request after validation (a batch request becomes several of these)."""

    rid: str
    input_ids: list[int] | None
    text: str | None
    images: list[Any]
    sampling: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    return_text_in_logprobs: bool = False
    return_prompt_token_ids: bool = False
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0  # SGLang's: rows cover [start, prompt + output - 1)
    # SGLang's (--enable-priority-scheduling): higher first, first come first among equals; None (none
    # given) after every request that has one, as SGLang's scheduler sets it (-sys.maxsize - 1)
    priority: int | None = None
    lora: str | None = None  # SGLang's lora_path: the name of a loaded adapter (None: the base model)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def decode_json_body(raw: bytes) -> dict:
    """Request bytes -> a JSON object; anything else (invalid JSON, numbers Python cannot hold,
    nesting deeper than ``MAX_JSON_DEPTH``) is a ProtocolError. NaN/Infinity literals parse (as
    Python's json does) and are rejected by the field checks."""
    if not raw:
        raise ProtocolError("request body is empty; expected a JSON object")
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ProtocolError(f"request body is nested deeper than {MAX_JSON_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, and int() past 4300 digits
        raise ProtocolError(f"request body is not valid JSON: {e}") from None
    _check_depth(body)
    if not isinstance(body, dict):
        raise ProtocolError(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def _check_depth(value: Any) -> None:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ProtocolError(f"request body is nested deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)


_TRUE, _FALSE = {"true", "t", "yes", "y", "on", "1"}, {"false", "f", "no", "n", "off", "0"}


def parse_bool(value: Any, where: str, default: bool = False) -> bool:
    """A boolean as pydantic reads one in lax mode (SGLang's request models): true/false, 0/1 and
    their strings ("false", "0", "no", "off", ...); null is ``default``."""
    if value is None:
        return default
    if isinstance(value, bool):
        return value
    if _is_int(value) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ProtocolError(f"{where} must be true or false, got {show(value)}")


def parse_sampling_params(raw: Any, where: str = "sampling_params") -> SamplingParams:
    """Validate one ``sampling_params`` object the way SGLang's ``SamplingParams.verify`` does
    (null means the default); raises ProtocolError naming the key and the value."""
    if raw is None:
        return SamplingParams()
    if not isinstance(raw, dict):
        raise ProtocolError(f"{where} must be an object, got {type(raw).__name__}")
    unknown = sorted(k for k in raw if k not in SAMPLING_KEYS)
    if unknown:
        raise ProtocolError(f"{where}: unknown key(s) {show(unknown)}; known keys: {sorted(SAMPLING_KEYS)}")
    kw: dict[str, Any] = {}
    for key, value in raw.items():
        if value is None:
            if key == "max_new_tokens":
                kw[key] = None
            continue
        if key in UNSUPPORTED_DEFAULTS:
            if value != UNSUPPORTED_DEFAULTS[key] or isinstance(value, bool):
                raise ProtocolError(f"{where}.{key}={show(value)} is not supported by the embedded engine")
            continue
        checked = _check_value(key, value, where)
        if key != "stream_interval":
            kw[key] = checked
    sp = SamplingParams(**kw)
    if sp.max_new_tokens is not None and sp.max_new_tokens < 0:
        raise ProtocolError(f"{where}.max_new_tokens must be >= 0, got {sp.max_new_tokens}")
    if sp.min_new_tokens < 0 or (sp.max_new_tokens is not None and sp.min_new_tokens > sp.max_new_tokens):
        raise ProtocolError(f"{where}.min_new_tokens={sp.min_new_tokens} must be in [0, max_new_tokens]")
    if not math.isfinite(sp.temperature) or sp.temperature < 0:
        raise ProtocolError(f"{where}.temperature must be a non-negative finite number, got {sp.temperature}")
    if not 0 < sp.top_p <= 1:
        raise ProtocolError(f"{where}.top_p must be in (0, 1], got {sp.top_p}")
    if sp.top_k == 0 or sp.top_k < -1:
        raise ProtocolError(f"{where}.top_k must be -1 or >= 1, got {sp.top_k}")
    if not 0 <= sp.min_p <= 1:
        raise ProtocolError(f"{where}.min_p must be in [0, 1], got {sp.min_p}")
    if sp.sampling_seed is not None and not SEED_RANGE[0] <= sp.sampling_seed < SEED_RANGE[1]:
        raise ProtocolError(
            f"{where}.sampling_seed must be a 64-bit integer in [-2**63, 2**64), got {show(sp.sampling_seed)}"
        )
    return sp


def _check_value(key: str, value: Any, where: str) -> Any:
    expected = SAMPLING_KEYS[key]
    if key == "stop":
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
            raise ProtocolError(f"{where}.stop must be a non-empty string or a list of them, got {show(value)}")
        return items
    if key == "stop_token_ids":
        if not isinstance(value, list) or not all(_is_int(t) for t in value):
            raise ProtocolError(f"{where}.stop_token_ids must be a list of integers, got {show(value)}")
        return value
    if expected is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ProtocolError(f"{where}.{key} must be a number, got {show(value)}")
        try:
            return float(value)
        except OverflowError:  # an integer too large for a float
            raise ProtocolError(f"{where}.{key} is out of range, got {show(value)}") from None
    if expected is int:
        if not _is_int(value):
            raise ProtocolError(f"{where}.{key} must be an integer, got {show(value)}")
        return value
    if expected is bool:
        return parse_bool(value, f"{where}.{key}")
    return value


def parse_generate(body: Any, vocab_size: int) -> tuple[list[GenerateRequest], bool]:
    """Validate a ``/generate`` body -> (requests, is_batch). Raises ProtocolError and nothing else."""
    if not isinstance(body, dict):
        raise ProtocolError(f"request body must be a JSON object, got {type(body).__name__}")
    for key, default in UNSUPPORTED_TOP_LEVEL.items():
        value = body.get(key)
        if value is None:
            continue
        if isinstance(default, bool):
            supported = parse_bool(value, key) == default
        else:
            supported = _is_int(value) and value == default
        if not supported:
            raise ProtocolError(f"{key}={show(value)} is not supported by the embedded engine")
    has_ids, has_text = body.get("input_ids") is not None, body.get("text") is not None
    if has_ids == has_text:
        raise ProtocolError("exactly one of 'text' or 'input_ids' must be given")
    if has_ids:
        raw = body["input_ids"]
        if not isinstance(raw, list) or not raw:
            raise ProtocolError("input_ids must be a non-empty list of token ids (or a list of such lists)")
        is_batch = isinstance(raw[0], list)
        prompts = raw if is_batch else [raw]
        for i, ids in enumerate(prompts):
            where = f"input_ids[{i}]" if is_batch else "input_ids"
            if not isinstance(ids, list) or not ids:
                raise ProtocolError(f"{where} must be a non-empty list of token ids")
            bad = [t for t in ids if not _is_int(t) or not 0 <= t < vocab_size]
            if bad:
                raise ProtocolError(f"{where} holds {show(bad[0])}, not a token id in [0, {vocab_size})")
        texts: list[str | None] = [None] * len(prompts)
    else:
        raw = body["text"]
        is_batch = isinstance(raw, list)
        texts = raw if is_batch else [raw]
        if not texts or not all(isinstance(t, str) and t for t in texts):
            raise ProtocolError("text must be a non-empty string or a non-empty list of them")
        prompts = [None] * len(texts)
    n = len(prompts)
    images = _images_per_request(body.get("image_data"), n, is_batch)
    sampling = _per_request(body.get("sampling_params"), n, is_batch, "sampling_params")
    rids = _rids(body.get("rid"), n, is_batch)
    return_logprob = _per_request(body.get("return_logprob"), n, is_batch, "return_logprob")
    start = _per_request(body.get("logprob_start_len"), n, is_batch, "logprob_start_len")
    text_in_logprobs = parse_bool(body.get("return_text_in_logprobs"), "return_text_in_logprobs")
    prompt_token_ids = parse_bool(body.get("return_prompt_token_ids"), "return_prompt_token_ids")
    routed = _per_request(body.get("return_routed_experts"), n, is_batch, "return_routed_experts")
    routed_start = _per_request(body.get("routed_experts_start_len"), n, is_batch, "routed_experts_start_len")
    priorities = _per_request(body.get("priority"), n, is_batch, "priority")
    loras = _per_request(body.get("lora_path"), n, is_batch, "lora_path")
    requests = []
    for i in range(n):
        suffix = f"[{i}]" if is_batch else ""
        start_len, route_start, priority = _positions(start[i], routed_start[i], priorities[i], loras[i], suffix)
        requests.append(
            GenerateRequest(
                rid=rids[i],
                input_ids=prompts[i],
                text=texts[i],
                images=images[i],
                sampling=parse_sampling_params(sampling[i], "sampling_params" + suffix),
                return_logprob=parse_bool(return_logprob[i], "return_logprob" + suffix),
                logprob_start_len=start_len,
                return_text_in_logprobs=text_in_logprobs,
                return_prompt_token_ids=prompt_token_ids,
                return_routed_experts=parse_bool(routed[i], "return_routed_experts" + suffix),
                routed_experts_start_len=route_start,
                priority=priority,
                lora=loras[i],
            )
        )
    return requests, is_batch


def _positions(start: Any, routed_start: Any, priority: Any, lora: Any, suffix: str) -> tuple[int, int, int | None]:
    """One request's ``logprob_start_len`` (-1 when absent), ``routed_experts_start_len`` (0) and
    ``priority`` checked, and its ``lora_path`` (an adapter's name or none)."""
    start_len = -1 if start is None else start
    if not _is_int(start_len) or start_len < -1:
        raise ProtocolError(f"logprob_start_len{suffix} must be an integer >= -1, got {show(start)}")
    route_start = 0 if routed_start is None else routed_start
    if not _is_int(route_start) or route_start < 0:
        raise ProtocolError(f"routed_experts_start_len{suffix} must be an integer >= 0, got {show(routed_start)}")
    if priority is not None and not _is_int(priority):
        raise ProtocolError(f"priority{suffix} must be an integer, got {show(priority)}")
    if lora is not None and not (isinstance(lora, str) and lora):
        raise ProtocolError(f"lora_path{suffix} must be the name of a loaded adapter, got {show(lora)}")
    return start_len, route_start, priority


def _per_request(value: Any, n: int, is_batch: bool, name: str) -> list[Any]:
    """Spread a field over a batch: a list of n values (one per prompt), or one value for all."""
    if not is_batch:
        return [value]
    if isinstance(value, list):
        if len(value) != n:
            raise ProtocolError(f"{name} has {len(value)} entries for a batch of {n} prompts")
        return value
    return [value] * n


def _rids(value: Any, n: int, is_batch: bool) -> list[str]:
    """SGLang's rule: a batch's string rid is a prefix (``rid_0``, ``rid_1``, ...); rids are unique."""
    if value is None:
        return [uuid.uuid4().hex for _ in range(n)]
    if isinstance(value, str):
        return [f"{value}_{i}" for i in range(n)] if is_batch else [value]
    if is_batch and isinstance(value, list) and all(isinstance(r, str) for r in value):
        if len(value) != n:
            raise ProtocolError(f"rid has {len(value)} entries for a batch of {n} prompts")
        duplicates = sorted({r for r in value if value.count(r) > 1})
        if duplicates:
            raise ProtocolError(f"Duplicate request IDs detected within the request: {show(duplicates)}")
        return value
    raise ProtocolError(f"rid must be a string{' or a list of strings' if is_batch else ''}, got {show(value)}")


def _images_per_request(value: Any, n: int, is_batch: bool) -> list[list[str]]:
    """``image_data`` as SGLang accepts it -> a list of images per request. Single request: one item
    or a list; batch: one item for all, a list of one item per request, or a list of lists."""
    if value is None or value == []:
        return [[] for _ in range(n)]
    if not isinstance(value, list):
        per_request = [[value]] * n
    elif not is_batch:
        per_request = [value]
    elif len(value) != n:
        raise ProtocolError(f"image_data has {len(value)} entries for a batch of {n} prompts")
    elif any(isinstance(v, list) for v in value):
        per_request = [v if isinstance(v, list) else ([] if v is None else [v]) for v in value]
    else:
        per_request = [[] if v is None else [v] for v in value]
    for i, images in enumerate(per_request):
        for k, image in enumerate(images):
            if not isinstance(image, str) or not image:
                raise ProtocolError(
                    f"image_data[{i}][{k}] must be a data URI, base64 string or file path, got {show(image)}"
                )
    return [list(images) for images in per_request]


def finish_stop(matched: int | str) -> dict:
    return {"type": "stop", "matched": matched}


def finish_length(length: int) -> dict:
    return {"type": "length", "length": length}


def finish_abort(message: str) -> dict:
    return {"type": "abort", "message": message}


def collapse_image_pads(ids: list[int], image_token_id: int) -> tuple[list[int], list[int]]:
    """Expanded ids (training view) -> (ids with one pad per image (engine view), pads per image)."""
    out: list[int] = []
    counts: list[int] = []
    previous_pad = False
    for t in ids:
        if t == image_token_id:
            if previous_pad:
                counts[-1] += 1
                continue
            counts.append(1)
            previous_pad = True
        else:
            previous_pad = False
        out.append(t)
    return out, counts


def expand_image_pads(ids: list[int], image_token_id: int, counts: list[int]) -> list[int]:
    """Engine view (one pad per image) -> training view (``counts[i]`` pads for image i)."""
    pads = sum(1 for t in ids if t == image_token_id)
    if pads != len(counts):
        raise ProtocolError(f"{pads} image pad tokens in input_ids but {len(counts)} images")
    out: list[int] = []
    k = 0
    for t in ids:
        if t == image_token_id:
            out.extend([image_token_id] * counts[k])
            k += 1
        else:
            out.append(t)
    return out
