"""The client of each ``--engine``: SGLang's API (``client.py``: the embedded engine, SGLang) or vLLM's
(``vllm.py``), one interface for the rollout."""

from __future__ import annotations

from typing import Any

from slime_mt.engine.client import EngineClient


def client_for(engine: str, url: str, worker_urls: list[str] | None = None, **kw: Any) -> EngineClient:
    """The client of ``--engine`` ``engine``: vLLM's or SGLang's API (local, sglang)."""
    if engine == "vllm":
        from slime_mt.engine.vllm import VLLMClient  # vLLM's protocol, read only where it serves

        return VLLMClient(url, worker_urls, **kw)
    return EngineClient(url, worker_urls, **kw)
