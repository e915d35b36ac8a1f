"""Checkpoints: a bitwise resume that survives a killed save, bf16 checkpoints with their fp32 main
parameters and optimizer state, resharding TP=1 -> TP=2 -> TP=1 (TP=1 x DP=2) and TP=1 -> PP=2, and the
distributed optimizer's shards scattered from and gathered into the same HF-named checkpoint."""

import json

import pytest
import torch

from slime_mt.safetensors_files import load_hf_state


def assert_same_checkpoint_files(a, b) -> None:
    """Two checkpoint folders hold the same weights and Adam moments, bit for bit, under the same names."""
    for sub in ("", "optimizer/exp_avg", "optimizer/exp_avg_sq"):
        first, again = load_hf_state(a / sub), load_hf_state(b / sub)
        assert first.keys() == again.keys() and len(first) > 0
        for name in first:
            assert torch.equal(first[name], again[name]), (sub, name)


def test_checkpoint_resume_is_bitwise_and_survives_a_killed_save(world):
    r = world("tp1_state")["checkpoint"]
    assert r["bitwise_equal"] is True
    assert r["extra"] == {"data_cursor": 2}
    assert r["latest"] == "iter_0000004" and r["after_killed_save"] == {"data_cursor": 2} and r["step"] == 4
    assert r["hf_loadable"] == "Qwen2ForCausalLM" and r["hf_weights_equal_export"] is True


def test_bf16_checkpoint_restores_fp32_main_params_and_optimizer_state(world):
    r = world("tp1_models")["checkpoint_bf16"]
    assert r == {
        "main_params_equal": True,
        "params_equal": True,
        "optimizer_state_equal": True,
        "continued_equal": True,
        "vision_trainable": True,
    }


def test_checkpoints_reshard_tp1_to_tp2_to_tp1(world, megatron_dir):
    """Weights and optimizer state survive TP=1 -> TP=2 -> TP=1 bit for bit, and training resumed at
    TP=2 takes the same step as at TP=1."""
    at_tp2 = world("tp2")["reshard_load_tp2"]  # saves b from a, and dp2 saves c from b
    assert world("dp2")["reshard_load_tp1"]["extra"] == {"layout": "tp1"}
    root = megatron_dir / "reshard"
    a, b, c = (root / x / (root / x / "latest").read_text() for x in "abc")
    assert_same_checkpoint_files(a, c)
    states = [json.loads((x / "trainer_state.json").read_text()) for x in (a, b, c)]
    assert [s["step"] for s in states] == [2, 2, 2] and [s["layout"]["tp"] for s in states] == [1, 2, 1]
    assert at_tp2["extra"] == {"layout": "tp1"}
    tp1 = torch.load(megatron_dir / "reshard_continued_tp1.pt", weights_only=True)
    tp2 = torch.load(megatron_dir / "reshard_continued_tp2.pt", weights_only=True)
    for name in tp1:
        assert torch.allclose(tp1[name], tp2[name], rtol=0, atol=1e-5), name


def test_the_distributed_optimizer_resumes_a_replicated_checkpoint_and_saves_it_bit_for_bit(world, megatron_dir):
    """DP=2 with --use-distributed-optimizer loads the TP=1 checkpoint (each rank its shard of the main
    weights and Adam's moments) and saves it again: the same files, bit for bit (so a run resumes it at
    any layout, sharded or not); and its next step is TP=1's."""
    resumed = world("dp2")["distopt_reshard"]  # saves d from a
    root = megatron_dir / "reshard"
    a, d = (root / x / (root / x / "latest").read_text() for x in "ad")
    assert_same_checkpoint_files(a, d)
    saved = json.loads((d / "trainer_state.json").read_text())
    assert saved["step"] == 2 and saved["optimizer_scalars"] == {"step": 2.0} and saved["layout"] == {"tp": 1, "dp": 2}
    assert resumed == {"step": 3, "extra": {"layout": "tp1"}}
    tp1 = torch.load(megatron_dir / "reshard_continued_tp1.pt", weights_only=True)
    sharded = torch.load(megatron_dir / "reshard_continued_distopt_dp2.pt", weights_only=True)
    for name in tp1:  # DP=2 sums the batch's gradient in two halves
        assert torch.allclose(tp1[name], sharded[name], rtol=0, atol=1e-6), name


@pytest.mark.parametrize("which,tag", [("pp2", "tp1_pp2"), ("tp2pp2sp", "tp2_pp2_sp")])
def test_pipeline_stages_load_and_save_a_tp1_checkpoint_bit_for_bit(world, megatron_dir, which, tag):
    """Two pipeline stages (at TP=1, and at TP=2 with sequence parallelism on 4 ranks) load the TP=1
    checkpoint (each its layers' weights and Adam's moments) and save it again: the same files, bit for
    bit (every stage's tensors reach rank 0, the tied embedding once), so it resumes at TP=1 x PP=1;
    and their next step is TP=1's."""
    results = world(which)
    root = megatron_dir / "reshard"
    a, p = (root / x / (root / x / "latest").read_text() for x in ("a", tag))
    assert_same_checkpoint_files(a, p)
    saved = json.loads((p / "trainer_state.json").read_text())
    tp = 2 if which == "tp2pp2sp" else 1
    assert saved["step"] == 2 and saved["layout"] == {"tp": tp, "dp": 1, "pp": 2}
    assert results["pp_reshard"] == {"step": 3, "extra": {"layout": "tp1"}}
    tp1 = torch.load(megatron_dir / "reshard_continued_tp1.pt", weights_only=True)
    staged = torch.load(megatron_dir / f"reshard_continued_{tag}.pt", weights_only=True)
    assert staged.keys() == tp1.keys()
    for name in tp1:  # TP=2 sums in another order, as at TP=2 alone (test_checkpoints_reshard_tp1_to_tp2_to_tp1)
        assert torch.allclose(tp1[name], staged[name], rtol=0, atol=1e-5 if tp == 2 else 1e-6), name
