"""LoRA adapters served by the embedded engine as SGLang serves them (issue 71 item 3; integration tier:
one engine on the tiny Qwen3 with two peft adapters, about 15 s): adapters load and unload by name over HTTP
with SGLang's answers and refusals, a request's ``lora_path`` picks one and its log-probs (output and
input) are peft's with that adapter, a batch mixing two adapters and the base gives each row what it gets
alone, ``--max-loras-per-batch`` holds a third adapter back without changing anything, the prefix cache
keeps each adapter's KV states apart, an unloaded adapter is refused, and an engine without
``--enable-lora`` refuses adapters; and vLLM (the shared server, about 10 s more) serves a run's adapter by
name, each update replacing it in place."""

import json

import httpx
import pytest
from lora_helpers import peft_adapter, peft_logprobs
from safetensors.torch import load_file

from slime_mt.assets import tiny_model_dir
from slime_mt.engine.embedded.lora import LoraServing
from slime_mt.engine.embedded.server import LocalEngine

PROMPTS = [[5, 17, 200, 33, 9, 41], [7, 7, 120, 64, 3], [11, 250, 90, 2, 60, 61, 8]]
SAMPLING = {"temperature": 1.0, "max_new_tokens": 6, "sampling_seed": 3, "ignore_eos": True}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(the engine serving adapter ``a`` from its start, {name: (peft model, folder)})."""
    root = tmp_path_factory.mktemp("adapters")
    models = {name: (peft_adapter("qwen3", root / name, seed=seed), root / name) for name, seed in (("a", 1), ("b", 2))}
    lora = LoraServing({"a": str(models["a"][1])}, max_loras_per_batch=2)
    engine = LocalEngine(tiny_model_dir("qwen3"), max_batch_size=8, cache_tokens=4096, lora=lora).start()
    yield engine, models
    engine.stop()


def post(engine, path: str, body: dict) -> httpx.Response:
    return httpx.post(engine.url + path, json=body, timeout=60)


def generate(engine, ids, lora=None, **extra) -> dict:
    body = {"input_ids": ids, "sampling_params": SAMPLING, "return_logprob": True, "lora_path": lora, **extra}
    response = post(engine, "/generate", body)
    assert response.status_code == 200, response.text
    return response.json()


def output_logprobs(answer: dict) -> list[float]:
    return [entry[0] for entry in answer["meta_info"]["output_token_logprobs"]]


def test_adapters_load_and_unload_by_name_with_sglangs_answers(served):
    engine, models = served
    loaded = post(engine, "/load_lora_adapter", {"lora_name": "b", "lora_path": str(models["b"][1])})
    assert loaded.status_code == 200 and loaded.json()["success"], loaded.text
    assert set(loaded.json()["loaded_adapters"]) == {"a", "b"}
    again = post(engine, "/load_lora_adapter", {"lora_name": "b", "lora_path": str(models["b"][1])})
    assert again.status_code == 400 and "LoRA with name b already exists" in again.json()["error_message"]
    absent = post(engine, "/unload_lora_adapter", {"lora_name": "zzz"})
    assert absent.status_code == 400 and "LoRA with name zzz does not exist" in absent.json()["error_message"]
    refused = post(engine, "/generate", {"input_ids": PROMPTS[0], "lora_path": "zzz"})
    assert refused.status_code == 400 and "requested LoRA adapters are not loaded: zzz" in refused.text
    bad = post(engine, "/load_lora_adapter", {"lora_name": "c", "lora_path": str(tiny_model_dir("qwen3"))})
    assert bad.status_code == 400 and "no adapter_config.json" in bad.json()["error_message"]


@pytest.mark.parametrize("name", ["a", "b"])
def test_a_requests_adapter_gives_pefts_log_probs(served, name):
    engine, models = served
    post(engine, "/load_lora_adapter", {"lora_name": "b", "lora_path": str(models["b"][1])})  # (400 if there)
    answer = generate(engine, PROMPTS[0], name, logprob_start_len=0)
    ids = PROMPTS[0] + answer["output_ids"]
    want = peft_logprobs(models[name][0], ids, 1)
    got_inputs = [entry[0] for entry in answer["meta_info"]["input_token_logprobs"][1:]]
    got = got_inputs + output_logprobs(answer)
    assert len(got) == len(want) and max(abs(g - w) for g, w in zip(got, want)) < 1e-4
    base = generate(engine, PROMPTS[0])
    assert max(abs(g - w) for g, w in zip(output_logprobs(base), output_logprobs(answer))) > 1e-3


def test_a_batch_mixing_adapters_gives_each_row_its_own_and_a_third_waits(served):
    engine, models = served
    post(engine, "/load_lora_adapter", {"lora_name": "b", "lora_path": str(models["b"][1])})
    post(engine, "/load_lora_adapter", {"lora_name": "c", "lora_path": str(models["a"][1])})  # a's, named c
    names = ["a", "b", None, "c"]
    prompts = PROMPTS + [PROMPTS[0]]
    alone = [generate(engine, ids, name) for ids, name in zip(prompts, names)]
    body = {"input_ids": prompts, "sampling_params": SAMPLING, "return_logprob": True, "lora_path": names}
    response = post(engine, "/generate", body)
    assert response.status_code == 200, response.text
    for one, mixed in zip(alone, response.json()):
        assert one["output_ids"] == mixed["output_ids"]
        assert max(abs(g - w) for g, w in zip(output_logprobs(one), output_logprobs(mixed))) < 1e-5
    assert alone[0]["output_ids"] == alone[3]["output_ids"]  # c is a's adapter under another name


def test_the_prefix_cache_keeps_each_adapters_states_apart_and_unloading_refuses_the_name(served):
    engine, models = served
    post(engine, "/load_lora_adapter", {"lora_name": "b", "lora_path": str(models["b"][1])})
    ids = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
    first = generate(engine, ids, "a")
    other = generate(engine, ids, "b")
    assert other["meta_info"]["cached_tokens"] == 0  # a's states are not b's
    assert generate(engine, ids, "a")["meta_info"]["cached_tokens"] > 0
    fresh = peft_logprobs(models["b"][0], ids + other["output_ids"], len(ids))
    assert max(abs(g - w) for g, w in zip(output_logprobs(other), fresh)) < 1e-4
    assert first["output_ids"] != other["output_ids"] or output_logprobs(first) != output_logprobs(other)
    gone = post(engine, "/unload_lora_adapter", {"lora_name": "b"})
    assert (
        gone.status_code == 200 and "b" not in gone.json()["loaded_adapters"] and "a" in gone.json()["loaded_adapters"]
    )
    refused = post(engine, "/generate", {"input_ids": ids, "lora_path": "b"})
    assert refused.status_code == 400 and "not loaded: b" in refused.text


def test_an_engine_without_enable_lora_refuses_adapters(tiny_paths):
    with LocalEngine(tiny_paths["qwen2"], max_batch_size=2) as engine:
        load = post(engine, "/load_lora_adapter", {"lora_name": "a", "lora_path": "/nowhere"})
        assert load.status_code == 400 and "LoRA is not enabled" in load.json()["error_message"]
        refused = post(engine, "/generate", {"input_ids": [1, 2, 3], "lora_path": "a"})
        assert refused.status_code == 400 and "LoRA is not enabled" in refused.text


def test_an_in_process_update_replaces_an_adapter_between_steps(served):
    """What a LoRA run's in-process transport does at each update (``LocalEngine.update_adapter``): the
    adapter's tensors served under its name, as the weight version given, the base untouched."""
    engine, models = served
    folder = models["b"][1]
    config = json.loads((folder / "adapter_config.json").read_text())
    engine.update_adapter("swap", config, load_file(folder / "adapter_model.safetensors"), weight_version="7")
    answer = generate(engine, PROMPTS[1], "swap")
    assert answer["meta_info"]["weight_version"] == "7"
    want = peft_logprobs(models["b"][0], PROMPTS[1] + answer["output_ids"], len(PROMPTS[1]))
    assert max(abs(g - w) for g, w in zip(output_logprobs(answer), want)) < 1e-4
    folder = models["a"][1]
    engine.update_adapter("swap", config, load_file(folder / "adapter_model.safetensors"), weight_version="8")
    again = generate(engine, PROMPTS[1], "swap")
    want = peft_logprobs(models["a"][0], PROMPTS[1] + again["output_ids"], len(PROMPTS[1]))
    assert max(abs(g - w) for g, w in zip(output_logprobs(again), want)) < 1e-4


def test_vllm_serves_a_runs_adapter_and_each_update_replaces_it(vllm_target, tmp_path):
    """vLLM (the shared server, started with --enable-lora as a LoRA run starts it): ``replace_lora_adapter``
    loads a PEFT folder under the run's adapter name at a weight version, a client whose ``lora_path`` names
    it gets peft's log-probs with that adapter (fp32 here: within 1e-4) and one that names none the base's,
    the next version's folder replaces it in place, and a folder that is no adapter is refused with the
    served one unchanged. The adapter is unloaded and version "0" put back at the end (the shared server's
    state)."""
    import asyncio

    from slime_mt.assets import VLLM_TINY_KIND
    from slime_mt.errors import EngineError

    models = [peft_adapter(VLLM_TINY_KIND, tmp_path / f"v{i}", seed=seed) for i, seed in ((1, 4), (2, 5))]
    ids = PROMPTS[2]

    def want(model, answer, adapter=True) -> list[float]:
        full = ids + answer["output_ids"]
        if adapter:
            return peft_logprobs(model, full, len(ids))
        with model.disable_adapter():
            return peft_logprobs(model, full, len(ids))

    async def run() -> None:
        lora, base = vllm_target.client(), vllm_target.client()
        lora.lora_path = "policy"
        try:
            await lora.replace_lora_adapter("policy", str(tmp_path / "v1"), weight_version="11")
            first, plain = await lora.generate(ids, SAMPLING), await base.generate(ids, SAMPLING)
            assert first["meta_info"]["weight_version"] == "11"
            assert max(abs(g - w) for g, w in zip(output_logprobs(first), want(models[0], first))) < 1e-4
            assert max(abs(g - w) for g, w in zip(output_logprobs(plain), want(models[0], plain, False))) < 1e-4
            await lora.replace_lora_adapter("policy", str(tmp_path / "v2"), weight_version="12")
            second = await lora.generate(ids, SAMPLING)
            assert second["meta_info"]["weight_version"] == "12"
            assert max(abs(g - w) for g, w in zip(output_logprobs(second), want(models[1], second))) < 1e-4
            with pytest.raises(EngineError, match="load_lora_adapter"):
                await lora.replace_lora_adapter("policy", str(tiny_model_dir(VLLM_TINY_KIND)), weight_version="13")
            kept = await lora.generate(ids, SAMPLING)
            assert kept["output_ids"] == second["output_ids"] and output_logprobs(kept) == output_logprobs(second)
            assert kept["meta_info"]["weight_version"] == "12"
        finally:
            await base._broadcast("/v1/unload_lora_adapter", {"lora_name": "policy"}, text=True)
            await base._broadcast("/update_weight_version", {"new_version": "0"})
            await lora.close(), await base.close()

    asyncio.run(run())
