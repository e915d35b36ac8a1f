"""The fused core attention (PyTorch's fused kernels per packed sequence, no [L, L] mask) and prefix-tree
rows (--shared-prefix-training) against Megatron's own attention and flat rows, at TP=1 and TP=2."""

import pytest
from megatron_worlds import FAMILIES


@pytest.mark.parametrize("tp", ["tp1", "tp2"])
@pytest.mark.parametrize("kind", FAMILIES)
def test_fused_attention_equals_megatrons_on_a_packed_row(world, kind, tp):
    """PyTorch's fused kernels per packed sequence give Megatron's DotProductAttention's log-probs,
    entropies, loss and gradients (fp32, 1e-5; relative for the entropies, ~12 nats over Qwen's
    vocabulary), text and VLM, TP=1 and TP=2, without an [L, L] mask."""
    r = world(tp, kind)["attention"][kind]
    assert r["fused_packs_segments"] and not r["reference_packs_segments"]
    assert r["logprobs"] < 1e-5 and r["entropy"] < 1e-5 * max(r["max_entropy"], 1.0) and r["loss"] < 1e-6, r
    assert r["grads"] < 1e-5 * max(r["max_grad"], 1.0), r


@pytest.mark.parametrize("tp", ["tp1", "tp2"])
@pytest.mark.parametrize(
    "case",
    [f"{kind}/{batch}" for kind in ("llama", "qwen2", "qwen3", "qwen3-moe") for batch in ("grpo", "strip_thinking")]
    + [f"{kind}/{batch}" for kind in ("qwen2.5-vl", "qwen3-vl", "qwen3-vl-moe") for batch in ("vlm_grpo", "vlm_steps")],
)
def test_prefix_tree_rows_equal_flat_rows_with_fewer_tokens(world, case, tp):
    """--shared-prefix-training, as one prefix-tree row vs one flat row: log-probs, entropies, loss and
    gradients equal (fp32, 1e-5), TP=1 and TP=2; the tree forwards each shared token once. Text: a
    GRPO group of 8 sharing a 40-token prompt and four step-wise strip_thinking steps. VLMs: two
    GRPO groups of 4 on images A and B (the same text), and three steps whose history gains image B,
    then A again; each distinct image goes through the vision tower once."""
    r = world(tp, case.split("/")[0])["tree"][case]
    assert r["logprobs"] < 1e-5 and r["entropy"] < 1e-5 * max(r["max_entropy"], 1.0) and r["loss"] < 1e-6, r
    assert r["grads"] < 1e-5 * max(r["max_grad"], 1.0), r
    batch = case.split("/")[1]
    expected = {"grpo": (8 * 52, 40 + 8 * 12), "strip_thinking": (40 + 50 + 60 + 70 + 4 * 14, 40 + 14 + 3 * 24)}
    if batch in expected:
        assert (r["flat_tokens"], r["tree_tokens"]) == expected[batch]
        assert r["flat_images"] == r["tree_images"] == 0
    else:
        assert r["tree_tokens"] < r["flat_tokens"]
        assert (r["flat_images"], r["tree_images"]) == ({"vlm_grpo": 8, "vlm_steps": 1 + 2 + 3}[batch], 2)
    assert (r["sums_before"], r["sums_after"]) == (r["flat_tokens"], r["tree_tokens"])  # the step's metrics


def test_a_token_budget_counts_prefix_tree_tokens(world):
    assert world("tp1")["tree_rows"] == {"tree": [5, 3], "flat": [1] * 8}


def test_prefix_tree_packing_is_refused_where_it_does_not_apply(world):
    refused = world("tp1")["tree_refused"]
    assert "--local-attention fused" in refused["qwen3"]
