"""Shared fixtures: offline model assets (built once into SLIME_MT_CACHE) and tokenizers."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def qwen_tokenizer():
    """The real Qwen tokenizer with the Qwen2.5 chat template."""
    from transformers import AutoTokenizer

    from slime_mt.assets import qwen_tokenizer_dir

    return AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir("qwen2.5")))


@pytest.fixture(scope="session")
def qwen3_tokenizer():
    from transformers import AutoTokenizer

    from slime_mt.assets import qwen_tokenizer_dir

    return AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir("qwen3")))


@pytest.fixture(scope="session")
def smollm2_path():
    from slime_mt.assets import smollm2_dir

    return smollm2_dir()


@pytest.fixture(scope="session")
def tiny_paths():
    """kind -> folder for every tiny random model (qwen2, qwen3, qwen2.5-vl, qwen3-vl)."""
    from slime_mt.assets import TINY_KINDS, tiny_model_dir

    return {kind: tiny_model_dir(kind) for kind in TINY_KINDS}


def pytest_collection_modifyitems(config, items):
    """GPU-marked tests run only where CUDA is available."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
