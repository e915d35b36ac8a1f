"""engine=sglang: a clear error without SGLang here; the real server where SGLang and a GPU exist."""

import importlib.util
import os

import pytest
import torch

from slime_mt.config import EngineConfig
from slime_mt.engine.launch import start_engines
from slime_mt.errors import LaunchError

HAS_SGLANG = importlib.util.find_spec("sglang") is not None


def test_engine_url_that_does_not_answer(tmp_path):
    with pytest.raises(LaunchError, match=r"--engine-url http://127.0.0.1:9 does not answer /health"):
        start_engines(EngineConfig(engine_url=["http://127.0.0.1:9"]), "unused", tmp_path, connect_timeout=1.0)


@pytest.mark.gpu
@pytest.mark.skipif(
    not (HAS_SGLANG and torch.cuda.is_available() and os.environ.get("SLIME_MT_GPU_MODEL")),
    reason="needs SGLang, a GPU and SLIME_MT_GPU_MODEL=<HF folder>",
)
def test_real_sglang_server_speaks_the_same_protocol(tmp_path):
    import asyncio

    from slime_mt.engine.clients.sglang import EngineClient
    from slime_mt.processing import load_tokenizer_or_processor, tokenizer_of

    path = os.environ["SLIME_MT_GPU_MODEL"]
    group = start_engines(EngineConfig(engine="sglang", num_engines=1), path, tmp_path)
    try:
        tokenizer = tokenizer_of(load_tokenizer_or_processor(path))
        ids = tokenizer("The capital of France is", add_special_tokens=False)["input_ids"]

        async def go():
            async with EngineClient(group.url, group.worker_urls) as client:
                out = await client.generate(ids, {"max_new_tokens": 8, "temperature": 0.0})
                aborted = asyncio.create_task(
                    client.generate(ids, {"max_new_tokens": 4000, "ignore_eos": True}, rid="gpu-abort")
                )
                await asyncio.sleep(0.5)
                await client.abort("gpu-abort")
                return out, await aborted

        out, aborted = asyncio.run(go())
        assert len(out["output_ids"]) == 8
        assert len(out["meta_info"]["output_token_logprobs"]) == 8
        assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
    finally:
        group.stop()
