"""engine=sglang: a clear error without SGLang here; the real server where SGLang and a GPU exist."""

import importlib.util

import pytest

from slime_mt.config import EngineConfig
from slime_mt.engine.launch import require_sglang, start_engines
from slime_mt.errors import LaunchError

HAS_SGLANG = importlib.util.find_spec("sglang") is not None


@pytest.mark.skipif(HAS_SGLANG, reason="SGLang is installed here")
def test_missing_sglang_names_the_gpu_extra(tmp_path):
    with pytest.raises(LaunchError, match=r"pip install -e '\.\[gpu\]'"):
        require_sglang()
    with pytest.raises(LaunchError, match="engine=sglang needs SGLang"):
        start_engines(EngineConfig(engine="sglang"), "/models/none", tmp_path)
