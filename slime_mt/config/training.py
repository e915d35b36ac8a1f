"""The training options (``TrainConfig``: the Megatron model's checkpoint, parallelism, batch sizes,
optimizer, recompute) and their rules: the layouts that run together, Megatron's recompute rules, and
batch sizes that split the rollout's samples into whole prompt groups."""

from __future__ import annotations

from dataclasses import dataclass

from slime_mt.config.fields import group, option, positive, require

RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm", "moe", "moe_act")  # Megatron's, for these families


@group("train")
@dataclass
class TrainConfig:
    """The Megatron policy: checkpoint, parallelism, batch sizes, optimizer."""

    hf_checkpoint: str | None = option(None, "Hugging Face model folder (weights, config, tokenizer).")
    tensor_model_parallel_size: int = option(1, "Tensor parallel size.")
    expert_model_parallel_size: int = option(
        1, "MoE: expert parallel size (experts split over this many data-parallel ranks)."
    )
    expert_tensor_parallel_size: int | None = option(
        None, "MoE: tensor parallel size inside each expert (default: --tensor-model-parallel-size)."
    )
    moe_token_dispatcher_type: str = option(
        "alltoall", "MoE: how tokens reach their experts' ranks.", choices=["alltoall", "allgather"]
    )
    moe_aux_loss_coef: float = option(
        0.0, "MoE: coefficient of the router's load-balancing loss (0: none).", slime_flag="--moe-aux-loss-coeff"
    )
    moe_router_load_balancing_type: str = option(
        "aux_loss",
        "MoE: the load-balancing loss (aux_loss per micro-batch, seq_aux_loss per sequence, none).",
        choices=["aux_loss", "seq_aux_loss", "none"],
    )
    use_rollout_routing_replay: bool = option(
        False,
        "MoE (R3): the engines return the experts they routed every token to, and training replays those "
        "routes in every MoE layer (slime's flag).",
    )
    log_routing_replay_gap: bool = option(False, "R3: also log the log-prob gap without replay (one more forward).")
    context_parallel_size: int = option(1, "Ranks each packed row is split over (zigzag; the fused attention).")
    pipeline_model_parallel_size: int = option(
        1,
        "Pipeline stages the decoder's layers are split over (Megatron's split and 1F1B schedule; a VLM's "
        "vision tower on the first; not yet with CP or shared-prefix training).",
    )
    decoder_first_pipeline_num_layers: int | None = option(
        None,
        "Pipeline parallelism: layers on the first stage (it also holds the embedding); the others split "
        "evenly over the stages between (Megatron's uneven split).",
    )
    decoder_last_pipeline_num_layers: int | None = option(
        None, "Pipeline parallelism: layers on the last stage (it also holds the output layer and the loss)."
    )
    sequence_parallel: bool = option(
        False,
        "Megatron's sequence parallelism: under TP, norms and the residual stream hold 1/TP of the row's "
        "tokens on each TP rank (off at TP=1, as Megatron's).",
    )
    recompute_granularity: str | None = option(None, "Activation recompute.", choices=["full", "selective"])
    recompute_method: str | None = option(None, "Full recompute: which layers.", choices=["uniform", "block"])
    recompute_num_layers: int | None = option(None, "Full recompute: layers per chunk (uniform) or recomputed (block).")
    recompute_modules: list[str] | None = option(None, "Selective recompute: what (default core_attn).", nargs="+")
    global_batch_size: int = option(256, "Samples per optimizer step (whole prompt groups).")
    micro_batch_size: int = option(1, "Samples per forward/backward pass.")
    max_tokens_per_micro_batch: int | None = option(
        None, "Token budget of a packed micro-batch (a packed row, before context parallelism splits it)."
    )
    use_dynamic_batch_size: bool = option(
        False,
        "slime's flag: pack micro-batches by tokens, --max-tokens-per-gpu on each device, so a packed row holds "
        "--max-tokens-per-gpu x --context-parallel-size (that is --max-tokens-per-micro-batch, set from it).",
    )
    max_tokens_per_gpu: int | None = option(
        None, "slime's flag: with --use-dynamic-batch-size, the tokens of a micro-batch on one device."
    )
    gpu_memory_gb: float | None = option(None, "Memory of one device: refuse a run whose memory plan cannot fit it.")
    use_distributed_optimizer: bool = option(
        False, "Shard the optimizer state and fp32 main weights over the data-parallel (x CP) ranks (ZeRO-1)."
    )
    lr: float = option(1e-6, "Learning rate.")
    min_lr: float = option(0.0, "Final learning rate of the decay schedule.")
    lr_warmup_steps: int = option(0, "Linear warm-up steps.", slime_flag="--lr-warmup-iters")
    weight_decay: float = option(0.0, "AdamW weight decay.")
    optimizer: str = option("adam", "slime's flag: the optimizer, Adam with decoupled weight decay.", choices=["adam"])
    adam_beta1: float = option(0.9, "slime's flag: Adam's beta1.")
    adam_beta2: float = option(0.98, "slime's flag: Adam's beta2.")
    lr_decay_style: str | None = option(
        None,
        "slime's flag: the LR after warm-up, from --lr down to --min-lr over the run's optimizer steps "
        "(Megatron's schedules); none: cosine when 0 < --min-lr < --lr, else constant.",
        choices=["constant", "linear", "cosine", "inverse-square-root"],
    )
    train_backend: str = option("megatron", "slime's flag: the trainer (Megatron-core here).", choices=["megatron"])
    attention_dropout: float = option(0.0, "slime's flag (Megatron's): dropout is off in training here: 0 only.")
    hidden_dropout: float = option(0.0, "slime's flag (Megatron's): dropout is off in training here: 0 only.")
    accumulate_allreduce_grads_in_fp32: bool = option(
        True, "slime's flag (Megatron's): gradients are reduced in fp32 here, always."
    )
    attention_softmax_in_fp32: bool = option(True, "slime's flag (Megatron's): the attention softmax is fp32 here.")
    attention_backend: str = option(
        "auto",
        "slime's flag (Megatron's): a kernel choice, the same math; here --transformer-impl and "
        "--local-attention pick the attention, and this is recorded only.",
        choices=["auto", "flash", "fused", "unfused", "local"],
    )
    clip_grad: float = option(1.0, "Gradient norm clip.")
    seed: int = option(1234, "Seed of model init, dropout and Megatron RNG.")
    freeze_vision_tower: bool = option(True, "VLMs: keep the vision tower frozen.")
    lora_rank: int = option(0, "LoRA: the adapters' rank (0: off, full-parameter training); the base stays frozen.")
    lora_alpha: float = option(16.0, "LoRA: the adapters' scaling factor (the update is alpha / rank x B A x).")
    lora_dropout: float = option(0.0, "LoRA: dropout on the adapters' input (RL recipes use 0).")
    target_modules: str | None = option(
        None,
        "LoRA: the layers that get adapters, comma-separated: all-linear (the attention and MLP projections), "
        "HF names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj), Megatron names (linear_qkv, "
        "linear_proj, linear_fc1, linear_fc2) or globs of either; required with --lora-rank.",
    )
    exclude_modules: str | None = option(
        None, "LoRA: layers taken out of --target-modules, named as there (comma-separated)."
    )
    lora_adapter_path: str | None = option(
        None,
        "LoRA: start from this PEFT adapter folder (a LoRA run's checkpoint, or peft's save_pretrained with "
        "q/k/v and gate/up sharing A): its weights only, at step 0; --load resumes a run instead.",
    )
    sft: bool = option(False, "Train with the supervised loss on loss-masked tokens.")
    bf16: bool = option(False, "bf16 parameters and activations, fp32 main parameters, gradients and log-softmax.")
    shared_prefix_training: bool = option(
        False,
        "Pack each micro-batch as a prefix tree: tokens shared by its sequences (a GRPO group's prompt, "
        "step-wise histories) are computed once (text models, --local-attention fused, no Transformer Engine).",
    )
    transformer_impl: str = option(
        "transformer_engine",
        "Megatron's layers: Transformer Engine's when it imports (GPU), or local (needed for CP on a TE machine).",
        choices=["transformer_engine", "local"],
    )
    local_attention: str = option(
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


# Megatron's parallel linear layers an adapter can sit beside, and the HF projections each one fuses
LORA_LAYERS = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}


def _lora_layers(names: str | None, flag: str) -> set[str]:
    """The Megatron layers a comma-separated list of names or globs (HF or Megatron, or all-linear) picks;
    naming part of a fused layer (q_proj without k_proj and v_proj) is an error naming ``flag``."""
    from fnmatch import fnmatchcase

    projections = {p: layer for layer, hf in LORA_LAYERS.items() for p in hf}
    picked: set[str] = set()
    named: set[str] = set()
    for item in filter(None, (n.strip() for n in (names or "").split(","))):
        if item == "all-linear":
            picked |= set(LORA_LAYERS)
            continue
        layers = {layer for layer in LORA_LAYERS if fnmatchcase(layer, item)}
        hf = {p for p in projections if fnmatchcase(p, item)}
        known = ", ".join(["all-linear", *LORA_LAYERS, *projections])
        require(bool(layers or hf), flag, names, f"{item!r} names no layer an adapter can sit beside ({known})")
        picked |= layers
        named |= hf
    for layer, hf in LORA_LAYERS.items():
        if named & set(hf):
            fused = ", ".join(hf)
            require(
                set(hf) <= named, flag, names, f"{fused} are one fused layer in Megatron ({layer}): name all or none"
            )
            picked.add(layer)
    return picked


def lora_targets(target_modules: str | None, exclude_modules: str | None) -> tuple[str, ...]:
    """The Megatron layers that get adapters: ``--target-modules`` less ``--exclude-modules``, in layer order."""
    targets = _lora_layers(target_modules, "target_modules") - _lora_layers(exclude_modules, "exclude_modules")
    return tuple(layer for layer in LORA_LAYERS if layer in targets)


POLICY_ADAPTER = "policy"  # the name the engines serve a LoRA run's adapter under (lora_path)


# the ranks vLLM's --max-lora-rank takes (vllm/config/lora.py: MaxLoRARanks); it serves an adapter of any rank
# up to the one it was started with
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def adapter_updates(cfg) -> bool:
    """Whether a LoRA run's weight updates send the engines only its adapter, which they serve by name
    (``POLICY_ADAPTER``) on their base weights: embedded, SGLang and vLLM engines over the in-process or disk
    transport (under ``--ray``, ``--weight-transport disk``: its ``auto`` is the broadcast). The broadcast
    transports take the merged weights (``W + scale B A``)."""
    chosen = cfg.engine.weight_transport
    transport = chosen in ("inprocess", "disk") or (chosen == "auto" and not cfg.cluster.ray)
    return bool(cfg.train.lora_rank) and cfg.engine.engine in ("local", "sglang", "vllm") and transport


def reference_copy(train, algo) -> bool:
    """Whether the KL term needs a frozen copy of the starting weights: a LoRA run's reference is its own
    base (the policy with its adapters off), so it needs none."""
    return algo.kl_term and not train.lora_rank


def _validate_lora(t) -> None:
    """LoRA's flags: a rank of 0 (off) or more with the layers named, a positive alpha, dropout in [0, 1)
    and none under TP (the replicated factor's input would be dropped differently on each rank)."""
    require(t.lora_rank >= 0, "lora_rank", t.lora_rank, "must be >= 0 (0: no adapters)")
    if not t.lora_rank:
        for key in ("target_modules", "exclude_modules", "lora_adapter_path"):
            require(getattr(t, key) is None, key, getattr(t, key), "needs --lora-rank > 0")
        return
    require(
        t.target_modules is not None,
        "target_modules",
        None,
        "is required with --lora-rank (all-linear: every projection)",
    )
    require(t.lora_alpha > 0, "lora_alpha", t.lora_alpha, "must be > 0")
    require(0 <= t.lora_dropout < 1, "lora_dropout", t.lora_dropout, "must be in [0, 1)")
    require(
        t.lora_dropout == 0 or t.tensor_model_parallel_size == 1,
        "lora_dropout",
        t.lora_dropout,
        "must be 0 at --tensor-model-parallel-size > 1 (each rank would drop the shared input differently)",
    )
    require(
        bool(lora_targets(t.target_modules, t.exclude_modules)),
        "exclude_modules",
        t.exclude_modules,
        "leaves no layer to adapt",
    )


def validate_training(cfg) -> None:
    """The parallel layout, recompute, routing replay, the optimizer, LoRA and the batch sizes."""
    t, r = cfg.train, cfg.rollout
    _validate_lora(t)
    if cfg.engine.engine == "vllm" and adapter_updates(cfg):  # vLLM serves the adapter
        require(
            t.lora_rank <= VLLM_LORA_RANKS[-1],
            "lora_rank",
            t.lora_rank,
            f"vLLM serves adapters of rank up to {VLLM_LORA_RANKS[-1]} (--engine vllm)",
        )
    _validate_routing_replay(cfg)
    _validate_recompute(t)
    _validate_context_parallel(t)
    _validate_pipeline_parallel(t)
    _validate_sequence_parallel(t)
    parallel = ("tensor_model_parallel_size", "context_parallel_size", "pipeline_model_parallel_size")
    positive(t, (*parallel, "expert_model_parallel_size", "global_batch_size", "micro_batch_size"))
    positive(t, ("max_tokens_per_micro_batch", "expert_tensor_parallel_size", "max_tokens_per_gpu"), optional=True)
    _dynamic_batch_size(t)
    require(t.moe_aux_loss_coef >= 0, "moe_aux_loss_coef", t.moe_aux_loss_coef, "must be >= 0")
    require(t.gpu_memory_gb is None or t.gpu_memory_gb > 0, "gpu_memory_gb", t.gpu_memory_gb, "must be > 0")
    require(t.lr > 0, "lr", t.lr, "must be > 0")
    _slime_optimizer_flags(t)
    samples = r.rollout_batch_size * r.n_samples_per_prompt
    require(
        samples % t.global_batch_size == 0,
        "global_batch_size",
        t.global_batch_size,
        f"must divide --rollout-batch-size x --n-samples-per-prompt = {samples}",
    )
    require(
        t.global_batch_size % r.n_samples_per_prompt == 0,
        "global_batch_size",
        t.global_batch_size,
        f"must be a multiple of --n-samples-per-prompt={r.n_samples_per_prompt} "
        "(optimizer steps take whole prompt groups)",
    )
    require(
        t.global_batch_size % t.micro_batch_size == 0,
        "global_batch_size",
        t.global_batch_size,
        f"must be a multiple of --micro-batch-size={t.micro_batch_size}",
    )


def _validate_routing_replay(cfg) -> None:
    """``--use-rollout-routing-replay`` needs engines that return routes and contexts whose tokens are
    the trajectory's own (routes are kept per trajectory token)."""
    if not cfg.train.use_rollout_routing_replay:
        require(
            not cfg.train.log_routing_replay_gap,
            "log_routing_replay_gap",
            True,
            "compares training with and without replay: it needs --use-rollout-routing-replay",
        )
        return
    r, flag = cfg.rollout, "use_rollout_routing_replay"
    require(cfg.engine.engine != "vllm", flag, True, "needs an engine that returns routed experts; vLLM's does not")
    require(
        r.context_policy == "append" and not r.context_policy_path and not r.retokenize_chat_history,
        flag,
        True,
        "keeps routes per trajectory token: a context policy or --retokenize-chat-history rewrites what the "
        "model saw; use the append-only context",
    )
    require(
        not cfg.train.shared_prefix_training,
        flag,
        True,
        "does not replay into a prefix tree yet: leave out --shared-prefix-training",
    )


def _validate_context_parallel(t) -> None:
    """Context parallelism runs in the fused local attention, on flat packed rows."""
    if t.context_parallel_size <= 1:
        return
    flag, cp = "context_parallel_size", t.context_parallel_size
    require(t.local_attention == "fused", flag, cp, "needs --local-attention fused (Megatron's attention has no CP)")
    require(
        not t.shared_prefix_training, flag, cp, "does not split prefix trees yet: leave out --shared-prefix-training"
    )


def _validate_pipeline_parallel(t) -> None:
    """Pipeline parallelism runs the text decoder's stages on flat packed rows (the actor refuses a
    vision-language model, which this check cannot see)."""
    pp = t.pipeline_model_parallel_size
    for key in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"):
        value = getattr(t, key)
        if value is not None:
            require(pp > 1, key, value, "splits pipeline stages: needs --pipeline-model-parallel-size above 1")
            require(value >= 1, key, value, "every pipeline stage holds at least one layer")
    if pp <= 1:
        return
    flag = "pipeline_model_parallel_size"
    require(t.context_parallel_size == 1, flag, pp, "does not run with --context-parallel-size above 1 yet")
    require(not t.shared_prefix_training, flag, pp, "does not run prefix trees yet: no --shared-prefix-training")
    require(
        not (t.moe_aux_loss_coef > 0 and t.recomputes_moe),
        flag,
        pp,
        "does not run the load-balancing loss (--moe-aux-loss-coef) in recomputed MoE layers yet",
    )
    require(
        not (t.use_rollout_routing_replay and t.recomputes_moe),
        flag,
        pp,
        "does not replay routes (--use-rollout-routing-replay) in recomputed MoE layers yet",
    )


def _validate_sequence_parallel(t) -> None:
    """Sequence parallelism splits flat packed rows over the TP ranks."""
    if t.sequence_parallel and t.tensor_model_parallel_size > 1:
        require(
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
            require(getattr(t, key) is None, key, getattr(t, key), "needs --recompute-granularity full|selective")
        return
    if t.recompute_granularity == "full":
        require(t.recompute_method is not None, "recompute_method", None, "full recompute needs uniform or block")
        n = t.recompute_num_layers
        require(n is not None and n > 0, "recompute_num_layers", n, "full recompute needs a positive layer count")
        require(t.recompute_modules is None, "recompute_modules", t.recompute_modules, "is for selective recompute")
        return
    for key in ("recompute_method", "recompute_num_layers"):
        require(
            getattr(t, key) is None, key, getattr(t, key), "is for full recompute; selective takes --recompute-modules"
        )
    for module in t.recompute_modules or []:
        require(
            module in RECOMPUTE_MODULES,
            "recompute_modules",
            t.recompute_modules,
            f"{module!r} is not one of {', '.join(RECOMPUTE_MODULES)}",
        )


def _dynamic_batch_size(t) -> None:
    """slime's ``--use-dynamic-batch-size --max-tokens-per-gpu N``: packed rows of N x CP tokens (slime packs
    ``max_tokens_per_gpu * cp_size`` per micro-batch), set as ``--max-tokens-per-micro-batch``."""
    if not t.use_dynamic_batch_size:
        require(
            t.max_tokens_per_gpu is None,
            "max_tokens_per_gpu",
            t.max_tokens_per_gpu,
            "packs by tokens only with --use-dynamic-batch-size (as in slime), or give --max-tokens-per-micro-batch",
        )
        return
    require(
        t.max_tokens_per_gpu is not None,
        "use_dynamic_batch_size",
        True,
        "needs --max-tokens-per-gpu, the tokens of a micro-batch on one device (as in slime)",
    )
    budget = t.max_tokens_per_gpu * t.context_parallel_size
    require(
        t.max_tokens_per_micro_batch in (None, budget),
        "max_tokens_per_micro_batch",
        t.max_tokens_per_micro_batch,
        f"disagrees with --max-tokens-per-gpu {t.max_tokens_per_gpu} x --context-parallel-size "
        f"{t.context_parallel_size} = {budget} (--use-dynamic-batch-size); give one of them",
    )
    t.max_tokens_per_micro_batch = budget


def _slime_optimizer_flags(t) -> None:
    """slime's optimizer and Megatron flags, taken where this project does the same math."""
    for key in ("adam_beta1", "adam_beta2"):
        require(0 <= getattr(t, key) < 1, key, getattr(t, key), "must be in [0, 1)")
    for key in ("attention_dropout", "hidden_dropout"):
        require(
            getattr(t, key) == 0,
            key,
            getattr(t, key),
            "dropout is not implemented in training here (slime's recipes set 0.0): drop the flag or give 0",
        )
    for key in ("accumulate_allreduce_grads_in_fp32", "attention_softmax_in_fp32"):
        require(getattr(t, key), key, False, "fp32 is the only precision here for this (the flag's default)")
