"""Megatron backend on CPU, with real Megatron processes: the fused core attention vs Megatron's, HF
parity per family, the TP matrix
(TP=1 vs TP=2 vs transformers, every family), data parallelism (DP=2 and TP=2 x DP=2 vs DP=1),
bf16, RoPE scaling, SFT, engine fidelity, checkpoints (bitwise resume, TP=1 -> TP=2 -> TP=1).

The checks run in spawned processes (``megatron_worker.py``); the launches are shared by the tests
of this module, so megatron is imported once per launch, not per test."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from megatron_worker import FAMILIES, REFUSED_ROPE, ROPE_CASES
from train_helpers import repo_env

from slime_mt.backends.megatron.convert import load_hf_state

WORKER = Path(__file__).with_name("megatron_worker.py")
REPO = Path(__file__).resolve().parents[2]


def launch(tp: int, world: int, checks: str, out: Path) -> dict:
    if world == 1:
        cmd = [sys.executable, str(WORKER)]
    else:
        from slime_mt.engine.launch import free_port

        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(world),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            str(WORKER),
        ]
    env = repo_env()
    proc = subprocess.run(
        cmd + ["--tp", str(tp), "--checks", checks, "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1500,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads((out / f"results_tp{tp}_world{world}.json").read_text())


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("megatron")
    tp1 = launch(
        1,
        1,
        "attention,tree,families,matrix,hf_reference,dp,bf16,rope,sft,logprob_chunks,engine_fidelity,checkpoint,"
        "checkpoint_bf16,reshard_save,offload",
        out,
    )
    tp2 = launch(2, 2, "attention,tree,matrix,reshard_load,export_ranks,logprob_chunks,offload", out)
    dp2 = launch(1, 2, "dp,reshard_load", out)
    tp2dp2 = launch(2, 4, "dp", out)
    return {"tp1": tp1, "tp2": tp2, "dp2": dp2, "tp2dp2": tp2dp2, "dir": out}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius difference ||a - b|| / ||b||."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


# ---------------------------------------------------------------- HF parity


@pytest.mark.parametrize("kind", ["smollm2", *FAMILIES])
def test_logits_match_transformers_and_export_round_trips(results, kind):
    """Against transformers' SDPA attention (the same fp32 arithmetic as the fused core attention)
    Megatron is exact to 1e-5; against an fp64 reference it is no further off than transformers' own
    fp32 result. (SmolLM2's residual stream reaches ~2.5e4, so any two fp32 implementations are ~1e-4
    apart on its logits: transformers' eager and SDPA kernels differ from each other by as much.)"""
    r = results["tp1"]["families"][kind]
    for seq in r["sequences"]:
        assert seq["vs_sdpa"] < 1e-5, seq
        assert seq["vs_fp64"] <= 1.05 * seq["hf_fp32_vs_fp64"] + 1e-6, seq
    assert r["export_mismatched"] == [] and r["export_extra"] == []
    assert len(r["sequences"]) == (2 if kind.endswith("-vl") else 1)


# ---------------------------------------------------------------- core attention


@pytest.mark.parametrize("tp", ["tp1", "tp2"])
@pytest.mark.parametrize("kind", FAMILIES)
def test_fused_attention_equals_megatrons_on_a_packed_row(results, kind, tp):
    """PyTorch's fused kernels per packed sequence give Megatron's DotProductAttention's log-probs,
    entropies, loss and gradients (fp32, 1e-5; relative for the entropies, ~12 nats over Qwen's
    vocabulary), text and VLM, TP=1 and TP=2, without an [L, L] mask."""
    r = results[tp]["attention"][kind]
    assert r["fused_packs_segments"] and not r["reference_packs_segments"]
    assert r["logprobs"] < 1e-5 and r["entropy"] < 1e-5 * max(r["max_entropy"], 1.0) and r["loss"] < 1e-6, r
    assert r["grads"] < 1e-5 * max(r["max_grad"], 1.0), r


@pytest.mark.parametrize("tp", ["tp1", "tp2"])
@pytest.mark.parametrize(
    "case",
    [f"{kind}/{batch}" for kind in ("llama", "qwen2", "qwen3") for batch in ("grpo", "strip_thinking")]
    + [f"{kind}/{batch}" for kind in ("qwen2.5-vl", "qwen3-vl") for batch in ("vlm_grpo", "vlm_steps")],
)
def test_prefix_tree_rows_equal_flat_rows_with_fewer_tokens(results, case, tp):
    """--shared-prefix-training, as one prefix-tree row vs one flat row: log-probs, entropies, loss and
    gradients equal (fp32, 1e-5), TP=1 and TP=2; the tree forwards each shared token once. Text: a
    GRPO group of 8 sharing a 40-token prompt and four step-wise strip_thinking steps. VLMs: two
    GRPO groups of 4 on images A and B (the same text), and three steps whose history gains image B,
    then A again; each distinct image goes through the vision tower once."""
    r = results[tp]["tree"][case]
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


def test_a_token_budget_counts_prefix_tree_tokens(results):
    assert results["tp1"]["tree_rows"] == {"tree": [5, 3], "flat": [1] * 8}


def test_prefix_tree_packing_is_refused_where_it_does_not_apply(results):
    refused = results["tp1"]["tree_refused"]
    assert "--local-attention fused" in refused["qwen3"]


# ---------------------------------------------------------------- the TP matrix


def _matrix(results, kind):
    d = results["dir"]
    return [torch.load(d / f"matrix_{tag}_{kind}.pt", weights_only=True) for tag in ("tp1", "tp2", "hf")]


@pytest.mark.parametrize("kind", FAMILIES)
def test_tp2_equals_tp1_equals_transformers_logprobs_and_loss(results, kind):
    tp1, tp2, hf = _matrix(results, kind)
    for run in (tp1, tp2):
        for got, want in zip(run["logprobs"] + run["entropy"], hf["logprobs"] + hf["entropy"]):
            assert all(abs(u - v) < 1e-5 + 2e-6 * abs(v) for u, v in zip(got, want)), (got, want)
        assert abs(run["loss"] - hf["loss"]) < 1e-6 + 1e-5 * abs(hf["loss"])


@pytest.mark.parametrize("kind", FAMILIES)
def test_tp2_equals_tp1_equals_transformers_gradients_and_grad_norm(results, kind):
    """Every trainable tensor's gradient (HF layout) and the clipping norm. At TP=2 this covers the
    all-reduce of Qwen3's replicated q/k-norm gradients and the TP attributes the norm needs."""
    tp1, tp2, hf = _matrix(results, kind)
    assert tp1["grads"].keys() == tp2["grads"].keys()
    assert set(hf["grads"]) <= set(tp1["grads"])
    for name, want in hf["grads"].items():
        for tag, run in (("tp1", tp1), ("tp2", tp2)):
            assert rel(run["grads"][name], want) < 1e-4, (tag, name, rel(run["grads"][name], want))
    for run in (tp1, tp2):
        assert abs(run["grad_norm"] - hf["grad_norm"]) <= 1e-5 * hf["grad_norm"], (run["grad_norm"], hf["grad_norm"])


ADAM_EPS, LR = 1e-8, 1e-5


@pytest.mark.parametrize("kind", FAMILIES)
def test_tp2_replicated_parameters_stay_identical_and_weights_match_tp1(results, kind):
    """After one Adam step the exported weights agree except where the clipped gradient is within
    100 Adam eps of zero. Adam's first step moves an element by lr * g / (|g| + eps): for |g| >> eps
    that is lr * sign(g), whatever the layout; near eps it amplifies fp32 reduction-order noise in g
    (a few percent there, or a flipped sign for a gradient that is zero up to noise). Before the
    fix the TP=2 grad norm was wrong, so TP=2 clipped with another coefficient and every element with
    a clipped gradient near eps moved differently: that was the Qwen3-VL o_proj difference."""
    tp1, tp2, _ = _matrix(results, kind)
    assert tp2["replicated_spread"] == 0.0
    assert tp1["weights"].keys() == tp2["weights"].keys()
    clip = min(1.0, 1.0 / (tp1["grad_norm"] + 1e-6))  # clip_grad 1.0
    for name in tp1["weights"]:
        a, b = tp1["weights"][name], tp2["weights"][name]
        assert float((a - b).abs().max()) <= 2 * LR, name
        differs = (a - b).abs() > 1e-7
        if differs.any():
            clipped = tp1["grads"][name][differs].abs() * clip
            assert bool((clipped < 100 * ADAM_EPS).all()), (name, clipped)


# ---------------------------------------------------------------- data parallel


@pytest.mark.parametrize("reduction", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("layout", ["tp1_dp2", "tp2_dp2"])
def test_data_parallel_gives_the_same_update_as_one_rank(results, reduction, layout):
    d = results["dir"]
    one = torch.load(d / f"dp_{reduction}_tp1_dp1.pt", weights_only=True)
    many = torch.load(d / f"dp_{reduction}_{layout}.pt", weights_only=True)
    assert many["tokens"] == one["tokens"]
    assert abs(many["loss"] - one["loss"]) < 1e-6
    assert abs(many["grad_norm"] - one["grad_norm"]) <= 1e-5 * one["grad_norm"], (many["grad_norm"], one["grad_norm"])
    for key in ("train/loss", "train/grad_norm", "train/tokens"):
        assert abs(many["train"][key] - one["train"][key]) <= 1e-5 * abs(one["train"][key]) + 1e-7, key
    for name, a in one["weights"].items():  # three Adam steps at lr 1e-5 (see the TP weights test)
        assert rel(many["weights"][name], a) < 1e-5 and float((many["weights"][name] - a).abs().max()) <= 6e-5, name


# ---------------------------------------------------------------- bf16


@pytest.mark.parametrize("kind", FAMILIES)
def test_bf16_trains_with_fp32_main_params_and_grads(results, kind):
    r = results["tp1"]["bf16"][kind]
    assert r["param_dtypes"] == ["torch.bfloat16"]
    assert r["main_param_dtypes"] == ["torch.float32"] and r["main_grad_dtypes"] == ["torch.float32"]
    assert r["logprob_dtype"] == "torch.float32"
    assert r["logprob_mean_abs_diff"] < 0.05, r  # bf16 rounding, reported in the README
    assert all(torch.isfinite(torch.tensor(r["losses"] + r["grad_norms"])))
    assert r["main_params_moved"] == r["main_params"], r


# ---------------------------------------------------------------- RoPE scaling


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_rope_scaling_matches_transformers_past_the_original_context(results, case):
    r = results["tp1"]["rope"][case]
    assert r["max_abs_diff"] < 1e-4, r
    assert r["scaling_effect"] > 100 * max(r["max_abs_diff"], 1e-6), r  # ignoring the scaling would show


@pytest.mark.parametrize("case", sorted(REFUSED_ROPE))
def test_unreproducible_rope_types_are_refused_naming_the_key(results, case):
    error = results["tp1"]["rope"][case]["error"]
    kind = REFUSED_ROPE[case][1]["rope_type"]
    assert error is not None and f"rope_parameters.rope_type='{kind}' is not supported" in error


# ---------------------------------------------------------------- SFT, engine fidelity


def test_sft_loss_ignores_the_rollout_temperature(results):
    r = results["tp1"]["sft"]
    assert abs(r["loss"] - r["nll_t1"]) < 1e-5 * abs(r["nll_t1"])
    assert abs(r["nll_t1"] - r["nll_t05"]) > 1e-3


@pytest.mark.parametrize("kind", ["smollm2", "qwen2.5-vl"])
def test_engine_logprobs_match_megatron_recomputation(results, kind):
    assert results["tp1"]["engine_fidelity"][kind]["mean_abs_diff"] < 1e-3


# ---------------------------------------------------------------- checkpoints


def test_checkpoint_resume_is_bitwise_and_survives_a_killed_save(results):
    r = results["tp1"]["checkpoint"]
    assert r["bitwise_equal"] is True
    assert r["extra"] == {"data_cursor": 2}
    assert r["latest"] == "iter_0000004" and r["after_killed_save"] == {"data_cursor": 2} and r["step"] == 4
    assert r["hf_loadable"] == "Qwen2ForCausalLM" and r["hf_weights_equal_export"] is True


def test_bf16_checkpoint_restores_fp32_main_params_and_optimizer_state(results):
    r = results["tp1"]["checkpoint_bf16"]
    assert r == {
        "main_params_equal": True,
        "params_equal": True,
        "optimizer_state_equal": True,
        "continued_equal": True,
        "vision_trainable": True,
    }


def test_checkpoints_reshard_tp1_to_tp2_to_tp1(results):
    """Weights and optimizer state survive TP=1 -> TP=2 -> TP=1 bit for bit, and training resumed at
    TP=2 takes the same step as at TP=1."""
    root = results["dir"] / "reshard"
    a, b, c = (root / x / (root / x / "latest").read_text() for x in "abc")
    for sub in ("", "optimizer/exp_avg", "optimizer/exp_avg_sq"):
        first, last = load_hf_state(a / sub), load_hf_state(c / sub)
        assert first.keys() == last.keys() and len(first) > 0
        for name in first:
            assert torch.equal(first[name], last[name]), (sub, name)
    states = [json.loads((x / "trainer_state.json").read_text()) for x in (a, b, c)]
    assert [s["step"] for s in states] == [2, 2, 2] and [s["layout"]["tp"] for s in states] == [1, 2, 1]
    assert results["tp2"]["reshard_load_tp2"]["extra"] == {"layout": "tp1"}
    tp1 = torch.load(results["dir"] / "reshard_continued_tp1.pt", weights_only=True)
    tp2 = torch.load(results["dir"] / "reshard_continued_tp2.pt", weights_only=True)
    for name in tp1:
        assert torch.allclose(tp1[name], tp2[name], rtol=0, atol=1e-5), name


@pytest.mark.parametrize("launch_name,tp", [("tp1", 1), ("tp2", 2)])
def test_logprobs_hold_one_chunk_of_logits_and_match_autograd_on_the_full_logits(results, launch_name, tp):
    r = results[launch_name][f"logprob_chunks_tp{tp}"]
    for suffix in ("", "_padded"):  # the real vocabulary, and one whose last 1000 rows are padding
        assert r[f"logprob_diff{suffix}"] < 1e-5 and r[f"entropy_diff{suffix}"] < 1e-5, r
        assert r[f"hidden_grad_diff{suffix}"] < 1e-6, r
        assert r[f"weight_grad_diff{suffix}"] < 1e-5 * max(r["weight_grad_max"], 1.0), r
    assert r["largest_saved"] < r["chunk_logits"] < r["all_logits"], r  # no logits saved at all
    # a metric-only entropy: the same values, no graph, no effect on gradients
    assert r["metric_entropy_diff"] < 1e-5 and not r["metric_entropy_requires_grad"], r
    assert r["metric_grad_diff"] == 0.0 and r["no_entropy_is_none"], r


def test_export_gathers_to_rank_zero_only(results):
    counts = results["tp2"]["export_ranks"]
    assert counts[0]["none"] == 0 and counts[0]["full"] > 0
    assert counts[1] == {"full": 0, "none": counts[0]["full"]}


@pytest.mark.parametrize("tp", ["tp1", "tp2"])
@pytest.mark.parametrize("kind", ["qwen2", "qwen2.5-vl"])
def test_offload_frees_the_device_and_onload_trains_on_bit_for_bit(results, tp, kind):
    """--offload (colocated): while offloaded the trainer's parameters, fp32 main parameters,
    gradients, optimizer state and reference model hold no device memory; onloaded, the next step's
    loss, grad norm and weights are exactly those of a trainer that never left the device."""
    r = results[tp]["offload"][kind]
    assert r["held_bytes"] > 0 and r["offloaded_bytes"] == 0 and r["onloaded_bytes"] == r["held_bytes"]
    assert r["losses"][0] == r["losses"][1] and r["grad_norms"][0] == r["grad_norms"][1]
    assert r["same_weights"]
