"""Fixtures of the gateway tests: the scripted model on an embedded engine, and a rollout context
with its gateway running on the context's loop (the test thread plays the harness)."""

import contextlib
import hashlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from scripted import build, segment  # noqa: E402

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


@pytest.fixture(scope="session")
def scripted_path(qwen_tokenizer):
    from slime_mt.assets.cache import cached_dir

    start = qwen_tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"][-1]
    eot = qwen_tokenizer.convert_tokens_to_ids("<|im_end|>")
    script = [*segment(qwen_tokenizer, SCRIPT_TEXT, {start, eot}, {" answer": [ANS, WER]}), eot]
    tag = hashlib.sha256(repr(script).encode()).hexdigest()[:12]
    return cached_dir(f"scripted-qwen2-{tag}", lambda out: build(out, qwen_tokenizer, script))


class Harness:
    """A rollout context against one engine, its gateway started; sessions opened per test."""

    def __init__(self, model_path: Path, url: str, flags: list[str], worker_urls: list[str] | None = None):
        from slime_mt.config_parsing import parse_config
        from slime_mt.rollout.context import RolloutContext

        self.cfg = parse_config(["--hf-checkpoint", str(model_path), *flags])
        self.ctx = RolloutContext.create(self.cfg, str(model_path), url, worker_urls)
        self.gateway = self.ctx.run_sync(self.ctx.open_gateway())

    def open(self, index: int = 0, rollout_id: int = 0):
        from slime_mt.types import Sample

        sample = Sample(index=index, group_index=0, prompt="", metadata={"rollout_id": rollout_id})

        async def opened():
            return self.gateway.open(sample, self.ctx.sampling_params())

        session = self.ctx.run_sync(opened())
        return session, self.gateway.base_url(session)

    def close(self, session) -> None:
        self.ctx.run_sync(self.gateway.close(session))

    def stop(self) -> None:
        self.ctx.close()


@pytest.fixture(scope="session")
def scripted_engine(scripted_path):
    from slime_mt.engine.server import LocalEngine

    engine = LocalEngine(scripted_path, max_batch_size=16).start()
    yield engine
    engine.stop()


@pytest.fixture(scope="session")
def harness(scripted_path, scripted_engine):
    h = Harness(scripted_path, scripted_engine.url, ["--rollout-max-response-len", "64"])
    yield h
    h.stop()


@contextlib.contextmanager
def engine_harness(model_path: Path, flags: list[str], max_batch_size: int = 16):
    """An embedded engine on ``model_path`` and a harness in front of it, for one module."""
    from slime_mt.engine.server import LocalEngine

    engine = LocalEngine(model_path, max_batch_size=max_batch_size).start()
    harness = Harness(model_path, engine.url, flags)
    try:
        yield harness
    finally:
        harness.stop()
        engine.stop()


@pytest.fixture(scope="module")
def tiny_harness(tiny_paths):
    """The random tiny Qwen2 (sampling with seeds) behind a gateway."""
    with engine_harness(tiny_paths["qwen2"], ["--rollout-max-response-len", "64"]) as harness:
        yield harness
