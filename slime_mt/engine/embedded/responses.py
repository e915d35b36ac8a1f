"""The engine's answers, in SGLang's shape: a finished request's text, output ids, and ``meta_info``
(finish reason, token counts, the weight version, log-probs of outputs and inputs, prompt ids, routed
experts); errors, refused weight calls, and the strict JSON they are sent as."""

from __future__ import annotations

import json
import math
import time

import torch
from starlette.responses import JSONResponse

from slime_mt.engine.embedded.runner import ModelRunner, Sequence
from slime_mt.engine.protocol import GenerateRequest, finish_length, finish_stop, show
from slime_mt.errors import ProtocolError
from slime_mt.routes import RouteLayout


def finish_reason(seq: Sequence, runner: ModelRunner) -> dict | None:
    """Why ``seq`` is finished after its last token, None if it is not, in SGLang's order
    (``Req.check_finished``): length first, then stop token ids and EOS (both ignored with
    ``ignore_eos``), then stop strings."""
    sp = seq.sampling
    token = seq.output_ids[-1]
    n = len(seq.output_ids)
    if n >= sp.max_new_tokens or len(seq.prompt_ids) + n >= runner.context_length:
        return finish_length(n)
    if not sp.ignore_eos and (token in sp.stop_token_ids or token in runner.eos_ids):
        return finish_stop(token)
    if sp.stop:
        text = runner.tokenizer.decode(seq.output_ids, skip_special_tokens=sp.skip_special_tokens)
        for stop in sp.stop:
            if stop in text:
                return finish_stop(stop)
    return None


def response(
    req: GenerateRequest, seq: Sequence | None, reason: dict, runner: ModelRunner, weight_version: str, created: float
) -> dict:
    """``req``'s answer, ``seq`` its sequence (None: it never started), finished for ``reason``."""
    output_ids = list(seq.output_ids) if seq else []
    sp = req.sampling
    text_ids = output_ids
    if reason["type"] == "stop" and isinstance(reason["matched"], int) and not sp.no_stop_trim:
        text_ids = output_ids[:-1]
    text = runner.tokenizer.decode(text_ids, skip_special_tokens=sp.skip_special_tokens) if text_ids else ""
    if reason["type"] == "stop" and isinstance(reason["matched"], str) and not sp.no_stop_trim:
        text = text[: text.index(reason["matched"])] if reason["matched"] in text else text
    meta = {
        "id": req.rid,
        "finish_reason": reason,
        "prompt_tokens": len(seq.prompt_ids) if seq else 0,
        "completion_tokens": len(output_ids),
        "cached_tokens": seq.cached_tokens if seq else 0,
        "weight_version": weight_version,
        "e2e_latency": time.perf_counter() - created,
    }
    if req.return_logprob:
        show = req.return_text_in_logprobs
        decode = runner.tokenizer.decode
        meta["output_token_logprobs"] = [
            [lp, t, decode([t]) if show else None] for lp, t in zip(seq.output_logprobs if seq else [], output_ids)
        ]
        if seq is not None and seq.input_logprobs is not None:
            meta["input_token_logprobs"] = [
                [lp, t, decode([t]) if show else None]
                for lp, t in zip(seq.input_logprobs, seq.prompt_ids[seq.input_logprob_start :])
            ]
    if req.return_prompt_token_ids and seq is not None:
        meta["prompt_token_ids"] = list(seq.prompt_ids)
    if req.return_routed_experts:
        meta["routed_experts"] = wire_routes(runner.route_layout, seq, req.routed_experts_start_len)
        meta["routed_experts_start_len"] = req.routed_experts_start_len
    return {"text": text, "output_ids": output_ids, "meta_info": meta}


def wire_routes(layout: RouteLayout | None, seq: Sequence | None, start: int) -> str:
    """SGLang's ``routed_experts``: the routes of tokens ``[start, prompt + output - 1)`` over every
    decoder layer (-1 in dense ones), int32, base64."""
    if layout is None:
        return ""
    rows = seq.routed(layout)[start:] if seq is not None else layout.empty()
    wire = torch.full((len(rows), layout.num_layers, layout.top_k), -1, dtype=torch.int32)
    wire[:, list(layout.moe_layers)] = rows.to(torch.int32)
    return layout.encode(wire)


class JSON(JSONResponse):
    """Strict JSON out; a non-finite float (a model producing NaN) becomes null, as SGLang's orjson does."""

    def render(self, content) -> bytes:
        try:
            return json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
        except ValueError:
            return json.dumps(_finite(content), ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def error(status: int, message: str) -> JSONResponse:
    return JSON({"error": {"message": message, "code": status}, "object": "error"}, status_code=status)


MEMORY_TAGS = ("weights", "kv_cache")


def memory_tags(body: dict, what: str) -> set[str]:
    """SGLang's ``tags`` of a memory call -> the set (None: every tag); ``cuda_graph`` is accepted and
    has nothing to free here."""
    tags = body.get("tags")
    if tags is None:
        return set(MEMORY_TAGS)
    known = (*MEMORY_TAGS, "cuda_graph")
    if not isinstance(tags, list) or not all(isinstance(t, str) and t in known for t in tags):
        raise ProtocolError(f"{what}: tags must be a list of {', '.join(known)}, got {show(tags)}")
    return set(tags) - {"cuda_graph"}


def refused(message: str) -> JSONResponse:
    """SGLang's answer to a weight call it cannot do: success false and why, HTTP 400."""
    return JSON({"success": False, "message": message}, status_code=400)
