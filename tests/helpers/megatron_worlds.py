"""Megatron worlds the integration tests read: the launch of ``megatron_worker.py`` (plain python at world
size 1, torchrun above), the worlds the backend tests share (tests/integration/backends/conftest.py
launches each once per session), and the cases the worker and the tests both name. Importing this
module imports neither megatron nor torch."""

import json
import subprocess
import sys
from pathlib import Path

from train_helpers import HELPERS, repo_env

DENSE_FAMILIES = ("llama", "qwen2", "qwen3", "qwen2.5-vl", "qwen3-vl")
MOE_FAMILIES = ("qwen3-moe", "qwen3-vl-moe")
FAMILIES = (*DENSE_FAMILIES, *MOE_FAMILIES)  # every supported family, tiny
ROPE_CASES = {
    "llama-linear": ("llama", {"rope_type": "linear", "factor": 4.0}),
    "llama-llama3": (
        "llama",
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "llama-yarn": ("llama", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2-yarn": ("qwen2", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen3-linear": ("qwen3", {"rope_type": "linear", "factor": 2.0}),
}
REFUSED_ROPE = {
    "llama-dynamic": ("llama", {"rope_type": "dynamic", "factor": 2.0}),
    "llama-longrope": (
        "llama",
        {
            "rope_type": "longrope",
            "short_factor": [1.0] * 8,
            "long_factor": [2.0] * 8,
            "original_max_position_embeddings": 64,
        },
    ),
}

# name: (tensor-parallel size, world size, the checks of megatron_worker.py it runs, its other
# arguments). The family checks run in two launches, the dense families and the MoE ones (``_moe``), so
# that each launch stays well within a test's time budget, as do the two TP=1 launches of each;
# reshard_load at TP=2 reads the checkpoint tp1 saved, and at DP=2 the one tp2 saved again. The
# expert-parallel worlds run the MoE families only; moe_reshard_load at EP=1 reads the checkpoint ep2
# saved.
DENSE, MOE = ["--families", "dense"], ["--families", "moe"]
WORLDS = {
    "tp1": (1, 1, "attention,tree,matrix,hf_reference,dp,logprob_chunks,reshard_save,pad_token", DENSE),
    # the MoE families at TP=1, tp1's and tp1_models' checks in one launch (about 50 s; two launches of the
    # same arguments took 32 and 28 s)
    "tp1_moe": (1, 1, "attention,tree,matrix,hf_reference,aux_loss,families,bf16,half_width_experts", MOE),
    "tp1_models": (1, 1, "families,bf16,rope,sft,engine_fidelity,checkpoint_bf16", DENSE),
    "tp2": (2, 2, "attention,tree,matrix,reshard_load,export_ranks,logprob_chunks,value_head", DENSE),
    "tp2_moe": (2, 2, "attention,tree,matrix,aux_loss", MOE),
    "dp2": (1, 2, "dp,reshard_load,distopt_reshard", []),
    "tp2dp2": (2, 4, "dp", []),
    # and LoRA on a MoE model's attention (about 8 s)
    "ep2": (1, 2, "matrix,moe_reshard_save,export_ranks,dispatchers,ep_rows,recompute,lora", ["--ep", "2"]),
    # TP=2 with sequence parallelism (SP on == off at TP=2: test_sequence_parallel.py); the 4-rank worlds
    # run it too, as TP > 1 runs do (Megatron's MoE needs it with EP and TP)
    "tp2sp": (2, 2, "matrix,lora_resume", [*DENSE, "--sp"]),  # and TP=1's LoRA checkpoints resumed
    "tp2sp_moe": (2, 2, "matrix,aux_loss", [*MOE, "--sp"]),
    "tp2ep2sp": (2, 4, "matrix,dispatchers", ["--ep", "2", "--sp"]),
    "tp2ep2_etp1": (2, 2, "matrix", ["--ep", "2", "--etp", "1"]),  # MoE parallel folding: EP over TP ranks
    "ep1_resume": (1, 1, "moe_reshard_load,ep_rows,lora", []),  # and LoRA at TP=1 (the same arguments)
    # context parallelism (the zigzag split of every row): CP=2 for every family, TP=2 x CP=2 dense
    # every family in one launch (24 and 28 s apart), and LoRA (about 8 s)
    "cp2": (1, 2, "matrix,aux_loss,lora", ["--cp", "2"]),
    "tp2cp2sp": (2, 4, "matrix", [*DENSE, "--cp", "2", "--sp"]),
    # activation recompute against none: a text and a VLM of each kind at TP=1 and TP=2, MoE at EP=2 (in
    # ep2's launch); at TP=1 beside two of the trainer's state checks (offload, the fp32 checkpoint), which
    # kept tp1 and tp1_models past their budget on a busy machine (139 and 137 s in the CI of 2026-12-03, 84
    # and 74 s alone)
    "tp1_state": (1, 1, "recompute,offload,checkpoint", []),
    # recompute under TP with sequence parallelism, as run, and the offload at TP=2 (tp2 took 109 s in that CI)
    "tp2_state": (2, 2, "recompute,offload,lora", ["--sp"]),
    # pipeline parallelism: two stages through Megatron's 1F1B schedule against the whole decoder, the
    # actor at PP=2 against TP=1's matrix run, what PP does not run with yet, and TP=1's checkpoint
    # loaded into two stages and saved again, and LoRA over two stages (a step, and TP=1's LoRA checkpoints
    # resumed: about 15 s)
    "pp2": (1, 2, "pipeline,pp_matrix,pp_refusals,pp_reshard,aux_loss,lora,lora_resume", ["--pp", "2"]),
    "tp2pp2sp": (2, 4, "pp_matrix,pp_reshard", ["--pp", "2", "--sp"]),  # TP=2 x PP=2 on 4 ranks, SP as TP runs
    # EP=2 x PP=2 on 4 ranks (DP=2, the experts split over each stage's two DP ranks): the MoE matrix, and
    # ranks packing different numbers of rows (idle micro-batches through the schedule)
    "ep2pp2": (1, 4, "pp_matrix,ep_rows,aux_loss", [*MOE, "--ep", "2", "--pp", "2"]),
}


def launch(tp: int, world: int, checks: str, out: Path, name: str, *extra: str, timeout: int = 1500) -> dict:
    """Run ``checks`` in a world of ``world`` processes at TP=``tp`` writing to ``out``; the results the
    worker wrote (``out/results_NAME.json``)."""
    worker = [str(HELPERS / "megatron_worker.py")]
    if world > 1:
        # --standalone: the rendezvous binds a free port itself (a port picked here first may be taken
        # by another worker's server before torchrun binds it)
        worker = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)]
        worker += [str(HELPERS / "megatron_worker.py")]
    cmd = [sys.executable, *worker, "--tp", str(tp), "--checks", checks, "--out", str(out), "--name", name, *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=repo_env(), timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads((out / f"results_{name}.json").read_text())


def launch_world(name: str, out: Path) -> dict:
    """One of ``WORLDS``, its results written under ``out``."""
    tp, world, checks, extra = WORLDS[name]
    return launch(tp, world, checks, out, name, *extra)


# worlds whose MoE checks run in another world's launch (of the same arguments)
MOE_LAUNCH = {"tp1_models": "tp1_moe"}


def world_name(name: str, kind: str) -> str:
    """The world whose ``name`` checks ran ``kind`` (the MoE families have their own launches)."""
    if kind not in MOE_FAMILIES:
        return name
    name = MOE_LAUNCH.get(name, name)
    return f"{name}_moe" if f"{name}_moe" in WORLDS else name


def rel(a, b) -> float:
    """Relative Frobenius difference ||a - b|| / ||b|| of two tensors."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


# Gradients under another layout are judged at each tensor's own scale: float32 sums taken in another order
# (another layout's reductions, another machine's threads) differ by tens of units in the last place of the
# sum, so a gradient matches when every element is within ULPS float32 ulps of its largest element's
# magnitude (max |got - want| <= ULPS * 2^-23 * max |want|); an absolute bound is too tight for large
# tensors (an embedding's gradient, max 0.35: 1.2e-6 apart on some machines against 1e-6) and too loose
# for small ones. Weights after an Adam step are judged in units of the learning rate instead: Adam turns
# a gradient that is noise around zero (a key bias's, which softmax ignores) into an lr-sized step of
# either sign.
ULPS = 256
FP32_EPS = 2.0**-23


def assert_close(got, want, what: str = "", ulps: float = ULPS) -> None:
    """``got`` equals ``want`` within ``ulps`` float32 ulps of ``want``'s largest magnitude (a zero tensor
    equals only zeros, to 1e-12)."""
    diff = float((got.double() - want.double()).abs().max()) if want.numel() else 0.0
    bound = max(ulps * FP32_EPS * float(want.abs().max()) if want.numel() else 0.0, 1e-12)
    assert diff <= bound, f"{what}: {diff:.3g} apart, {diff / bound * ulps:.0f} ulps of its scale (at most {ulps})"
