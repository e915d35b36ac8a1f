"""LoRA's flags with miles' names (issue 71 item 1): --target-modules resolves all-linear, HF names, Megatron
names and globs to Megatron's fused layers, --exclude-modules takes layers out, and what cannot run is refused
naming the flag: part of a fused layer, a name that is no layer, no targets, dropout under TP, and what LoRA
runs do not do yet (PP, CP, EP); preflight refuses expert MLPs and a rank past a layer's width. Unit tier:
parsing, and preflight on the tiny models' configs (about 1 s)."""

import pytest

from slime_mt.assets import tiny_model_dir
from slime_mt.config.training import lora_targets
from slime_mt.config_parsing import parse_config
from slime_mt.errors import ConfigError

BASE = ["--hf-checkpoint", "m", "--prompt-data", "d.jsonl"]


@pytest.mark.parametrize(
    "targets, exclude, layers",
    [
        ("all-linear", None, ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")),
        ("q_proj,k_proj,v_proj,o_proj", None, ("linear_qkv", "linear_proj")),
        ("*_proj", None, ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")),
        ("linear_fc*", None, ("linear_fc1", "linear_fc2")),
        ("all-linear", "down_proj,gate_proj,up_proj", ("linear_qkv", "linear_proj")),
        ("all-linear", "linear_qkv", ("linear_proj", "linear_fc1", "linear_fc2")),
    ],
)
def test_target_modules_resolve_to_megatrons_layers(targets, exclude, layers):
    assert lora_targets(targets, exclude) == layers


@pytest.mark.parametrize(
    "argv, pattern",
    [
        (["--lora-rank", "8"], r"--target-modules=None: is required with --lora-rank"),
        (["--lora-rank", "8", "--target-modules", "q_proj,v_proj"], r"q_proj, k_proj, v_proj are one fused layer"),
        (["--lora-rank", "8", "--target-modules", "all-linear", "--exclude-modules", "up_proj"], r"gate_proj, up_proj"),
        (["--lora-rank", "8", "--target-modules", "qkv"], r"'qkv' names no layer an adapter can sit beside"),
        (["--lora-rank", "8", "--target-modules", "o_proj", "--exclude-modules", "o_proj"], r"leaves no layer"),
        (["--lora-rank", "-1"], r"--lora-rank=-1: must be >= 0"),
        (["--target-modules", "all-linear"], r"--target-modules='all-linear': needs --lora-rank > 0"),
        (["--lora-rank", "8", "--target-modules", "all-linear", "--lora-alpha", "0"], r"--lora-alpha=0.0: must be > 0"),
        (
            [
                "--lora-rank",
                "8",
                "--target-modules",
                "all-linear",
                "--lora-dropout",
                "0.1",
                "--tensor-model-parallel-size",
                "2",
            ],
            r"--lora-dropout=0.1: must be 0 at --tensor-model-parallel-size > 1",
        ),
        (["--lora-adapter-path", "adapter"], r"--lora-adapter-path='adapter': needs --lora-rank > 0"),
    ],
)
def test_what_lora_cannot_run_is_refused_naming_the_flag(argv, pattern):
    with pytest.raises(ConfigError, match=pattern):
        parse_config(BASE + argv)


def test_a_lora_run_parses_with_mileses_flags():
    cfg = parse_config(BASE + ["--lora-rank", "32", "--lora-alpha", "64", "--target-modules", "all-linear"])
    assert (cfg.train.lora_rank, cfg.train.lora_alpha, cfg.train.lora_dropout) == (32, 64.0, 0.0)
    assert parse_config(BASE).train.lora_rank == 0  # off by default: full-parameter training


def test_preflight_refuses_layers_the_model_lacks_and_a_rank_past_a_layers_width(tiny_paths):
    """Before anything starts: adapters on a MoE model's expert MLPs (named, with the flag that leaves
    them out) and a rank above the smallest dimension of an adapted layer."""
    from slime_mt.preflight import dry_run, preflight

    lora = ["--lora-rank", "4", "--target-modules", "all-linear"]
    moe = ["--hf-checkpoint", str(tiny_model_dir("qwen3-moe")), *lora]
    with pytest.raises(ConfigError, match=r"are experts, .* add --exclude-modules gate_proj,up_proj,down_proj"):
        preflight(parse_config(moe))
    wide = ["--hf-checkpoint", str(tiny_paths["qwen3"]), "--lora-rank", "4096", "--target-modules", "all-linear"]
    for check in (preflight, dry_run):  # --dry-run says it too
        with pytest.raises(ConfigError, match=r"--lora-rank 4096: larger than the smallest dimension of an adapted"):
            check(parse_config(wide))


def test_the_memory_plan_of_a_lora_run_with_a_kl_term_holds_no_reference_copy(tiny_paths):
    """--use-kl-loss: a full run's plan holds the reference model's weights; a LoRA run's reference is its own
    base with the adapters off, so its plan holds none."""
    from slime_mt.backends.megatron.families import decoder_spec, read_hf_config
    from slime_mt.preflight import memory_plan

    kl = ["--hf-checkpoint", str(tiny_paths["qwen3"]), "--use-kl-loss", "--kl-loss-coef", "0.01"]
    spec = decoder_spec(read_hf_config(tiny_paths["qwen3"]), "qwen3")
    full = memory_plan(parse_config(BASE + kl), spec)
    lora = memory_plan(parse_config(BASE + kl + ["--lora-rank", "4", "--target-modules", "all-linear"]), spec)
    assert "KL reference" in " ".join(full) and "KL reference" not in " ".join(lora)
