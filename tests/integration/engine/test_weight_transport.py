"""Weights to an embedded engine in another process, nothing written to disk: over the distributed path
(rank 0, this process, broadcasts through SGLang's weight-group endpoints, in buckets) and by handle
(``/update_weights_from_tensor``, shared memory on one node); and the colocated sequence around them
(SGLang's release and resume of memory occupation)."""

import re
from pathlib import Path

import httpx
import pytest
import torch
from engine_helpers import LoopSide, engine_process

from slime_mt.engine.embedded.server import LocalEngine
from slime_mt.engine.weights.sync import DistributedWeights, FolderWeights, TensorWeights
from slime_mt.safetensors_files import load_hf_state

PROMPT = [3, 17, 29, 101, 7, 64]


@pytest.fixture(scope="module")
def remote_engine(tiny_paths):
    """An embedded engine in its own process (as on another node: nothing shared but the network)."""
    # KV state kept between requests, which a release must free
    with engine_process(tiny_paths["qwen2"], "--cache-tokens", "4096") as url:
        yield url


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


def memory(url: str) -> dict:
    return httpx.get(url + "/server_info", timeout=30).json()["memory_occupation"]


def generate_status(url: str) -> tuple[int, str]:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}
    answer = httpx.post(url + "/generate", json=body, timeout=60)
    return answer.status_code, answer.text


@pytest.mark.parametrize("transport", [DistributedWeights, TensorWeights])
def test_a_colocated_engine_holds_nothing_while_the_trainer_trains_and_wakes_with_the_new_weights(
    remote_engine, tiny_paths, transport
):
    """SGLang's colocated sequence: release everything (no weights, no KV cache left on the device,
    nothing served), resume the weights, update them, resume the KV cache: the engine serves exactly
    the new weights."""
    base = load_hf_state(tiny_paths["qwen2"])
    side = LoopSide(remote_engine)
    weights = transport(side, [1], buffer_bytes=64 * 1024)
    try:
        greedy(remote_engine)
        held = memory(remote_engine)
        assert held["weights_bytes"] > 0 and held["kv_cache_bytes"] > 0 and held["released"] == []
        side.run_sync(side.client.release_memory_occupation())
        assert memory(remote_engine) == {"weights_bytes": 0, "kv_cache_bytes": 0, "released": ["kv_cache", "weights"]}
        status, text = generate_status(remote_engine)
        assert status == 503 and "memory is released (kv_cache, weights)" in text
        with pytest.raises(RuntimeError, match="weights are released"):  # an update before the resume
            weights.push(iter(version(9, base).items()), 9, _no_gate)
        side.run_sync(side.client.resume_memory_occupation(["weights"]))
        assert memory(remote_engine)["weights_bytes"] == held["weights_bytes"]
        status, text = generate_status(remote_engine)
        assert status == 503 and "memory is released (kv_cache)" in text
        named = version(7, base)
        weights.push(iter(named.items()), 7, _no_gate)
        side.run_sync(side.client.resume_memory_occupation(["kv_cache"]))
        with LocalEngine(tiny_paths["qwen2"]) as reference:
            reference.update_weights_from_tensors(named, weight_version="7")
            expected = greedy(reference.url)
        tokens, logprobs, served = greedy(remote_engine)
        assert (tokens, served) == (expected[0], "7")
        assert logprobs == pytest.approx(expected[1], abs=1e-5)
        assert memory(remote_engine)["released"] == []
    finally:
        weights.close()
        side.close()


def test_memory_calls_name_what_they_refuse(remote_engine, tiny_paths):
    answer = httpx.post(remote_engine + "/release_memory_occupation", json={"tags": ["gpu"]}, timeout=30)
    assert answer.status_code == 400 and "tags must be a list of weights, kv_cache, cuda_graph" in answer.text
    # resumed weights hold nothing until an update loads every tensor: the engine does not serve them
    side = LoopSide(remote_engine)
    weights = TensorWeights(side, [1], buffer_bytes=1 << 20)
    try:
        side.run_sync(side.client.release_memory_occupation(["weights"]))
        side.run_sync(side.client.resume_memory_occupation())
        status, text = generate_status(remote_engine)
        assert status == 503 and "were resumed after a release and not loaded again" in text
        weights.push(iter(load_hf_state(tiny_paths["qwen2"]).items()), 10, _no_gate)
        assert generate_status(remote_engine)[0] == 200
    finally:
        weights.close()
        side.close()


@pytest.mark.parametrize(
    "mode,on_ray,colocated,in_process,expected",
    [
        ("auto", False, False, True, "InProcessWeights"),
        ("auto", False, False, False, "FolderWeights"),
        ("auto", True, False, False, "DistributedWeights"),
        ("auto", True, True, False, "TensorWeights" if torch.cuda.is_available() else "DistributedWeights"),
        ("disk", True, False, False, "FolderWeights"),
        ("distributed", False, False, False, "DistributedWeights"),
        ("tensor", False, False, False, "TensorWeights"),
        ("tensor", True, True, False, "TensorWeights"),
    ],
)
def test_the_weight_transport_is_the_one_the_flags_pick(
    remote_engine, tiny_paths, tmp_path, mode, on_ray, colocated, in_process, expected
):
    from slime_mt.config import EngineConfig
    from slime_mt.engine.weights.sync import transport_for

    side = LoopSide(remote_engine)
    local = [LocalEngine(tiny_paths["qwen2"])] if in_process else []  # not started: only its presence counts
    try:
        cfg = EngineConfig(weight_transport=mode)
        weights = transport_for(cfg, on_ray, colocated, local, side, tmp_path)
        assert type(weights).__name__ == expected
        weights.close()
    finally:
        side.close()


def test_on_vllm_versions_from_the_weight_group_serve_exactly_the_sent_weights(vllm_target, tmp_path):
    """A vLLM server joins the trainer's weight group through vLLM's weight-transfer endpoints (the
    ``slime_mt`` backend, engine/weights/vllm_worker.py) and loads every bucket rank 0 broadcasts: greedy
    decoding then equals the embedded engine's with the same weights, version by version. A bucket that
    does not fit the served checkpoint is refused before any engine receives it, naming the tensor,
    and vLLM keeps serving the last version; a new group then loads the original weights."""
    from slime_mt.config import EngineConfig
    from slime_mt.engine.weights.sync import transport_for

    base = load_hf_state(vllm_target.model_path)
    side = LoopSide(vllm_target.url, engine="vllm")

    def served() -> tuple[list[int], list[float], str]:
        out = side.run_sync(side.client.generate(PROMPT, {"max_new_tokens": 8, "temperature": 0.0}))
        meta = out["meta_info"]
        return out["output_ids"], [t[0] for t in meta["output_token_logprobs"]], meta["weight_version"]

    cfg = EngineConfig(engine="vllm", update_weight_buffer_size=64 * 1024)
    assert isinstance(transport_for(cfg, False, False, [], side, tmp_path), FolderWeights)  # auto, one node
    weights = transport_for(cfg, True, False, [], side, tmp_path)  # auto on Ray: the weight group
    assert isinstance(weights, DistributedWeights)  # joined: vLLM counts one device for the group
    try:
        with LocalEngine(vllm_target.model_path) as reference:
            for step in (1, 2, 3):
                named = version(step, base)
                weights.push(iter(named.items()), step, _no_gate)  # several buckets per version
                reference.update_weights_from_tensors(named, weight_version=str(step))
                tokens, logprobs, at = served()
                expected_tokens, expected_logprobs, _ = greedy(reference.url)
                assert at == str(step)
                assert tokens == expected_tokens
                assert logprobs == pytest.approx(expected_logprobs, abs=1e-4)
        for bad, named_in_error in [
            ({"model.not_a_weight": torch.zeros(3)}, "model.not_a_weight"),
            ({"model.norm.weight": torch.zeros(5)}, "model.norm.weight': shape (5,)"),
        ]:
            with pytest.raises(RuntimeError, match=re.escape(named_in_error)):
                weights.push(iter(bad.items()), 4, _no_gate)
            assert weights.broken
            assert served()[0] == tokens and served()[2] == "3"
    finally:
        weights.close()
    again = DistributedWeights(side, [1], buffer_bytes=1 << 20)
    try:
        again.push(iter(base.items()), 0, _no_gate)  # the session's server back to its own weights
        with LocalEngine(vllm_target.model_path) as reference:
            assert served()[::2] == (greedy(reference.url)[0], "0")
    finally:
        again.close()
        side.close()
