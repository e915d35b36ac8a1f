"""The Megatron path on CUDA (run wherever a GPU exists; skipped without one): placement, parity with
transformers on the same GPU, a train step and a weight export, fp32 and bf16, every family."""

import math

import pytest

from megatron_worker import FAMILIES
from test_megatron import launch

pytestmark = pytest.mark.gpu

KINDS = ["smollm2", *FAMILIES]


@pytest.fixture(scope="module")
def gpu(tmp_path_factory):
    return launch(1, 1, "gpu", tmp_path_factory.mktemp("megatron-gpu"))["gpu"]


def test_cuda_process_setup(gpu):
    assert gpu["cpu_patches_applied"] is False  # the CPU patches stay out of the way on CUDA
    assert gpu["device"] == "cuda:0" and gpu["backend"] == "nccl"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("kind", KINDS)
def test_forward_train_step_and_export_on_cuda(gpu, kind, precision):
    r = gpu[f"{kind}-{precision}"]
    assert r["param_devices"] == ["cuda:0"]
    assert r["param_dtypes"] == ["torch.float32" if precision == "fp32" else "torch.bfloat16"]
    # same GPU, same dtype: fp32 within kernel noise, bf16 within bf16 rounding of logits
    bound = (2e-4 if kind == "smollm2" else 1e-5) if precision == "fp32" else 0.1 * (10 if kind == "smollm2" else 1)
    assert max(r["logit_max_abs_diff"]) < bound, r
    assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0
    assert r["exported"] > 0 and r["exported_devices"] == ["cuda:0"]
