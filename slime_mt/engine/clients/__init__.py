"""The engines' clients, one interface for the rollout: SGLang's API (``sglang``, which the embedded
engine speaks too), vLLM's (``vllm``), and the update gate every request leaves through while weights
change in the middle of generation (``update_gate``); ``client_for`` picks by ``--engine``."""

from __future__ import annotations

from typing import Any

from slime_mt.engine.clients.sglang import EngineClient


def client_for(engine: str, url: str, worker_urls: list[str] | None = None, **kw: Any) -> EngineClient:
    """The client of ``--engine`` ``engine``: vLLM's or SGLang's API (local, sglang)."""
    if engine == "vllm":
        from slime_mt.engine.clients.vllm import VLLMClient  # vLLM's protocol, read only where it serves

        return VLLMClient(url, worker_urls, **kw)
    return EngineClient(url, worker_urls, **kw)
