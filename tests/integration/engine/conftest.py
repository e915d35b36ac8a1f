"""Engines shared by the engine tests: embedded engines on tiny models, alone and behind the router,
and a vLLM server."""

import pytest


@pytest.fixture(params=["text-direct", "text-router", "text-vllm"])
def text_target(request, farm, tiny_paths):
    if request.param == "text-vllm":
        return request.getfixturevalue("vllm_target")
    return farm.target(request.param, tiny_paths["qwen2"])


@pytest.fixture(params=["vl-direct", "vl-router"])
def vl_target(request, farm, tiny_paths):
    return farm.target(request.param, tiny_paths["qwen2.5-vl"])
