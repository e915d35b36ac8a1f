"""slime's flags this project does not take, each with why and what to use instead: a slime recipe pasted
here stops at parsing (exit 2, before anything loads) naming every such flag, never with a bare
'unrecognized arguments'.

The flags slime shares with this project are ordinary options; those only slime's recipes pass are options
too, marked ``slime's flag`` in their help: taken with slime's meaning (``--optimizer adam``, the Adam
betas, ``--lr-decay-style``, ``--use-dynamic-batch-size``, the W&B group and key, ``--train-backend
megatron``), or taken only at the value that keeps this project's math (``--kl-coef 0``, dropout 0, fp32
reductions), any other value an error naming the flag. ``--moe-aux-loss-coeff`` and ``--lr-warmup-iters``
are slime's names for ``--moe-aux-loss-coef`` and ``--lr-warmup-steps``; every ``--sglang-<arg>`` is
SGLang's server argument ``--<arg>`` (``config_parsing.pass_sglang_args``). docs/slime.md ("Bring your slime
plug-ins") has the table; ``tests/unit/compat/test_slime_flag_census.py`` holds every flag of slime's
example scripts and model presets at one commit."""

from __future__ import annotations

_MODEL_SHAPE = (
    "part of slime's model preset (scripts/models/*.sh MODEL_ARGS): the model's shape is read from "
    "--hf-checkpoint's config.json here; drop MODEL_ARGS"
)
_KERNEL = (
    "a kernel or fusion choice of slime's Megatron set-up: this project picks its kernels (--transformer-impl, "
    "--local-attention); drop it"
)
_NO_OPD = "on-policy distillation is not implemented yet; drop the --opd flags"
_NO_DELTA = (
    "slime's delta and disk weight sync is not implemented: the trainer sends the engines their weights "
    "(--weight-transport, --update-weight-buffer-size); drop it"
)
_NO_CPU_OPTIMIZER = (
    "the optimizer state stays on the device here (--use-distributed-optimizer shards it over the "
    "data-parallel ranks; --colocate --offload moves it off while the engines generate); drop it"
)
_SFT = "slime's SFT recipe: --sft trains the supervised loss on the loss-masked tokens, over --num-rollout steps"

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
            "--make-vocab-size-divisible-by",
            "--rotary-base",
            "--rotary-percent",
            "--rotary-interleaved",
            "--rotary-scaling-factor",
            "--use-rope-scaling",
            "--mscale",
            "--mscale-all-dim",
            "--normalization",
            "--norm-epsilon",
            "--apply-layernorm-1p",
            "--post-mlp-layernorm",
            "--post-self-attn-layernorm",
            "--swiglu",
            "--disable-bias-linear",
            "--add-qkv-bias",
            "--qk-layernorm",
            "--use-rotary-position-embeddings",
            "--no-position-embedding",
            "--untie-embeddings-and-output-weights",
            "--position-embedding-type",
            "--max-position-embeddings",
            "--seq-length",
            "--spec",
            "--multi-latent-attention",
            "--q-lora-rank",
            "--kv-lora-rank",
            "--qk-head-dim",
            "--qk-pos-emb-head-dim",
            "--v-head-dim",
            "--use-gated-attention",
            "--attention-output-gate",
            "--mtp-num-layers",
            "--num-experts",
            "--moe-ffn-hidden-size",
            "--moe-layer-freq",
            "--moe-router-topk",
            "--moe-router-score-function",
            "--moe-router-pre-softmax",
            "--moe-router-dtype",
            "--moe-router-num-groups",
            "--moe-router-group-topk",
            "--moe-router-topk-scaling-factor",
            "--moe-router-enable-expert-bias",
            "--moe-router-bias-update-rate",
            "--moe-shared-expert-intermediate-size",
            "--moe-shared-expert-gate",
            "--moe-token-drop-policy",
        ),
        _MODEL_SHAPE,
    ),
    **dict.fromkeys(
        (
            "--no-rope-fusion",
            "--no-masked-softmax-fusion",
            "--moe-grouped-gemm",
            "--moe-permute-fusion",
            "--moe-enable-deepep",
            "--allgather-cp",
            "--enable-experimental",
        ),
        _KERNEL,
    ),
    **dict.fromkeys(("--use-opd", "--opd-type", "--opd-kl-coef", "--opd-teacher-load"), _NO_OPD),
    **dict.fromkeys(
        (
            "--custom-update-weight-post-write-path",
            "--update-weight-mode",
            "--update-weight-transport",
            "--update-weight-delta-encoding",
            "--update-weight-delta-checksum",
            "--update-weight-disk-dir",
            "--update-weight-local-checkpoint-dir",
        ),
        _NO_DELTA,
    ),
    **dict.fromkeys(
        ("--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d", "--use-precision-aware-optimizer"),
        _NO_CPU_OPTIMIZER,
    ),
    "--loss-type": f"{_SFT}; the policy loss is the default",
    "--disable-compute-advantages-and-returns": f"{_SFT} (no advantages); drop it",
    "--num-epoch": f"{_SFT}; give the steps with --num-rollout",
    "--lr-warmup-fraction": "give the warm-up in optimizer steps: --lr-warmup-steps (slime's --lr-warmup-iters)",
    "--rollout-global-dataset": "prompts always come from one dataset over the run (--prompt-data); drop it",
    "--megatron-to-hf-mode": "the trainer reads Hugging Face folders itself (--hf-checkpoint) and sends the "
    "engines their weights; drop it",
    "--ref-load": "the reference model (--use-kl-loss) is --hf-checkpoint's weights; drop it",
    "--calculate-per-token-loss": "--loss-reduction token_mean (the default) averages over tokens",
    "--log-probs-max-tokens-per-gpu": "log-probs are scored in the training micro-batches "
    "(--max-tokens-per-micro-batch, or --use-dynamic-batch-size --max-tokens-per-gpu)",
    "--log-probs-chunk-size": "the log-probs are computed in chunks of the vocabulary's logits here always; drop it",
    "--num-steps-per-rollout": "--global-batch-size sets the optimizer steps per rollout "
    "(--rollout-batch-size x --n-samples-per-prompt / --global-batch-size)",
    "--offload-train": "--colocate --offload moves the trainer's state off the device while the engines generate",
    "--offload-rollout": "under --colocate the engines release their weights and KV cache while the trainer trains",
    "--use-routing-replay": "this project replays the rollout's routes: --use-rollout-routing-replay",
    "--use-rollout-logprobs": "not implemented: the old log-probs are the trainer's own; the engines' are "
    "corrected for with --use-tis",
    "--custom-tis-function-path": "not implemented: the TIS weight is this project's (--use-tis, --tis-clip, "
    "--tis-clip-low, --tis-mode)",
    "--custom-reward-post-process-path": "not implemented: rewards reach the advantage estimator as "
    "--custom-rm-path returns them; shape them there",
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
