"""bf16 training: bf16 parameters with fp32 main parameters and gradients, fp32 log-probs, every family."""

import pytest
import torch
from megatron_worlds import FAMILIES


@pytest.mark.parametrize("kind", FAMILIES)
def test_bf16_trains_with_fp32_main_params_and_grads(world, kind):
    r = world("tp1_models", kind)["bf16"][kind]
    assert r["param_dtypes"] == ["torch.bfloat16"]
    assert r["main_param_dtypes"] == ["torch.float32"] and r["main_grad_dtypes"] == ["torch.float32"]
    assert r["logprob_dtype"] == "torch.float32"
    assert r["logprob_mean_abs_diff"] < 0.05, r  # bf16 rounding, reported in docs/training.md
    assert all(torch.isfinite(torch.tensor(r["losses"] + r["grad_norms"])))
    assert r["main_params_moved"] == r["main_params"], r
