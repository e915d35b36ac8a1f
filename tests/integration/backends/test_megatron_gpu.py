"""The Megatron path on CUDA (run wherever a GPU exists; skipped without one): placement, parity with
transformers on the same GPU, a train step and a weight export, fp32 and bf16, every family; the fused
attention and prefix-tree rows (flex_attention) equal to the reference on CUDA; a 16k-token
micro-batch trained through the fused attention."""

import json
import math

import pytest
from megatron_worlds import FAMILIES, launch

pytestmark = pytest.mark.gpu

KINDS = ["smollm2", *FAMILIES]


@pytest.fixture(scope="module")
def gpu(tmp_path_factory):
    """Every family on CUDA (two launches, each well within a test's time budget)."""
    return launch(1, 1, "gpu", tmp_path_factory.mktemp("megatron-gpu"), "gpu")


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    """The fused and flex_attention rows, and the 16k-token micro-batch, on CUDA."""
    return launch(1, 1, "attention,tree,long_micro_batch", tmp_path_factory.mktemp("megatron-gpu"), "kernels")


def test_cuda_process_setup(gpu):
    gpu = gpu["gpu"]
    assert gpu["cpu_patches_applied"] is False  # the CPU patches stay out of the way on CUDA
    assert gpu["device"] == "cuda:0" and gpu["backend"] == "nccl"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("kind", KINDS)
def test_forward_train_step_and_export_on_cuda(gpu, kind, precision):
    r = gpu["gpu"][f"{kind}-{precision}"]
    assert r["param_devices"] == ["cuda:0"]
    assert r["param_dtypes"] == ["torch.float32" if precision == "fp32" else "torch.bfloat16"]
    # same GPU, same dtype: fp32 within kernel noise, bf16 within bf16 rounding of logits
    bound = (2e-4 if kind == "smollm2" else 1e-5) if precision == "fp32" else 0.1 * (10 if kind == "smollm2" else 1)
    assert max(r["logit_max_abs_diff"]) < bound, r
    assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0
    assert r["exported"] > 0 and r["exported_devices"] == ["cuda:0"]


@pytest.mark.parametrize("kind", FAMILIES)
def test_fused_attention_equals_megatrons_on_cuda(kernels, kind):
    r = kernels["attention"][kind]
    assert r["fused_packs_segments"] and not r["reference_packs_segments"]
    assert r["logprobs"] < 1e-5 and r["entropy"] < 1e-5 * max(r["max_entropy"], 1.0) and r["loss"] < 1e-6, r
    assert r["grads"] < 1e-5 * max(r["max_grad"], 1.0), r


@pytest.mark.parametrize(
    "case",
    [f"{kind}/{batch}" for kind in ("llama", "qwen2", "qwen3") for batch in ("grpo", "strip_thinking")]
    + [f"{kind}/{batch}" for kind in ("qwen2.5-vl", "qwen3-vl") for batch in ("vlm_grpo", "vlm_steps")],
)
def test_prefix_tree_rows_through_flex_attention_equal_flat_rows_on_cuda(kernels, case):
    r = kernels["tree"][case]
    assert r["logprobs"] < 1e-5 and r["entropy"] < 1e-5 * max(r["max_entropy"], 1.0) and r["loss"] < 1e-6, r
    assert r["grads"] < 1e-5 * max(r["max_grad"], 1.0), r
    assert r["tree_tokens"] < r["flat_tokens"] and r["tree_images"] <= r["flat_images"]


def test_a_16k_token_micro_batch_trains_through_the_fused_attention(kernels):
    """One 16,384-token micro-batch on CUDA without Transformer Engine (bf16): the flat packed row
    (per-sequence fused kernels) and the prefix-tree row (flex_attention) both train; figures printed."""
    r = kernels["long_micro_batch"]
    print(json.dumps(r, indent=1))
    flat, tree = r["fused"], r["tree"]
    assert (flat["rows"], flat["row_tokens"], flat["layout"]) == (1, 16384, "Segments")
    assert (tree["rows"], tree["row_tokens"], tree["layout"]) == (1, 2 * (512 + 8 * 512), "Tree")
    for v in (flat, tree):
        assert math.isfinite(v["loss"]) and math.isfinite(v["grad_norm"]) and v["grad_norm"] > 0
    assert tree["peak_gib"] < flat["peak_gib"]
