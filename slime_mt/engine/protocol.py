"""SGLang's native ``/generate`` protocol (0.5.x), parsed and validated; the two views of image pads.

Request (``GenerateReqInput``): ``text`` or ``input_ids`` (one, or a batch -> the response is a
list), ``image_data`` (per request a list: data URI, raw base64, path or ``file://``),
``sampling_params``, ``return_logprob``, ``logprob_start_len``, ``return_text_in_logprobs``,
``return_prompt_token_ids``, ``rid``. Unknown top-level keys are ignored; unknown
``sampling_params`` keys are an error (HTTP 400), as SGLang does.

Response: ``text``, ``output_ids``, ``meta_info`` = {``id``, ``finish_reason`` ({"type": "stop",
"matched": id|str} | {"type": "length", "length": N} | {"type": "abort", "message": ...}),
``prompt_tokens``, ``completion_tokens``, ``cached_tokens``, ``weight_version``,
``output_token_logprobs`` = [[logprob, token_id, text|None], ...], ``e2e_latency``}.

VLM token-in: the engine gets ONE ``<|image_pad|>`` per image and expands it; the trainer keeps the
expanded ids. ``collapse_image_pads`` / ``expand_image_pads`` convert between the two views.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any


class ProtocolError(ValueError):
    """A malformed request; the server answers HTTP 400 with this message."""


SAMPLING_KEYS = {
    "max_new_tokens": int, "min_new_tokens": int, "temperature": float, "top_p": float, "top_k": int,
    "min_p": float, "stop": (str, list), "stop_token_ids": list, "ignore_eos": bool,
    "skip_special_tokens": bool, "spaces_between_special_tokens": bool, "no_stop_trim": bool,
    "sampling_seed": int, "n": int, "frequency_penalty": float, "presence_penalty": float,
    "repetition_penalty": float, "json_schema": (str, type(None)), "regex": (str, type(None)),
    "ebnf": (str, type(None)), "custom_params": (dict, type(None)), "stream_interval": int,
    "logit_bias": (dict, type(None)),
}
# Accepted for compatibility but not implemented by the embedded engine: a non-default value is a 400.
UNSUPPORTED_DEFAULTS = {"n": 1, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
                        "json_schema": None, "regex": None, "ebnf": None, "custom_params": None,
                        "logit_bias": None}


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
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


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_sampling_params(raw: Any, where: str = "sampling_params") -> SamplingParams:
    if raw is None:
        return SamplingParams()
    if not isinstance(raw, dict):
        raise ProtocolError(f"{where} must be an object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(SAMPLING_KEYS))
    if unknown:
        raise ProtocolError(f"{where}: unknown key(s) {unknown}; known keys: {sorted(SAMPLING_KEYS)}")
    for key, default in UNSUPPORTED_DEFAULTS.items():
        if key in raw and raw[key] != default:
            raise ProtocolError(f"{where}.{key}={raw[key]!r} is not supported by the embedded engine")
    kw: dict[str, Any] = {}
    for key, value in raw.items():
        if key in UNSUPPORTED_DEFAULTS or key == "stream_interval":
            continue
        kw[key] = _check_value(key, value, where)
    sp = SamplingParams(**kw)
    if sp.max_new_tokens < 0:
        raise ProtocolError(f"{where}.max_new_tokens must be >= 0, got {sp.max_new_tokens}")
    if sp.min_new_tokens < 0 or sp.min_new_tokens > sp.max_new_tokens:
        raise ProtocolError(f"{where}.min_new_tokens={sp.min_new_tokens} must be in 0..max_new_tokens")
    if sp.temperature < 0:
        raise ProtocolError(f"{where}.temperature must be >= 0, got {sp.temperature}")
    if not 0 < sp.top_p <= 1:
        raise ProtocolError(f"{where}.top_p must be in (0, 1], got {sp.top_p}")
    if sp.top_k == 0 or sp.top_k < -1:
        raise ProtocolError(f"{where}.top_k must be -1 or >= 1, got {sp.top_k}")
    if not 0 <= sp.min_p <= 1:
        raise ProtocolError(f"{where}.min_p must be in [0, 1], got {sp.min_p}")
    return sp


def _check_value(key: str, value: Any, where: str) -> Any:
    expected = SAMPLING_KEYS[key]
    if key in ("stop",):
        if value is None:
            return []
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
            raise ProtocolError(f"{where}.stop must be a non-empty string or a list of them, got {value!r}")
        return items
    if key == "stop_token_ids":
        if value is None:
            return []
        if not isinstance(value, list) or not all(_is_int(t) for t in value):
            raise ProtocolError(f"{where}.stop_token_ids must be a list of integers, got {value!r}")
        return value
    if key == "sampling_seed":
        if value is not None and not _is_int(value):
            raise ProtocolError(f"{where}.sampling_seed must be an integer, got {value!r}")
        return value
    if expected is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ProtocolError(f"{where}.{key} must be a number, got {value!r}")
        return float(value)
    if expected is int:
        if not _is_int(value):
            raise ProtocolError(f"{where}.{key} must be an integer, got {value!r}")
        return value
    if expected is bool:
        if not isinstance(value, bool):
            raise ProtocolError(f"{where}.{key} must be true or false, got {value!r}")
        return value
    return value


def parse_generate(body: Any, vocab_size: int) -> tuple[list[GenerateRequest], bool]:
    """Validate a ``/generate`` body -> (requests, is_batch). Raises ProtocolError."""
    if not isinstance(body, dict):
        raise ProtocolError(f"request body must be a JSON object, got {type(body).__name__}")
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
                bad = bad[0]
                raise ProtocolError(f"{where} holds {bad!r}, not a token id in [0, {vocab_size})")
        texts: list[str | None] = [None] * len(prompts)
    else:
        raw = body["text"]
        is_batch = isinstance(raw, list)
        texts = raw if is_batch else [raw]
        if not texts or not all(isinstance(t, str) and t for t in texts):
            raise ProtocolError("text must be a non-empty string or a non-empty list of them")
        prompts = [None] * len(texts)
    n = len(prompts)
    images = _per_request(body.get("image_data"), n, is_batch, "image_data", nested=True)
    sampling = _per_request(body.get("sampling_params"), n, is_batch, "sampling_params")
    rids = _per_request(body.get("rid"), n, is_batch, "rid")
    return_logprob = _per_request(body.get("return_logprob", False), n, is_batch, "return_logprob")
    start = _per_request(body.get("logprob_start_len", -1), n, is_batch, "logprob_start_len")
    requests = []
    for i in range(n):
        imgs = images[i] or []
        if not isinstance(imgs, list):
            imgs = [imgs]
        for k, img in enumerate(imgs):
            if not isinstance(img, str) or not img:
                raise ProtocolError(f"image_data[{i}][{k}] must be a data URI, base64 string or file path")
        rid = rids[i] if rids[i] is not None else uuid.uuid4().hex
        if not isinstance(rid, str):
            raise ProtocolError(f"rid must be a string, got {rid!r}")
        if not isinstance(return_logprob[i], bool):
            raise ProtocolError(f"return_logprob must be true or false, got {return_logprob[i]!r}")
        if not _is_int(start[i]):
            raise ProtocolError(f"logprob_start_len must be an integer, got {start[i]!r}")
        requests.append(GenerateRequest(
            rid=rid, input_ids=prompts[i], text=texts[i], images=imgs,
            sampling=parse_sampling_params(sampling[i], "sampling_params" + (f"[{i}]" if is_batch else "")),
            return_logprob=return_logprob[i], logprob_start_len=start[i],
            return_text_in_logprobs=bool(body.get("return_text_in_logprobs", False)),
            return_prompt_token_ids=bool(body.get("return_prompt_token_ids", False)),
        ))
    return requests, is_batch


def _per_request(value: Any, n: int, is_batch: bool, name: str, nested: bool = False) -> list[Any]:
    """Spread a field over a batch: a list of n values (one per prompt), or one value for all.
    ``nested`` fields (image_data) are lists already, so in a batch they must be a list of n lists."""
    if not is_batch:
        return [value]
    if value is None:
        return [None] * n
    if isinstance(value, list) and (not nested or all(isinstance(v, (list, type(None))) for v in value)):
        if len(value) != n:
            raise ProtocolError(f"{name} has {len(value)} entries for a batch of {n} prompts")
        return value
    if nested:
        raise ProtocolError(f"{name} of a batch must be a list of {n} lists of images")
    return [value] * n


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
