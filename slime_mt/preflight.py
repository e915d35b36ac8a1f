"""Checks before a run starts: every input, every plug-in against its contract, and ``--dry-run``'s
report; nothing is launched or written."""

from __future__ import annotations

import asyncio
import inspect
import os
from pathlib import Path

from slime_mt.backends.megatron.families import DecoderSpec, MoeOptions, check_tp, decoder_spec, read_hf_config
from slime_mt.backends.megatron.memory_plan import GIB, fitting_layout, plan_rank, vision_parameters
from slime_mt.backends.megatron.parallel import PipelineSplit, layout_name
from slime_mt.backends.megatron.vlm import check_deepstack_stage
from slime_mt.compat import install
from slime_mt.config import Config, RolloutConfig
from slime_mt.config.checkpoint import dump_path
from slime_mt.data import PromptDataset, load_rows
from slime_mt.engine.weights.fp8 import check_rollout_checkpoint
from slime_mt.errors import ConfigError, TrainSetupError
from slime_mt.inspection.replay import checked_dump
from slime_mt.plugins import judge_parser_prototype, load_function, load_module
from slime_mt.rollout.group_rollout import _expected_rollout, load_plugins
from slime_mt.safetensors_files import CheckpointReader


def preflight(cfg: Config) -> None:
    """Check every input before anything is launched or written; one clear error per problem."""
    t = cfg.train
    if not t.hf_checkpoint:
        raise ConfigError("--hf-checkpoint is required: the Hugging Face model folder to train")
    if not Path(t.hf_checkpoint).is_dir():
        raise TrainSetupError(f"--hf-checkpoint {t.hf_checkpoint}: model folder not found")
    hf_config = read_hf_config(t.hf_checkpoint)
    if hf_config.get("quantization_config") is not None:
        method = hf_config["quantization_config"].get("quant_method")
        raise TrainSetupError(
            f"--hf-checkpoint {t.hf_checkpoint} is quantized ({method}): the trainer needs full-precision weights; "
            "pass the full-precision folder, and the quantized one as --rollout-checkpoint"
        )
    check_rollout_checkpoint(cfg.engine, t.hf_checkpoint)
    spec = decoder_spec(hf_config, f"{t.hf_checkpoint}/config.json")
    check_tp(spec, t.tensor_model_parallel_size, MoeOptions.of(t))
    if t.use_rollout_routing_replay and spec.moe is None:
        raise ConfigError(f"--use-rollout-routing-replay: the {spec.family} model {t.hf_checkpoint} has no experts")
    if t.recompute_num_layers is not None and t.recompute_num_layers > spec.num_layers:
        raise ConfigError(
            f"--recompute-num-layers={t.recompute_num_layers}: the model {t.hf_checkpoint} has {spec.num_layers} layers"
        )
    split = PipelineSplit.of(t)
    try:
        split.layer_counts(spec.num_layers)
    except ValueError as e:
        raise ConfigError(f"{e} (the model {t.hf_checkpoint})") from None
    reason = check_deepstack_stage(hf_config, spec.num_layers, split)
    if reason:
        raise ConfigError(f"--pipeline-model-parallel-size={split.size}: the model {t.hf_checkpoint}: {reason}")
    if spec.moe is None and {"moe", "moe_act"} & set(t.recompute_modules or []):
        raise ConfigError(
            f"--recompute-modules {' '.join(t.recompute_modules)}: the {spec.family} model has no experts"
        )
    if not cfg.debug.debug_rollout_only:  # a rollout-only run builds no trainer
        memory_plan(cfg, spec)
    if not cfg.data.prompt_data:
        raise ConfigError("--prompt-data is required: a .jsonl or .parquet file of prompts")
    load_rows(cfg.data.prompt_data, cfg.data)
    if cfg.data.eval_prompt_data:
        load_rows(cfg.data.eval_prompt_data, cfg.data)
    check_plugins(cfg)
    d = cfg.debug
    if d.train_only and not cfg.checkpoint.load:
        first = dump_path(d.load_debug_rollout_data, 0)
        if not first.is_file():
            raise TrainSetupError(f"--load-debug-rollout-data {d.load_debug_rollout_data}: no dump of step 0 ({first})")
        checked_dump(cfg, 0)  # before a model is built: a dump of other settings stops here
    for url in [] if d.train_only else cfg.engine.engine_url or []:
        from slime_mt.engine.embedded.server import wait_healthy

        try:
            wait_healthy(url, timeout=10.0)
        except TimeoutError as e:
            raise TrainSetupError(f"--engine-url {url} does not answer: {e}") from None
    if cfg.checkpoint.load and not (Path(cfg.checkpoint.load) / "latest").is_file():
        raise TrainSetupError(f"--load {cfg.checkpoint.load}: no checkpoint there (no 'latest' file)")


def _check_compat_images(cfg: Config) -> None:
    """``--slime-compat`` hands the framework's own generate functions the rendered text prompt: with a
    dataset of images every sample would reach the engine without them (an HTTP 400 each, after the
    model loaded). Refused here, before anything starts."""
    r = cfg.rollout
    if (
        not (r.slime_compat and cfg.data.multimodal_keys)
        or r.rollout_function_path != RolloutConfig.rollout_function_path
    ):
        return
    generate = load_function(r.custom_generate_function_path)
    if (getattr(generate, "__module__", None) or "").split(".")[0] == "rollouts":
        raise TrainSetupError(
            f"--slime-compat with images (--multimodal-keys) and this project's own generate function "
            f"(--custom-generate-function-path {r.custom_generate_function_path}): under --slime-compat it gets "
            "the rendered text prompt, so the images would never reach the engine. Pass a slime-style generate "
            "function that sends them (slime's examples/geo3k_vlm_multi_turn/rollout.py with its env), or drop "
            "--slime-compat"
        )


def check_plugins(cfg: Config):
    """Import every plug-in the run names and check it against its contract -> the env module (None
    without ``--rollout-interaction-env-path``)."""
    r = cfg.rollout
    if r.slime_compat:
        install()
    load_function(r.rollout_function_path, _expected_rollout, "--rollout-function-path")
    load_plugins(r)
    _check_compat_images(cfg)
    if r.context_policy_path:
        load_function(r.context_policy_path, what="--context-policy-path")
    if cfg.judge.judge_parser_path:
        load_function(cfg.judge.judge_parser_path, judge_parser_prototype, "--judge-parser-path")
    if not r.rollout_interaction_env_path:
        return None
    module = load_module(r.rollout_interaction_env_path)
    if not callable(getattr(module, "build_env", None)):
        raise TrainSetupError(
            f"--rollout-interaction-env-path {r.rollout_interaction_env_path}: "
            "the module defines no build_env(sample=None, args=None, **kw)"
        )
    return module


# what a device needs beyond the plan: the CUDA context, NCCL's buffers, the caching allocator's slack
DEVICE_RESERVE_BYTES = 2 * GIB


def memory_plan(cfg: Config, spec: DecoderSpec) -> list[str]:
    """The memory plan of one train rank (``backends/megatron/memory_plan.py``) -> report lines; a
    plan that cannot fit ``--gpu-memory-gb`` is refused, naming a layout that fits where one does."""
    t, c = cfg.train, cfg.cluster
    tokens = t.max_tokens_per_micro_batch or t.micro_batch_size * cfg.rollout.rollout_max_context_len
    # the trainer's ranks: Ray's placement, else torchrun's world (one process: 1)
    world = c.actor_num_nodes * (c.actor_num_gpus_per_node or t.tensor_model_parallel_size) if c.ray else None
    world = world or int(os.environ.get("WORLD_SIZE", "1"))
    dp = max(1, world // (t.tensor_model_parallel_size * t.context_parallel_size * t.pipeline_model_parallel_size))
    kw = dict(
        vision=vision_parameters(CheckpointReader(t.hf_checkpoint)),
        use_reference=cfg.algo.use_kl_loss and cfg.algo.kl_loss_coef > 0,
        data_parallel=dp,
    )
    plan = plan_rank(spec, t, tokens, **kw)
    layout = layout_name(
        t.tensor_model_parallel_size,
        t.context_parallel_size,
        t.expert_model_parallel_size,
        dp,
        t.sequence_parallel,
        t.pipeline_model_parallel_size,
    )
    layout += ", distributed optimizer" if t.use_distributed_optimizer else ""
    source = (
        "--max-tokens-per-micro-batch"
        if t.max_tokens_per_micro_batch
        else "--micro-batch-size x --rollout-max-context-len"
    )
    lines = [f"memory plan of each train rank ({layout}; {tokens} tokens per micro-batch from {source}):"]
    lines += [f"  {line}" for line in plan.lines()]
    if t.gpu_memory_gb is None:
        return lines
    budget = int(t.gpu_memory_gb * GIB) - DEVICE_RESERVE_BYTES
    if plan.total > budget:
        fits = fitting_layout(spec, t, tokens, budget, **kw)
        raise ConfigError(
            f"--gpu-memory-gb {t.gpu_memory_gb:g}: the memory plan needs {plan.total / GIB:.2f} GiB per train "
            f"rank ({layout}, {tokens} tokens per micro-batch) and {DEVICE_RESERVE_BYTES / GIB:g} GiB stays for "
            "the CUDA context and the allocator; "
            + (f"{fits} fits" if fits else "lower --max-tokens-per-micro-batch or add tensor or pipeline parallelism")
        )
    return lines + [f"  fits --gpu-memory-gb {t.gpu_memory_gb:g} ({(budget - plan.total) / GIB:.2f} GiB to spare)"]


def dry_run(cfg: Config) -> list[str]:
    """What ``--dry-run`` checks beyond the settings: the memory plan of a train rank (refused over
    ``--gpu-memory-gb``), every plug-in imports and fits its contract, the first prompt row reads, and one
    environment is built from it (reset, then closed) -> report lines."""
    t, lines = cfg.train, []
    if t.hf_checkpoint and Path(t.hf_checkpoint).is_dir():
        lines += memory_plan(cfg, decoder_spec(read_hf_config(t.hf_checkpoint), f"{t.hf_checkpoint}/config.json"))
    module = check_plugins(cfg)
    lines.append("plug-ins: imported and checked")
    path = cfg.data.prompt_data
    if not path or not Path(path).is_file():
        return lines + [f"--prompt-data {path}: not there yet; no row read, no environment built"]
    rows = load_rows(path, cfg.data, limit=1)
    lines.append(f"--prompt-data {path}: row 0 read")
    if module is None:
        return lines
    sample = PromptDataset(rows, 1).get_samples(1)[0][0]

    async def build_reset_close():
        env = module.build_env(sample=sample, args=cfg.to_args())
        for method in ("reset", "close"):
            result = getattr(env, method)()
            if inspect.isawaitable(result):
                await result
        return env

    try:
        env = asyncio.run(build_reset_close())
    except Exception as e:
        raise TrainSetupError(
            f"--rollout-interaction-env-path {cfg.rollout.rollout_interaction_env_path}: building the "
            f"environment of row 0 raised {type(e).__name__}: {e}"
        ) from e
    return lines + [f"environment of row 0: {type(env).__name__} built, reset and closed"]
