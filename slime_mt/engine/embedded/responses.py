"""The answer to a finished request, in SGLang's shape: text, output ids, and ``meta_info`` (finish reason,
token counts, the weight version, log-probs of outputs and inputs, prompt ids, routed experts)."""

from __future__ import annotations

import time

import torch

from slime_mt.engine.embedded.runner import ModelRunner, Sequence
from slime_mt.engine.protocol import GenerateRequest
from slime_mt.routes import RouteLayout


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
