"""The embedded engine serves FP8 checkpoints and takes FP8 weight updates (integration tier, ~25 s:
in-process engines on the tiny models, one engine in its own process for the broadcast and handle
transports). A folder converted to block-wise FP8 serves what transformers' FP8 path (dequantized on
CPU) serves from it; an update of quantized weights, through every transport, serves exactly what a
fresh engine on the same quantized folder serves; a weight in the wrong precision is refused by name
and changes nothing."""

import shutil

import httpx
import pytest
import torch
from engine_helpers import LoopSide, engine_process
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from slime_mt.engine.embedded.server import LocalEngine
from slime_mt.engine.weights.fp8 import BlockFp8, convert_folder, quantize_stream
from slime_mt.engine.weights.sync import DistributedWeights, FolderWeights, TensorWeights, WeightFolders
from slime_mt.errors import WeightUpdateError
from slime_mt.safetensors_files import load_hf_state

PROMPT = [9707, 1879, 11, 1128, 525, 498, 30]
GREEDY = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
SMALL = BlockFp8((16, 24))  # several blocks per dimension of the tiny models, the last one partial


def generate(url: str) -> tuple[list[int], list[float]]:
    body = {"input_ids": PROMPT, "return_logprob": True, "sampling_params": GREEDY}
    meta = httpx.post(f"{url}/generate", json=body, timeout=60).json()["meta_info"]
    return [t for _, t, _ in meta["output_token_logprobs"]], [lp for lp, _, _ in meta["output_token_logprobs"]]


def perturbed(source, folder, step: int):
    """A full-precision copy of ``source`` whose weights moved as a train step moves them."""
    g = torch.Generator().manual_seed(step)
    state = {k: v + 0.02 * torch.randn(v.shape, generator=g) for k, v in load_hf_state(source).items()}
    shutil.copytree(source, folder)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return state


@pytest.mark.parametrize("kind", ["qwen3", "qwen3-moe", "qwen2.5-vl"])
def test_a_converted_folder_serves_what_transformers_fp8_path_serves(tiny_paths, tmp_path, kind):
    folder = convert_folder(tiny_paths[kind], tmp_path / "fp8", BlockFp8((128, 128)))
    cls = AutoModelForImageTextToText if "vl" in kind else AutoModelForCausalLM
    reference = cls.from_pretrained(str(folder), dtype=torch.float32).eval()  # dequantized on CPU
    with LocalEngine(folder) as engine:
        served = engine.scheduler.runner.model.state_dict()
        tokens, logprobs = generate(engine.url)
    want = reference.state_dict()
    assert served.keys() == want.keys()
    assert all(torch.equal(served[k], want[k]) for k in want)  # the same dequantized weights
    with torch.no_grad():
        logp = torch.log_softmax(reference(input_ids=torch.tensor([PROMPT + tokens])).logits[0], -1)
    expected = [float(logp[len(PROMPT) - 1 + k, t]) for k, t in enumerate(tokens)]
    assert max(abs(a - b) for a, b in zip(logprobs, expected)) < 1e-4


def test_updates_in_fp8_serve_what_a_fresh_load_of_the_quantized_folder_serves(tiny_paths, tmp_path):
    source = tiny_paths["qwen3-moe"]
    start = convert_folder(source, tmp_path / "v0", SMALL)
    state = perturbed(source, tmp_path / "full1", 1)
    quantized = dict(quantize_stream(state.items(), SMALL))
    with LocalEngine(convert_folder(tmp_path / "full1", tmp_path / "v1", SMALL)) as fresh:
        expected = generate(fresh.url)
    with LocalEngine(start) as engine:
        before = generate(engine.url)
        assert before != expected
        # a full-precision tensor where the engine serves FP8, and an FP8 one without its scale: refused whole
        name = "model.layers.0.self_attn.q_proj.weight"
        for bad, match in [
            ({**quantized, name: state[name]}, f"'{name}' is float32, but this engine serves FP8 weights"),
            ({name: quantized[name]}, f"'{name}' is float8_e4m3fn without its '{name}_scale_inv'"),
        ]:
            with pytest.raises(WeightUpdateError, match=match):
                engine.update_weights_from_tensors(bad, weight_version="bad")
            assert generate(engine.url) == before and engine.weight_version == "0"
        engine.update_weights_from_tensors(quantized, weight_version="1")  # in process
        assert generate(engine.url) == expected
        folders = FolderWeights(LoopSide(engine.url), WeightFolders(tmp_path / "weights"))
        folders.push(iter(quantize_stream(load_hf_state(source).items(), SMALL)), 2, _no_gate)  # from disk
        assert generate(engine.url) == before and engine.weight_version == "2"
    with LocalEngine(source) as full:  # an engine serving full precision refuses FP8 weights
        with pytest.raises(WeightUpdateError, match="is float8_e4m3fn, but this engine serves full-precision weights"):
            full.update_weights_from_tensors(quantized, weight_version="1")


@pytest.fixture(scope="module")
def fp8_engine(tiny_paths, tmp_path_factory):
    """An embedded engine in its own process serving the tiny Qwen2 in FP8 (nothing shared but the network)."""
    folder = convert_folder(tiny_paths["qwen2"], tmp_path_factory.mktemp("fp8") / "qwen2", SMALL)
    with engine_process(folder) as url:
        yield url


@pytest.mark.parametrize("transport", [DistributedWeights, TensorWeights])
def test_fp8_buckets_reach_an_engine_in_another_process_byte_for_byte(fp8_engine, tiny_paths, tmp_path, transport):
    """FP8 tensors cross the weight group as their bytes (gloo has no FP8 type) and by handle."""
    url = fp8_engine
    state = perturbed(tiny_paths["qwen2"], tmp_path / "full", 3)
    side = LoopSide(url)
    weights = transport(side, [1], buffer_bytes=16 * 1024)  # several buckets
    try:
        weights.push(quantize_stream(state.items(), SMALL), 3, _no_gate)
    finally:
        weights.close()
        side.close()
    with LocalEngine(convert_folder(tmp_path / "full", tmp_path / "fp8", SMALL)) as fresh:
        assert generate(url) == generate(fresh.url)


class _no_gate:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
