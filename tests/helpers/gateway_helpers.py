"""What the gateway tests share: the scripted model's answer, and a rollout context with its gateway
running on the context's loop (the test thread plays the harness)."""

import contextlib
import importlib.util
import sys
from pathlib import Path


def _lazy(name: str):
    """The module ``name``, imported at its first attribute access (``importlib.util.LazyLoader``): the
    collection of the gateway tests does not import the openai client (1.2 s of the 10 s that
    ``pytest --collect-only`` may take); the tests that call it do."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


openai = _lazy("openai")

# What the scripted model answers every call: " ans" + "wer" (not the canonical " answer"), then a
# tool call, then <|im_end|>.
SCRIPT_TEXT = ' answer<tool_call>{"name":"add","arguments":{"a":2,"b":3}}</tool_call>'
ANS, WER, ANSWER = 8099, 6566, 4226  # " ans", "wer" and the canonical " answer" in the Qwen tokenizer
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
        },
    }
]


class Harness:
    """A rollout context against one engine, its gateway started; sessions opened per test."""

    def __init__(self, model_path: Path, url: str, flags: list[str], worker_urls: list[str] | None = None):
        from slime_mt.config_parsing import parse_config
        from slime_mt.gateway.server import open_gateway
        from slime_mt.rollout.context import RolloutContext

        self.cfg = parse_config(["--hf-checkpoint", str(model_path), *flags])
        self.ctx = RolloutContext.create(self.cfg, str(model_path), url, worker_urls)
        self.gateway = self.ctx.run_sync(open_gateway(self.ctx))

    def open(self, index: int = 0, rollout_id: int = 0, rank: int | None = None):
        """A session, opened as a trajectory's task opens it (``rank``: the one ``set_rank`` gave the task)."""
        from slime_mt.engine.clients.priority import group_version
        from slime_mt.types import Sample

        sample = Sample(index=index, group_index=0, prompt="", metadata={"rollout_id": rollout_id})

        async def opened():
            group_version.set(rank)
            return self.gateway.open(sample, self.ctx.sampling_params())

        session = self.ctx.run_sync(opened())
        return session, self.gateway.base_url(session)

    def close(self, session) -> None:
        self.ctx.run_sync(self.gateway.close(session))

    def stop(self) -> None:
        self.ctx.close()


@contextlib.contextmanager
def engine_harness(model_path: Path, flags: list[str], max_batch_size: int = 16):
    """An embedded engine on ``model_path`` and a harness in front of it, for one module."""
    from slime_mt.engine.embedded.server import LocalEngine

    engine = LocalEngine(model_path, max_batch_size=max_batch_size).start()
    harness = Harness(model_path, engine.url, flags)
    try:
        yield harness
    finally:
        harness.stop()
        engine.stop()
