"""The algorithm options (``AlgoConfig``: advantages, the policy loss, KL, entropy, off-policy correction)
and their rules."""

from __future__ import annotations

from dataclasses import dataclass

from slime_mt.config.fields import group, option, require
from slime_mt.errors import ConfigError


@group("algo")
@dataclass
class AlgoConfig:
    """Advantages, policy loss, KL, entropy, off-policy correction."""

    advantage_estimator: str = option(
        "grpo", "Advantage estimator.", choices=["grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline", "gspo"]
    )
    normalize_advantages_std: bool = option(True, "GRPO: divide by the group's reward std.")
    normalize_advantages: bool = option(
        False,
        "slime's --normalize-advantages: whiten the advantages over every trainable token of the step "
        "(token-weighted mean and unbiased variance, as slime does); for reinforce_plus_plus_baseline it "
        "replaces the default whitening over trajectories.",
    )
    gspo_gradient: str = option(
        "token",
        "GSPO's gradient. token (GSPO-token): each token's gradient carries its own TIS weight; sequence "
        "(slime's GSPO): the ratio is a function of the sequence's mean log-ratio, so every token of a "
        "sequence carries the sequence's mean TIS weight. Equal without --use-tis.",
        choices=["token", "sequence"],
    )
    eps_clip: float = option(0.2, "PPO clip range (low side).")
    eps_clip_high: float | None = option(None, "PPO clip range, high side (default: --eps-clip).")
    eps_clip_c: float | None = option(None, "Dual-clip constant c > 1 for negative advantages.")
    use_kl_loss: bool = option(False, "Add a KL penalty against a frozen reference model.")
    kl_loss_coef: float = option(0.0, "KL penalty coefficient.")
    kl_coef: float = option(
        0.0,
        "slime's flag: a KL penalty folded into the reward; not implemented here, so 0 only (slime's "
        "recipes give 0.00); the KL penalty is in the loss: --use-kl-loss --kl-loss-coef.",
    )
    kl_loss_type: str = option("low_var_kl", "KL estimator.", choices=["k1", "k2", "k3", "low_var_kl"])
    entropy_coef: float = option(0.0, "Entropy bonus coefficient.")
    use_tis: bool = option(False, "Truncated importance sampling against the rollout log-probs.")
    tis_clip: float = option(2.0, "TIS weight upper clip.")
    tis_clip_low: float = option(0.0, "TIS weight lower clip.")
    tis_mode: str = option(
        "token",
        "Off-policy correction: clip token or sequence weights, or mask outside the band.",
        choices=["token", "sequence", "token_mask", "geo_mean_mask"],
    )
    use_decoupled_loss: bool = option(
        False,
        "AReaL's decoupled PPO objective: the clip against the proximal policy (the trainer's weights at the "
        "step's start, recomputed) and each token weighted by pi_prox / pi_behav, the behaviour policy being "
        "the weights that generated that token (its engine log-prob). Under --fully-async, groups beyond "
        "--max-staleness are trained this way instead of dropped.",
    )
    behav_imp_weight_cap: float = option(
        5.0, "--use-decoupled-loss: tokens whose pi_prox / pi_behav exceeds this get no loss (AReaL's cap)."
    )
    m2po_threshold: float | None = option(
        None,
        "--use-decoupled-loss: M2PO's second-moment bound. Over the step's trained tokens, those with the "
        "largest (log pi_prox / pi_behav)^2 get no loss until the mean of the rest is at most this (0.04 in "
        "the paper); none: off.",
    )
    prox_logp_method: str = option(
        "recompute",
        "--use-decoupled-loss: how the proximal policy's log-probs are had (AReaL's prox_logp_method): recompute "
        "(a forward pass of the step's weights before training) or loglinear (no pass: log pi_prox = log pi_behav "
        "+ a (log pi_theta - log pi_behav), a = (v_prox - v_behav) / (v_prox + 1 - v_behav) from each token's "
        "version; a fresh token's proximal is its behaviour policy).",
        choices=["recompute", "loglinear"],
    )
    loss_reduction: str = option(
        "token_mean",
        "How token losses are averaged over the global batch.",
        choices=["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "trajectory_mean"],
    )

    @property
    def kl_term(self) -> bool:
        """Whether the loss has a KL term to the reference (``--use-kl-loss`` with a positive coefficient)."""
        return self.use_kl_loss and self.kl_loss_coef > 0

    @property
    def interpolates_proximal(self) -> bool:
        """The decoupled loss with ``--prox-logp-method loglinear``: the proximal log-probs interpolated by
        version in the loss (``losses.loglinear_proximal``), never recomputed by the trainer."""
        return self.use_decoupled_loss and self.prox_logp_method == "loglinear"


def validate_algo(cfg) -> None:
    """The clip ranges, the KL and TIS coefficients, and the decoupled objective's settings."""
    a = cfg.algo
    require(a.eps_clip > 0, "eps_clip", a.eps_clip, "must be > 0")
    if a.eps_clip_high is not None:
        require(a.eps_clip_high >= a.eps_clip, "eps_clip_high", a.eps_clip_high, f"must be >= --eps-clip={a.eps_clip}")
    if a.eps_clip_c is not None:
        require(a.eps_clip_c > 1, "eps_clip_c", a.eps_clip_c, "dual-clip constant must be > 1")
    require(a.kl_loss_coef >= 0, "kl_loss_coef", a.kl_loss_coef, "must be >= 0")
    require(
        a.kl_coef == 0,
        "kl_coef",
        a.kl_coef,
        "a KL penalty in the reward is not implemented here: use --use-kl-loss --kl-loss-coef (a KL term in the loss)",
    )
    require(a.tis_clip > 0, "tis_clip", a.tis_clip, "must be > 0")
    require(
        0 <= a.tis_clip_low <= 1 <= a.tis_clip,
        "tis_clip_low",
        a.tis_clip_low,
        f"must satisfy 0 <= --tis-clip-low <= 1 <= --tis-clip={a.tis_clip}",
    )
    n = cfg.rollout.n_samples_per_prompt
    if n == 1 and not cfg.debug.debug_rollout_only:
        raise ConfigError(
            f"--n-samples-per-prompt 1 with --advantage-estimator {a.advantage_estimator}: the estimator's baseline "
            "is the group's other samples, so with one sample per prompt every advantage is 0 and nothing trains; "
            "use --n-samples-per-prompt 2 or more (8 is usual)"
        )
    _validate_decoupled_loss(a)


def _validate_decoupled_loss(a) -> None:
    if not a.use_decoupled_loss:
        require(a.m2po_threshold is None, "m2po_threshold", a.m2po_threshold, "needs --use-decoupled-loss")
        require(a.prox_logp_method == "recompute", "prox_logp_method", a.prox_logp_method, "needs --use-decoupled-loss")
        return
    if a.prox_logp_method == "loglinear":
        require(
            a.m2po_threshold is None,
            "m2po_threshold",
            a.m2po_threshold,
            "M2PO's cutoff is found before training from the recomputed proximal log-probs, which "
            "--prox-logp-method loglinear does not compute (use recompute)",
        )
    require(
        not a.use_tis,
        "use_tis",
        a.use_tis,
        "--use-decoupled-loss already weights every token by pi_prox / pi_behav; drop --use-tis",
    )
    require(a.behav_imp_weight_cap > 1, "behav_imp_weight_cap", a.behav_imp_weight_cap, "must be > 1")
    if a.m2po_threshold is not None:
        require(a.m2po_threshold > 0, "m2po_threshold", a.m2po_threshold, "must be > 0")
