"""slime's flags this project does not take, each with why and what to use instead: a slime recipe pasted
here stops at parsing (exit 2, before anything loads) naming every such flag, never with a bare
'unrecognized arguments'. The flags slime shares with this project are ordinary options (``slime's flag``
in their help); ``--use-dynamic-batch-size`` and ``--max-tokens-per-gpu`` are taken with slime's meaning
(``config/training.py``)."""

from __future__ import annotations

_MODEL_SHAPE = "the model's shape is read from --hf-checkpoint's config.json; drop slime's MODEL_ARGS"

REFUSED: dict[str, str] = {
    **dict.fromkeys(
        (
            "--num-layers",
            "--hidden-size",
            "--ffn-hidden-size",
            "--num-attention-heads",
            "--group-query-attention",
            "--num-query-groups",
            "--kv-channels",
            "--vocab-size",
            "--rotary-base",
            "--normalization",
            "--norm-epsilon",
            "--swiglu",
            "--disable-bias-linear",
            "--add-qkv-bias",
            "--qk-layernorm",
            "--use-rotary-position-embeddings",
            "--untie-embeddings-and-output-weights",
            "--position-embedding-type",
            "--max-position-embeddings",
            "--seq-length",
        ),
        _MODEL_SHAPE,
    ),
    "--rollout-global-dataset": "prompts always come from one dataset over the run (--prompt-data); drop it",
    "--megatron-to-hf-mode": "the trainer reads Hugging Face folders itself (--hf-checkpoint) and sends the "
    "engines their weights; drop it",
    "--ref-load": "the reference model (--use-kl-loss) is --hf-checkpoint's weights; drop it",
    "--attention-dropout": "dropout is off in training here (slime's recipes set 0.0); drop it",
    "--hidden-dropout": "dropout is off in training here (slime's recipes set 0.0); drop it",
    "--accumulate-allreduce-grads-in-fp32": "gradients are reduced in fp32 here always; drop it",
    "--attention-softmax-in-fp32": "the attention softmax is fp32 here always; drop it",
    "--attention-backend": "--transformer-impl (transformer_engine or local) and --local-attention pick the attention",
    "--optimizer": "the optimizer is Adam with decoupled weight decay (--weight-decay), betas 0.9 and 0.98; drop it",
    "--adam-beta1": "Adam's betas are fixed at 0.9 and 0.98 here; drop it",
    "--adam-beta2": "Adam's betas are fixed at 0.9 and 0.98 here; drop it",
    "--lr-decay-style": "the schedule is a linear warm-up (--lr-warmup-steps), then constant (slime's default), "
    "or cosine down to --min-lr when 0 < --min-lr < --lr",
    "--lr-warmup-iters": "use --lr-warmup-steps",
    "--kl-coef": "a KL penalty in the reward is not implemented; the KL penalty is in the loss: --use-kl-loss "
    "--kl-loss-coef",
    "--calculate-per-token-loss": "--loss-reduction token_mean (the default) averages over tokens",
    "--log-probs-max-tokens-per-gpu": "log-probs are scored in the training micro-batches "
    "(--max-tokens-per-micro-batch, or --use-dynamic-batch-size --max-tokens-per-gpu)",
    "--num-steps-per-rollout": "--global-batch-size sets the optimizer steps per rollout "
    "(--rollout-batch-size x --n-samples-per-prompt / --global-batch-size)",
    "--offload-train": "--colocate --offload moves the trainer's state off the device while the engines generate",
    "--offload-rollout": "under --colocate the engines release their weights and KV cache while the trainer trains",
    "--use-routing-replay": "this project replays the rollout's routes: --use-rollout-routing-replay",
    "--true-on-policy-mode": "not implemented; the engines' log-probs are corrected for with --use-tis",
    "--start-rollout-id": "--load resumes at the step its checkpoint saved",
    "--use-tensorboard": "metrics go to the run folder's metrics.jsonl (slime-mt plot draws them) and to W&B "
    "(--use-wandb)",
    "--balance-data": "not implemented: whole prompt groups are dealt to the data-parallel ranks round robin",
    "--keep-old-actor": "not implemented; --use-decoupled-loss keeps the proximal policy's log-probs",
}


def refused(flag: str) -> str | None:
    """``--x is slime's flag, not taken here: why; what instead`` (None: not one of slime's)."""
    why = REFUSED.get(flag)
    return f"{flag} is slime's flag, not taken here: {why}" if why else None
