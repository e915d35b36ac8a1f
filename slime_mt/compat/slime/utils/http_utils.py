"""slime.utils.http_utils: ``post(url, payload)`` and ``get(url)``. A ``/generate`` to the run's
engine (``http://{args.sglang_router_ip}:{args.sglang_router_port}/generate``) goes through the run's
client (``SlimeCompat.engine_generate``); any other URL is a plain HTTP call, retried on connection
errors and 5xx."""

from __future__ import annotations

import asyncio

import httpx

from slime_mt.compat.run_state import current


async def post(url: str, payload: dict, max_retries: int = 60, headers: dict | None = None):
    compat = current()
    if compat is not None and compat.is_engine(url):
        return await compat.engine_generate(payload)
    async with httpx.AsyncClient(timeout=None) as client:
        for attempt in range(max(max_retries, 1)):
            try:
                answer = await client.post(url, json=payload, headers=headers)
                if answer.status_code < 500 or attempt + 1 == max_retries:
                    answer.raise_for_status()
                    return answer.json()
            except httpx.TransportError:
                if attempt + 1 >= max_retries:
                    raise
            await asyncio.sleep(min(0.1 * 2**attempt, 5.0))
    raise RuntimeError(f"POST {url}: no answer after {max_retries} attempts")


async def get(url: str):
    async with httpx.AsyncClient(timeout=None) as client:
        answer = await client.get(url)
        answer.raise_for_status()
        return answer.json()


def get_rollout_num_engines(args) -> int:
    compat = current()
    return len(compat.ctx.client.worker_urls) if compat is not None else 1
