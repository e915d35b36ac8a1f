"""Checks before a run starts: every input, every plug-in against its contract, and ``--dry-run``'s
report; nothing is launched or written."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import os
import sys
from pathlib import Path

from slime_mt.backends.megatron.checkpoint import read_latest
from slime_mt.backends.megatron.families import DecoderSpec, MoeOptions, check_tp, decoder_spec, read_hf_config
from slime_mt.backends.megatron.lora import LoraOptions, check_targets
from slime_mt.backends.megatron.memory_plan import GIB, fitting_layout, plan_rank, vision_parameters
from slime_mt.backends.megatron.parallel import PipelineSplit, layout_name
from slime_mt.backends.megatron.peft import check_adapter
from slime_mt.backends.megatron.vlm import check_deepstack_stage
from slime_mt.compat import install
from slime_mt.config import Config, RolloutConfig, eval_datasets
from slime_mt.config.checkpoint import dump_path
from slime_mt.config.training import reference_copy
from slime_mt.data import PromptDataset, load_rows
from slime_mt.engine.weights.fp8 import check_rollout_checkpoint
from slime_mt.errors import ConfigError, TrainSetupError
from slime_mt.inspection.replay import checked_dump
from slime_mt.plugins import judge_parser_prototype, load_function, load_module
from slime_mt.processing import has_chat_template
from slime_mt.rollout.evaluation import load_eval_sets
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
    check_lora(t, spec)
    if not cfg.debug.debug_rollout_only:  # a rollout-only run builds no trainer
        memory_plan(cfg, spec)
    if not cfg.data.prompt_data:
        raise ConfigError("--prompt-data is required: a .jsonl or .parquet file of prompts")
    rows = load_rows(cfg.data.prompt_data, cfg.data)
    rows += [row for es in load_eval_sets(cfg) for row in es.rows.rows]  # a bad row names its dataset
    check_chat_template(cfg, rows)
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


def slime_load(cfg: Config) -> Config:
    """slime's ``--load`` of a folder that holds no checkpoint yet, where slime's recipes point it (the
    ``--save`` folder, to resume when there is something to resume, or the ``--hf-checkpoint`` folder):
    the run starts from ``--hf-checkpoint``, as slime's does. Any other ``--load`` without a checkpoint
    stays an error (preflight names it)."""
    c = cfg.checkpoint
    if not c.load or (Path(c.load) / "latest").is_file():
        return cfg
    same = {os.path.realpath(p) for p in (c.save, cfg.train.hf_checkpoint) if p}
    if os.path.realpath(c.load) not in same:
        return cfg
    print(f"slime-mt train: --load {c.load} holds no checkpoint yet: starting from --hf-checkpoint", file=sys.stderr)
    return dataclasses.replace(cfg, checkpoint=dataclasses.replace(c, load=None))


def finished_run(cfg: Config) -> str | None:
    """``--load`` of a run whose checkpoint is already at ``--num-rollout`` steps -> the line that says so
    (None: there are steps to train). Such a run is not started, so a scheduler that requeues a job with
    its ``--load`` finds it done, not failed."""
    load = cfg.checkpoint.load
    if not load or cfg.debug.debug_rollout_only:
        return None
    folder = read_latest(Path(load))
    try:
        step = int(json.loads((folder / "trainer_state.json").read_text())["extra"]["rollout_step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # loading it names what is wrong with it
    total = cfg.rollout.num_rollout
    if step < total:
        return None
    return (
        f"--load {load}: the run is finished ({folder.name} is after step {step}, --num-rollout {total}); "
        f"nothing to train. Raise --num-rollout to train on from step {step}"
    )


def check_chat_template(cfg: Config, rows) -> None:
    """A run that renders prompts with a chat template (``--apply-chat-template``, or rows whose prompt is
    a list of messages) needs one: the model folder's or ``--chat-template``'s."""
    d, model = cfg.data, cfg.train.hf_checkpoint
    if d.chat_template:
        if not Path(d.chat_template).is_file():
            raise ConfigError(f"--chat-template {d.chat_template}: file not found")
        return
    messages = next((row.where for row in rows if not isinstance(row.prompt, str)), None)
    if not (d.apply_chat_template or messages is not None) or has_chat_template(model):
        return
    why = "--apply-chat-template" if d.apply_chat_template else f"the prompt of {messages} is chat messages"
    raise ConfigError(
        f"--hf-checkpoint {model} has no chat template (no chat_template.jinja, none in tokenizer_config.json) "
        f"and the prompts are rendered with one ({why}): pass a Jinja template with --chat-template FILE, "
        "or train on text prompts as they are with --no-apply-chat-template"
    )


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
    if cfg.evaluation.eval_function_path:
        load_function(cfg.evaluation.eval_function_path, _expected_rollout, "--eval-function-path")
    for d in eval_datasets(cfg):  # a dataset's own generate or reward function
        load_plugins(d.rollout_config(r), evaluation=True)
    _check_compat_images(cfg)
    if r.context_policy_path:
        load_function(r.context_policy_path, what="--context-policy-path")
    if cfg.judge.judge_parser_path:
        load_function(cfg.judge.judge_parser_path, judge_parser_prototype, "--judge-parser-path")
    if not r.rollout_interaction_env_path:
        return None
    module = load_module(r.rollout_interaction_env_path)
    build_env = getattr(module, "build_env", None)
    where = f"--rollout-interaction-env-path {r.rollout_interaction_env_path}"
    if not callable(build_env):
        raise TrainSetupError(f"{where}: the module defines no build_env(sample=None, args=None, **kw)")
    try:  # the rollout calls build_env(sample=..., args=...) (rollout/context.py, rollout/env_workers.py)
        inspect.signature(build_env).bind(sample=None, args=None)
    except TypeError as e:
        raise TrainSetupError(
            f"{where}: build_env{inspect.signature(build_env)} cannot be called as build_env(sample=..., "
            f"args=...) ({e}); define it as build_env(sample=None, args=None, **kw)"
        ) from None
    except ValueError:  # a callable without a signature (a builtin): called as it comes
        pass
    return module


def trainer_ranks(cfg: Config) -> tuple[int, str]:
    """The run's trainer ranks and where the number comes from: slime's ``--actor-num-nodes`` x
    ``--actor-num-gpus-per-node`` when given (or under ``--ray``), else torchrun's ``WORLD_SIZE``, else
    one process. Under torchrun the flags, when given, must agree with its world."""
    t, c = cfg.train, cfg.cluster
    launched = os.environ.get("WORLD_SIZE")
    if c.ray or c.actor_num_gpus_per_node is not None:
        per_node = c.actor_num_gpus_per_node or t.tensor_model_parallel_size
        world = c.actor_num_nodes * per_node
        if launched is not None and not c.ray and int(launched) != world:
            raise ConfigError(
                f"--actor-num-nodes {c.actor_num_nodes} x --actor-num-gpus-per-node {per_node} = {world} trainer "
                f"ranks, but torchrun started {launched} (WORLD_SIZE); make them agree"
            )
        return world, f"--actor-num-nodes {c.actor_num_nodes} x --actor-num-gpus-per-node {per_node}"
    if launched is not None:
        return int(launched), "torchrun's WORLD_SIZE"
    return 1, "one process (--actor-num-nodes x --actor-num-gpus-per-node give more)"


# what a device needs beyond the plan: the CUDA context, NCCL's buffers, the caching allocator's slack
DEVICE_RESERVE_BYTES = 2 * GIB


def memory_plan(cfg: Config, spec: DecoderSpec) -> list[str]:
    """The memory plan of one train rank (``backends/megatron/memory_plan.py``) -> report lines; a
    plan that cannot fit ``--gpu-memory-gb`` is refused, naming a layout that fits where one does."""
    t = cfg.train
    tokens = t.max_tokens_per_micro_batch or t.micro_batch_size * cfg.rollout.rollout_max_context_len
    world, ranks_from = trainer_ranks(cfg)
    dp = max(1, world // (t.tensor_model_parallel_size * t.context_parallel_size * t.pipeline_model_parallel_size))
    kw = dict(
        vision=vision_parameters(CheckpointReader(t.hf_checkpoint)),
        use_reference=reference_copy(t, cfg.algo),  # a LoRA run's reference is its own base: no copy
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
    lines += [
        f"  {world} train rank{'s' if world > 1 else ''} from {ranks_from}; log-probs planned for every token of a "
        "micro-batch scored (the most: fewer with long prompts)",
        "  tensors as a device's allocator holds them (on CPU: glibc's malloc mapping each on its own, "
        "MALLOC_MMAP_THRESHOLD_=65536; its default keeps freed memory); a device also needs its CUDA context "
        f"and the allocator's slack ({DEVICE_RESERVE_BYTES / GIB:g} GiB kept with --gpu-memory-gb)",
    ]
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


def check_lora(t, spec: DecoderSpec) -> None:
    """``--lora-rank`` against the model (``t``: the TrainConfig): layers it lacks, a rank too large, an
    adapter (``--lora-adapter-path``) of other flags or another base model; ConfigError or CheckpointError."""
    if not t.lora_rank:
        return
    options = LoraOptions.of(t)
    check_targets(spec, options, t.hf_checkpoint)
    if t.lora_adapter_path:
        check_adapter(t.lora_adapter_path, spec, options.targets, options.rank, options.alpha)


def dry_run(cfg: Config) -> tuple[list[str], list[str]]:
    """What ``--dry-run`` checks beyond the settings -> (the memory plan of a train rank, refused over
    ``--gpu-memory-gb``; the checks: every plug-in imports and fits its contract, the first prompt row
    reads, and one environment is built from it, reset, then closed), as report lines."""
    t, plan = cfg.train, []
    if t.hf_checkpoint and Path(t.hf_checkpoint).is_dir():
        spec = decoder_spec(read_hf_config(t.hf_checkpoint), f"{t.hf_checkpoint}/config.json")
        check_lora(t, spec)
        plan = memory_plan(cfg, spec)
    return plan, _dry_run_checks(cfg)


def _dry_run_checks(cfg: Config) -> list[str]:
    """The plug-ins, the first prompt row and one environment, checked -> report lines."""
    lines = []
    module = check_plugins(cfg)
    lines.append("plug-ins: imported and checked")
    path = cfg.data.prompt_data
    if not path or not Path(path).is_file():
        return lines + [f"--prompt-data {path}: not there yet; no row read, no environment built"]
    rows = load_rows(path, cfg.data, limit=1)
    lines.append(f"--prompt-data {path}: first row read")
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
            f"environment of the first row raised {type(e).__name__}: {e}"
        ) from e
    return lines + [f"environment of the first row: {type(env).__name__} built, reset and closed"]
