"""Weights to an embedded engine in another process, nothing written to disk: over the distributed path
(rank 0, this process, broadcasts through SGLang's weight-group endpoints, in buckets) and by handle
(``/update_weights_from_tensor``, shared memory on one node)."""

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from engine_helpers import LoopSide

from slime_mt.backends.megatron.convert import load_hf_state
from slime_mt.engine.launch import free_port
from slime_mt.engine.server import LocalEngine, wait_healthy
from slime_mt.engine.weight_sync import DistributedWeights, TensorWeights

REPO = Path(__file__).resolve().parents[2]
PROMPT = [3, 17, 29, 101, 7, 64]


@pytest.fixture(scope="module")
def remote_engine(tiny_paths):
    """An embedded engine in its own process (as on another node: nothing shared but the network)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "slime_mt.cli", "serve", "--model-path", str(tiny_paths["qwen2"]), "--port", str(port)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, timeout=120)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def version(step: int, base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A trainer's export after ``step`` steps: every tensor moved by a seeded amount."""
    g = torch.Generator().manual_seed(step)
    return {k: v + 0.02 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in base.items()}


def greedy(url: str) -> tuple[list[int], list[float], str]:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}, "return_logprob": True}
    meta = httpx.post(url + "/generate", json=body, timeout=60).json()["meta_info"]
    return (
        [t[1] for t in meta["output_token_logprobs"]],
        [t[0] for t in meta["output_token_logprobs"]],
        meta["weight_version"],
    )


@pytest.mark.parametrize("transport", [DistributedWeights, TensorWeights])
def test_three_versions_in_buckets_serve_exactly_the_sent_weights(remote_engine, tiny_paths, transport):
    base = load_hf_state(tiny_paths["qwen2"])
    side = LoopSide(remote_engine)
    weights = transport(side, [1], buffer_bytes=64 * 1024)  # several buckets per version
    try:
        with LocalEngine(tiny_paths["qwen2"]) as reference:
            for step in (1, 2, 3):
                named = version(step, base)
                weights.push(iter(named.items()), step, _no_gate)
                reference.update_weights_from_tensors(named, weight_version=str(step))
                tokens, logprobs, served = greedy(remote_engine)
                expected_tokens, expected_logprobs, _ = greedy(reference.url)
                assert served == str(step)
                assert tokens == expected_tokens
                assert logprobs == pytest.approx(expected_logprobs, abs=1e-5)
        # a bucket the engine cannot load is refused whole: the error names the tensor, and the
        # engine keeps serving the last version
        bad = {"model.not_a_weight": torch.zeros(3)}
        with pytest.raises(RuntimeError, match="not_a_weight"):
            weights.push(iter(bad.items()), 4, _no_gate)
        assert greedy(remote_engine)[0] == tokens and greedy(remote_engine)[2] == "3"
    finally:
        weights.close()
        side.close()


def test_a_refused_bucket_raises_instead_of_waiting_on_the_broadcast(remote_engine, tiny_paths):
    """An engine that never receives (here: one that left the group, as a restarted engine has) answers
    400 at once; rank 0 raises with the engine's message instead of waiting for the group's timeout,
    and the engine joins a new group and serves the next version."""
    base = load_hf_state(tiny_paths["qwen2"])
    side = LoopSide(remote_engine)
    try:
        weights = DistributedWeights(side, [1], buffer_bytes=1 << 20)
        left = httpx.post(remote_engine + "/destroy_weights_update_group", json={"group_name": weights.name})
        assert left.json()["success"] is True
        with pytest.raises(RuntimeError, match="not joined"):
            weights.push(iter(version(5, base).items()), 5, _no_gate)
        assert weights.broken
        weights.close()
        again = DistributedWeights(side, [1], buffer_bytes=1 << 20)
        again.push(iter(version(6, base).items()), 6, _no_gate)
        assert greedy(remote_engine)[2] == "6"
        again.close()
    finally:
        side.close()


class _no_gate:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_a_tensor_payload_can_only_rebuild_tensors(remote_engine):
    """The handle format is a pickle: one that names any other callable, or is not a pickle of named
    tensors, is refused with 400 before anything runs, and the engine keeps its weights."""
    import base64
    import pickle

    class Shell:
        def __reduce__(self):
            import os

            return (os.system, ("touch /tmp/slime_mt_should_not_exist",))

    before = greedy(remote_engine)
    for entry, expected in [
        (base64.b64encode(pickle.dumps([("model.norm.weight", Shell())])).decode(), "posix.system"),
        (base64.b64encode(pickle.dumps({"model.norm.weight": 1})).decode(), "list of (name, tensor) pairs"),
        ("not base64!", "not base64"),
    ]:
        answer = httpx.post(
            remote_engine + "/update_weights_from_tensor",
            json={"serialized_named_tensors": [entry], "weight_version": "99"},
            timeout=30,
        )
        assert answer.status_code == 400 and answer.json()["success"] is False
        assert expected in answer.json()["message"]
    assert not Path("/tmp/slime_mt_should_not_exist").exists()
    assert greedy(remote_engine) == before
