"""Issue 75 item 2: every flag slime's example scripts and model presets pass to slime's trainer (THUDM/slime
at SLIME_COMMIT: ``examples/**/*.sh``, ``examples/**/*.py`` and ``scripts/models/*.sh``, every ``--flag``
token, less those given to other commands: OTHER_COMMANDS) is taken with slime's meaning, passed to SGLang
(``--sglang-<arg>``), or refused by name with why and what to use (``config/slime_flags.py``). The flags
taken only at the value that keeps this project's math refuse any other value by name. Unit tier: parsing
only, and Megatron's LR scheduler on one tensor (about 2 s)."""

import hashlib
import shlex
from pathlib import Path

import pytest
import torch

from slime_mt.backends.megatron.model import lr_schedule, optimizer_config
from slime_mt.config import FIELDS, flag_name
from slime_mt.config.provenance import origin
from slime_mt.config.slime_flags import REFUSED
from slime_mt.config_parsing import build_parser, option_strings, parse_config
from slime_mt.errors import ConfigError
from slime_mt.preflight import slime_load

SLIME_COMMIT = "624b824a898ab0ec1fcb4d373004c7f3852bf515"

SLIME_FLAGS = [
    "--accumulate-allreduce-grads-in-fp32",
    "--actor-num-gpus-per-node",
    "--actor-num-nodes",
    "--adam-beta1",
    "--adam-beta2",
    "--add-qkv-bias",
    "--advantage-estimator",
    "--allgather-cp",
    "--apply-chat-template",
    "--apply-layernorm-1p",
    "--attention-backend",
    "--attention-dropout",
    "--attention-output-gate",
    "--attention-softmax-in-fp32",
    "--balance-data",
    "--calculate-per-token-loss",
    "--colocate",
    "--context-parallel-size",
    "--custom-config-path",
    "--custom-generate-function-path",
    "--custom-reward-post-process-path",
    "--custom-rm-path",
    "--custom-tis-function-path",
    "--custom-update-weight-post-write-path",
    "--debug-train-only",
    "--disable-bias-linear",
    "--disable-compute-advantages-and-returns",
    "--disable-wandb-random-suffix",
    "--dynamic-sampling-filter-path",
    "--enable-experimental",
    "--entropy-coef",
    "--eps-clip",
    "--eps-clip-high",
    "--eval-config",
    "--eval-input-key",
    "--eval-interval",
    "--eval-label-key",
    "--eval-max-response-len",
    "--eval-prompt-data",
    "--eval-top-k",
    "--eval-top-p",
    "--expert-model-parallel-size",
    "--expert-tensor-parallel-size",
    "--ffn-hidden-size",
    "--global-batch-size",
    "--group-query-attention",
    "--hf-checkpoint",
    "--hidden-dropout",
    "--hidden-size",
    "--input-key",
    "--kl-coef",
    "--kl-loss-coef",
    "--kl-loss-type",
    "--kv-channels",
    "--kv-lora-rank",
    "--label-key",
    "--load",
    "--log-probs-chunk-size",
    "--loss-type",
    "--lr",
    "--lr-decay-style",
    "--lr-warmup-fraction",
    "--make-vocab-size-divisible-by",
    "--max-position-embeddings",
    "--max-tokens-per-gpu",
    "--metadata-key",
    "--micro-batch-size",
    "--min-lr",
    "--moe-aux-loss-coeff",
    "--moe-enable-deepep",
    "--moe-ffn-hidden-size",
    "--moe-grouped-gemm",
    "--moe-layer-freq",
    "--moe-permute-fusion",
    "--moe-router-bias-update-rate",
    "--moe-router-dtype",
    "--moe-router-enable-expert-bias",
    "--moe-router-group-topk",
    "--moe-router-load-balancing-type",
    "--moe-router-num-groups",
    "--moe-router-pre-softmax",
    "--moe-router-score-function",
    "--moe-router-topk",
    "--moe-router-topk-scaling-factor",
    "--moe-shared-expert-gate",
    "--moe-shared-expert-intermediate-size",
    "--moe-token-dispatcher-type",
    "--moe-token-drop-policy",
    "--mscale",
    "--mscale-all-dim",
    "--mtp-num-layers",
    "--multi-latent-attention",
    "--multimodal-keys",
    "--n-samples-per-eval-prompt",
    "--n-samples-per-prompt",
    "--no-masked-softmax-fusion",
    "--no-position-embedding",
    "--no-rope-fusion",
    "--norm-epsilon",
    "--normalization",
    "--num-attention-heads",
    "--num-epoch",
    "--num-experts",
    "--num-layers",
    "--num-query-groups",
    "--num-rollout",
    "--num-steps-per-rollout",
    "--opd-kl-coef",
    "--opd-teacher-load",
    "--opd-type",
    "--optimizer",
    "--optimizer-cpu-offload",
    "--overlap-cpu-optimizer-d2h-h2d",
    "--pipeline-model-parallel-size",
    "--position-embedding-type",
    "--post-mlp-layernorm",
    "--post-self-attn-layernorm",
    "--prompt-data",
    "--q-lora-rank",
    "--qk-head-dim",
    "--qk-layernorm",
    "--qk-pos-emb-head-dim",
    "--recompute-granularity",
    "--recompute-method",
    "--recompute-num-layers",
    "--ref-load",
    "--reward-key",
    "--rm-type",
    "--rm-url",
    "--rollout-batch-size",
    "--rollout-function-path",
    "--rollout-max-context-len",
    "--rollout-max-response-len",
    "--rollout-num-gpus",
    "--rollout-num-gpus-per-engine",
    "--rollout-shuffle",
    "--rollout-stop-token-ids",
    "--rollout-temperature",
    "--rotary-base",
    "--rotary-interleaved",
    "--rotary-percent",
    "--rotary-scaling-factor",
    "--save",
    "--save-debug-rollout-data",
    "--save-interval",
    "--seq-length",
    "--sequence-parallel",
    "--sglang-cuda-graph-bs",
    "--sglang-custom-pull-weights-pre-read-hook",
    "--sglang-dp-size",
    "--sglang-enable-dp-attention",
    "--sglang-enable-dp-lm-head",
    "--sglang-ep-size",
    "--sglang-max-running-requests",
    "--sglang-mem-fraction-static",
    "--sglang-moe-dense-tp-size",
    "--sglang-reasoning-parser",
    "--sglang-server-concurrency",
    "--sglang-speculative-algorithm",
    "--sglang-speculative-eagle-topk",
    "--sglang-speculative-num-draft-tokens",
    "--sglang-speculative-num-steps",
    "--sglang-tool-call-parser",
    "--spec",
    "--swiglu",
    "--tensor-model-parallel-size",
    "--train-backend",
    "--untie-embeddings-and-output-weights",
    "--update-weight-delta-checksum",
    "--update-weight-delta-encoding",
    "--update-weight-disk-dir",
    "--update-weight-local-checkpoint-dir",
    "--update-weight-mode",
    "--update-weight-transport",
    "--use-dynamic-batch-size",
    "--use-gated-attention",
    "--use-kl-loss",
    "--use-opd",
    "--use-precision-aware-optimizer",
    "--use-rollout-logprobs",
    "--use-rope-scaling",
    "--use-rotary-position-embeddings",
    "--use-tis",
    "--use-wandb",
    "--v-head-dim",
    "--vocab-size",
    "--wandb-group",
    "--wandb-key",
    "--wandb-project",
    "--weight-decay",
]
OTHER_COMMANDS = {  # flags in those files that go to another program than slime's train.py
    "git config": ["--global", "--add"],
    "git apply and patch (coding_agent_rl/swe.py)": [
        *("--verbose", "--reject", "--whitespace", "--batch", "--fuzz", "--no-backup-if-mismatch"),
    ],
    "ray start, ray stop": [
        *("--head", "--node-ip-address", "--num-gpus", "--disable-usage-stats", "--dashboard-host"),
        *("--dashboard-port", "--temp-dir", "--force"),
    ],
    "ray job submit": ["--address", "--runtime-env-json"],
    "hf download": ["--local-dir", "--repo-type"],
    "python -m sglang.launch_server (the OPD teacher)": [
        *("--model-path", "--host", "--port", "--tp", "--mem-fraction-static", "--chunked-prefill-size"),
    ],
    "Claude Code (SLIME_AGENT_CC_EXTRA_ARGS)": ["--settings", "--disable-slash-commands", "--agents", "--disallowed"],
    "search-r1's retrieval server and download script": ["--index", "--corpus", "--topk", "--retriever", "--faiss"],
    "search-r1's download script, tau-bench's tau1_mock.py (--local_dir)": ["--repo", "--local"],
}

# slime's examples/geo3k_vlm_multi_turn/run_geo3k_vlm_multi_turn.py at SLIME_COMMIT: its train_args as the
# script builds them (SLIME_SCRIPT_NUM_GPUS=8, no W&B key), the model and data paths left to fill in
GEO3K_RECIPE = (
    "--hf-checkpoint {model} --prompt-data {data} --input-key problem --label-key answer "
    '--multimodal-keys \'{{"image": "images"}}\' --rm-type math --apply-chat-template '
    "--custom-generate-function-path examples.geo3k_vlm_multi_turn.rollout.generate "
    "--custom-config-path examples/geo3k_vlm_multi_turn/geo3k_vlm_multi_turn_config.yaml --rollout-shuffle "
    "--num-rollout 3000 --rollout-batch-size 64 --n-samples-per-prompt 8 --rollout-max-response-len 4096 "
    "--rollout-temperature 1 --global-batch-size 512 "
    "--optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98 "
    "--advantage-estimator grpo --kl-loss-coef 0.00 --kl-loss-type low_var_kl --kl-coef 0.00 --entropy-coef 0.00 "
    "--eps-clip 0.2 --eps-clip-high 0.28 "
    "--rollout-num-gpus-per-engine 8 --sglang-ep-size 8 --sglang-mem-fraction-static 0.6 "
    "--sglang-cuda-graph-bs 1 2 4 8 16 24 32 "
    "--train-backend megatron --load {model} --tensor-model-parallel-size 2 --sequence-parallel "
    "--pipeline-model-parallel-size 1 --context-parallel-size 1 --expert-model-parallel-size 8 "
    "--expert-tensor-parallel-size 1 --recompute-granularity full --recompute-method uniform "
    "--recompute-num-layers 1 --micro-batch-size 1 --attention-dropout 0.0 --hidden-dropout 0.0 "
    "--accumulate-allreduce-grads-in-fp32 --attention-softmax-in-fp32 --attention-backend flash "
    "--actor-num-nodes 1 --actor-num-gpus-per-node 8 --rollout-num-gpus 8 --colocate"
)
# slime's scripts/models/qwen2.5-0.5B.sh at SLIME_COMMIT: MODEL_ARGS
QWEN25_MODEL_ARGS = (
    "--swiglu --num-layers 24 --hidden-size 896 --ffn-hidden-size 4864 --num-attention-heads 14 "
    "--use-rotary-position-embeddings --disable-bias-linear --add-qkv-bias --normalization RMSNorm "
    "--norm-epsilon 1e-6 --rotary-base 1000000 --group-query-attention --num-query-groups 2 --vocab-size 151936"
)


def test_every_flag_of_slimes_scripts_is_taken_passed_to_sglang_or_refused_by_name():
    parser = build_parser()
    options = set(option_strings(parser))
    assert not set(SLIME_FLAGS) & {flag for flags in OTHER_COMMANDS.values() for flag in flags}
    taken = [f for f in SLIME_FLAGS if f in options]
    sglang = [f for f in SLIME_FLAGS if f not in options and f.startswith("--sglang-")]
    refused = [f for f in SLIME_FLAGS if f in REFUSED]
    assert not set(taken) & set(refused)
    assert sorted(taken + sglang + refused) == sorted(SLIME_FLAGS), set(SLIME_FLAGS) - set(taken + sglang + refused)
    assert (len(taken), len(sglang), len(refused)) == (87, 14, 89)  # the counts of docs/slime.md's table
    # the flags reference (docs/reference/flags.md) says slime has each flag taken here under slime's name
    names = {f.metadata.get("slime_flag", flag_name(name)): flag_name(name) for name, (_, f) in FIELDS.items()}
    assert [flag for flag in taken if flag in names and not origin(names[flag]).startswith("yes")] == []
    for flag in refused:  # parsing stops naming the flag with why
        with pytest.raises(ConfigError, match=f"{flag} is slime's flag, not taken here: "):
            parser.parse_args([flag])


def test_slimes_geo3k_recipe_line_parses_with_slimes_meaning(tmp_path):
    (tmp_path / "examples/geo3k_vlm_multi_turn").mkdir(parents=True)
    (tmp_path / "examples/geo3k_vlm_multi_turn/geo3k_vlm_multi_turn_config.yaml").write_text(
        "max_turns: 3\nrollout_interaction_env_path: examples.geo3k_vlm_multi_turn.env_geo3k\n"
    )
    line = GEO3K_RECIPE.format(model=tmp_path / "model", data=tmp_path / "train.parquet")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        cfg = parse_config(shlex.split(line))
    t = cfg.train
    assert (t.optimizer, t.adam_beta1, t.adam_beta2, t.lr_decay_style, t.weight_decay) == (
        "adam",
        0.9,
        0.98,
        "constant",
        0.1,
    )
    adam = optimizer_config(t, torch.float32)
    assert (adam.optimizer, adam.adam_beta1, adam.adam_beta2, adam.weight_decay) == ("adam", 0.9, 0.98, 0.1)
    assert cfg.algo.kl_coef == 0 and t.attention_backend == "flash" and t.train_backend == "megatron"
    assert cfg.engine.sglang_extra_args == "--ep-size 8 --cuda-graph-bs 1 2 4 8 16 24 32"
    assert cfg.engine.sglang_mem_fraction_static == 0.6  # this project's own flag, slime's name
    assert cfg.rollout.max_turns == 3  # from slime's config file


def test_slimes_model_preset_stops_at_parsing_naming_every_flag():
    with pytest.raises(ConfigError) as e:
        parse_config(shlex.split(QWEN25_MODEL_ARGS))
    message = str(e.value)
    for flag in [t for t in shlex.split(QWEN25_MODEL_ARGS) if t.startswith("--")]:
        assert f"{flag} is slime's flag, not taken here: part of slime's model preset" in message, flag


@pytest.mark.parametrize(
    "argv, error",
    [
        (["--optimizer", "sgd"], "--optimizer: invalid choice: 'sgd'"),
        (["--train-backend", "fsdp"], "--train-backend: invalid choice: 'fsdp'"),
        (["--kl-coef", "0.01"], "--kl-coef=0.01: a KL penalty in the reward is not implemented here"),
        (["--attention-dropout", "0.1"], "--attention-dropout=0.1: dropout is not implemented in training here"),
        (["--hidden-dropout", "0.1"], "--hidden-dropout=0.1: dropout is not implemented in training here"),
        (["--no-attention-softmax-in-fp32"], "--attention-softmax-in-fp32=False: fp32 is the only precision"),
        (["--adam-beta2", "1.0"], r"--adam-beta2=1.0: must be in \[0, 1\)"),
        (["--lr-decay-style", "WSD"], "--lr-decay-style: invalid choice: 'WSD'"),
    ],
)
def test_a_slime_flag_whose_value_would_change_the_math_is_refused_by_name(argv, error):
    with pytest.raises(ConfigError, match=error):
        parse_config(argv)


def test_slimes_names_for_this_projects_settings_are_the_same_settings():
    cfg = parse_config(["--moe-aux-loss-coeff", "0.01", "--lr-warmup-iters", "3", "--wandb-group", "geo3k"])
    assert cfg.train.moe_aux_loss_coef == 0.01 and cfg.train.lr_warmup_steps == 3
    assert cfg.checkpoint.wandb_options() == {"group": "geo3k", "key": None, "suffix": True}
    both = parse_config(
        ["--sglang-extra-args", "--log-level warning", "--sglang-dp-size=2", "--sglang-enable-dp-attention"]
    )
    assert both.engine.sglang_extra_args == "--log-level warning --dp-size=2 --enable-dp-attention"


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_lr_decay_style_runs_megatrons_schedule(style):
    """--lr-decay-style: the warm-up, then the style down to --min-lr over the run's optimizer steps."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    cfg = parse_config(["--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "2", "--lr-decay-style", style])
    optimizer = torch.optim.Adam([torch.zeros(1, requires_grad=True)], lr=1e-3)
    scheduler = OptimizerParamScheduler(optimizer, **lr_schedule(cfg.train, total_steps=12))
    lrs = []
    for _ in range(12):
        scheduler.step(1)
        lrs.append(optimizer.param_groups[0]["lr"])
    assert lrs[0] == pytest.approx(1e-3 / 2) and lrs[1] == pytest.approx(1e-3)  # the warm-up
    middle = {"constant": 1e-3, "linear": 1e-3 - 0.9e-3 * 5 / 10, "cosine": 1e-4 + 0.9e-3 * 0.5}[style]
    assert lrs[6] == pytest.approx(middle)  # half-way through the decay
    assert lrs[-1] == pytest.approx(1e-3 if style == "constant" else 1e-4)


def test_a_load_folder_with_no_checkpoint_yet_starts_from_the_hf_checkpoint_as_slimes(tmp_path):
    """slime's recipes give --load the --save folder (resume when there is something) or the
    --hf-checkpoint folder; any other --load without a checkpoint stays preflight's error."""
    save, model, other = tmp_path / "ckpt", tmp_path / "model", tmp_path / "typo"
    for load in (save, model):
        cfg = parse_config(["--hf-checkpoint", str(model), "--load", str(load), "--save", str(save)])
        assert slime_load(cfg).checkpoint.load is None
    cfg = parse_config(["--hf-checkpoint", str(model), "--load", str(other), "--save", str(save)])
    assert slime_load(cfg) is cfg
    (save / "latest").parent.mkdir()
    (save / "latest").write_text("step_1")
    cfg = parse_config(["--hf-checkpoint", str(model), "--load", str(save), "--save", str(save)])
    assert slime_load(cfg) is cfg  # there is one: resumed


UPSTREAM = Path(__file__).resolve().parents[2] / "helpers/slime_upstream/examples"
UPSTREAM_SHA256 = {  # git show SLIME_COMMIT:examples/<path> | sha256sum
    "__init__.py": "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    "geo3k_vlm_multi_turn/__init__.py": "f881a73cbc7cdaa918d655102ba2bc9953f3dfcaf28c5eb3d0586c06cc9d6b93",
    "geo3k_vlm_multi_turn/base_env.py": "e8b181793718f08a748c0d3edc0edb3c60480a8be920c6612ea7343174ecbf82",
    "geo3k_vlm_multi_turn/env_geo3k.py": "9b259e6e10f5e4a973b38e275056f73cd2cbb006b6e99a5a12f4b313a8c86066",
    "geo3k_vlm_multi_turn/geo3k_vlm_multi_turn_config.yaml": (
        "1d392a38e236aed3b932a1279a04e3009f0dd8ca2be3d44e2fa26f563379ba39"
    ),
    "geo3k_vlm_multi_turn/rollout.py": "dfb9728e8e7f117b90b69c9d71a0453e07760262129c7a4b1e20b100cc6b99d1",
}


def test_slimes_geo3k_example_files_are_byte_for_byte_slimes():
    """The files tests/e2e/test_slime_geo3k.py trains with are slime's at SLIME_COMMIT, unchanged."""
    found = {str(p.relative_to(UPSTREAM)) for p in UPSTREAM.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    assert found == set(UPSTREAM_SHA256)
    for name, digest in UPSTREAM_SHA256.items():
        assert hashlib.sha256((UPSTREAM / name).read_bytes()).hexdigest() == digest, name
