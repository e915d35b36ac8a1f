"""Fixtures of the gateway tests: the scripted model on an embedded engine, and a rollout context
with its gateway running on the context's loop (the test thread plays the harness)."""

import hashlib

import pytest
from gateway_helpers import ANS, SCRIPT_TEXT, WER, Harness, engine_harness
from rollout_helpers import chain_model
from scripted import segment


@pytest.fixture(scope="session")
def scripted_path(qwen_tokenizer, tiny_paths):
    """The tiny Qwen2 made a chain model: after the generation prompt it writes SCRIPT_TEXT, then eot."""
    from slime_mt.assets.cache import cached_dir

    start = qwen_tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"][-1]
    eot = qwen_tokenizer.convert_tokens_to_ids("<|im_end|>")
    chain = [start, *segment(qwen_tokenizer, SCRIPT_TEXT, {start, eot}, {" answer": [ANS, WER]}), eot]
    tag = hashlib.sha256(repr(chain).encode()).hexdigest()[:12]
    tiny = tiny_paths["qwen2"]
    transitions = {a: [b] for a, b in zip(chain, chain[1:])}
    return cached_dir(f"scripted-qwen2-{tag}", lambda out: chain_model(tiny, out, tiny, transitions))


@pytest.fixture(scope="session")
def scripted_engine(scripted_path):
    from slime_mt.engine.embedded.server import LocalEngine

    engine = LocalEngine(scripted_path, max_batch_size=16).start()
    yield engine
    engine.stop()


@pytest.fixture(scope="session")
def harness(scripted_path, scripted_engine):
    h = Harness(scripted_path, scripted_engine.url, ["--rollout-max-response-len", "64"])
    yield h
    h.stop()


@pytest.fixture(scope="module")
def tiny_harness(tiny_paths):
    """The random tiny Qwen2 (sampling with seeds) behind a gateway."""
    with engine_harness(tiny_paths["qwen2"], ["--rollout-max-response-len", "64"]) as harness:
        yield harness
