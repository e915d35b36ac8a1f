"""RL policy losses on packed tokens.

All per-token tensors are 1-D over the response tokens of a micro-batch, concatenated: ``[T]``.
``seq_ids [T]`` (long) says which sequence each token belongs to (0..S-1, used by sequence-level
terms); ``weights [T]`` are the global reduction weights from ``reduction_weights`` (0 on masked
tokens), so ``sum(per_token_loss * weights)`` summed over micro-batches is the normalised loss of the
whole global batch, whatever the micro-batch split.

Terms: PPO clipped surrogate with asymmetric clip (``eps_clip``, ``eps_clip_high``) and dual clip
(``eps_clip_c``); GSPO's sequence ratio, with GSPO-token's gradient or slime's (``gspo_gradient``);
KL to a reference (k1, k2, k3, low_var_kl = k3 clamped to [-10, 10], as slime has them); entropy
bonus; off-policy correction against the rollout log-probs (token TIS, sequence TIS, token mask
outside a band, geometric-mean sequence mask); AReaL's decoupled objective for stale tokens (the
clip against the proximal policy, recomputed or interpolated by version, the weight pi_prox /
pi_behav capped by masking, M2PO's second-moment filter). Where this differs from slime on purpose,
docs/training.md ("Where the math differs from slime") says how and which flag gives slime's numbers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from slime_mt.config import AlgoConfig


@dataclass
class LossInputs:
    """One micro-batch of packed response tokens."""

    log_probs: torch.Tensor  # [T] current policy (requires grad)
    old_log_probs: torch.Tensor  # [T] policy before this step's updates (recomputed by the trainer)
    rollout_log_probs: torch.Tensor  # [T] what the engine reported; NaN where it sampled no such token
    advantages: torch.Tensor  # [T] per-token advantages (already times the loss mask)
    weights: torch.Tensor  # [T] global reduction weights, 0 on masked tokens
    seq_ids: torch.Tensor  # [T] long, sequence index of each token
    ref_log_probs: torch.Tensor | None = None  # [T] reference policy, for the KL term
    entropy: torch.Tensor | None = None  # [T] policy entropy per position
    m2po_cutoff: float | None = None  # --m2po-threshold: the step's bound on (log pi_prox / pi_behav)^2
    token_versions: torch.Tensor | None = None  # [T] the weight version that generated each token (-1: none)
    proximal_version: int | None = None  # the version of the weights the step starts from (loglinear)


def segment_sum(values: torch.Tensor, seq_ids: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """``values [T]`` summed per sequence -> ``[S]``."""
    return values.new_zeros(num_seqs).index_add(0, seq_ids, values)


def kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate of pi vs ref ``[T]``: k1 = log r, k2 = (log r)^2 / 2,
    k3 = exp(-log r) - 1 + log r, low_var_kl = k3 clamped to [-10, 10] (slime and verl clamp only
    this one), with log r = lp - ref."""
    log_ratio = log_probs - ref_log_probs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "k3":
        return torch.exp(-log_ratio) - 1 + log_ratio
    if kind == "low_var_kl":
        return (torch.exp(-log_ratio) - 1 + log_ratio).clamp(-10, 10)
    raise ValueError(f"unknown KL type {kind!r}; use k1, k2, k3 or low_var_kl")


def off_policy_weights(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    seq_ids: torch.Tensor,
    num_seqs: int,
    mode: str,
    low: float,
    high: float,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Importance weights between the trainer's old policy and the rollout engine -> (weights [T]
    (no grad), kept-token mask [T], metrics). Modes: ``token`` TIS clip(w_t, low, high);
    ``sequence`` TIS clip(prod_t w_t); ``token_mask`` drops tokens with w_t outside [low, high];
    ``geo_mean_mask`` drops sequences whose geometric-mean weight is outside [low, high]."""
    log_w = ((old_log_probs - rollout_log_probs) * mask).detach()
    raw = torch.exp(log_w)
    keep = mask.clone()
    if mode in ("token", "token_mask"):
        outside = (raw < low) | (raw > high)  # [T]
    elif mode == "sequence":
        seq_w = torch.exp(segment_sum(log_w, seq_ids, num_seqs))  # [S]
        outside = ((seq_w < low) | (seq_w > high))[seq_ids]
    elif mode == "geo_mean_mask":
        counts = segment_sum(mask, seq_ids, num_seqs).clamp_min(1)
        geo = torch.exp(segment_sum(log_w, seq_ids, num_seqs) / counts)
        outside = ((geo < low) | (geo > high))[seq_ids]
    else:
        raise ValueError(f"unknown off-policy correction {mode!r}")
    if mode == "token":
        weights = raw.clamp(low, high)
    elif mode == "sequence":
        weights = seq_w.clamp(low, high)[seq_ids]
    else:  # the masks: tokens (or every token of sequences) outside the band train nothing
        weights = torch.ones_like(raw)
        keep = keep * (~outside).to(mask.dtype)
    n = mask.sum().clamp_min(1)
    live = mask > 0
    metrics = {
        "tis_weight_mean": float((weights * mask).sum() / n),
        "tis_weight_min": float(weights[live].min()) if live.any() else 0.0,
        "tis_weight_max": float(weights[live].max()) if live.any() else 0.0,
        "tis_masked_fraction": float(((mask - keep) * mask).sum() / n),
        # clipped or masked: the tokens whose weight (their sequence's, for the sequence modes) left the band
        "tis_clipped_fraction": float((outside.to(mask.dtype) * mask).sum() / n),
    }
    return weights * keep, keep, metrics


def decoupled_weights(
    prox_log_probs: torch.Tensor,
    behav_log_probs: torch.Tensor,
    mask: torch.Tensor,
    cap: float,
    m2po_cutoff: float | None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """AReaL's behaviour weights w_t = pi_prox / pi_behav of the decoupled objective -> (weights [T]
    (no grad), kept-token mask [T], metrics). A token with w_t > ``cap`` gets no loss (AReaL masks it
    rather than clipping); with ``m2po_cutoff`` (``m2po_cutoff``'s, over the whole step) a token whose
    (log w_t)^2 exceeds it gets none either. Metrics are means over the masked-in tokens ``mask``."""
    log_w = ((prox_log_probs - behav_log_probs) * mask).detach()
    raw = torch.exp(log_w)
    live = mask > 0
    capped = live & (raw > cap)
    filtered = live & ~capped & (log_w.square() > m2po_cutoff) if m2po_cutoff is not None else torch.zeros_like(live)
    keep = mask * (~(capped | filtered)).to(mask.dtype)
    n = mask.sum().clamp_min(1)
    metrics = {
        "behav_weight_mean": float((raw * mask).sum() / n),
        "behav_log_weight_second_moment": float((log_w.square() * mask).sum() / n),
        "behav_capped_fraction": float(capped.to(mask.dtype).sum() / n),
        "m2po_masked_fraction": float(filtered.to(mask.dtype).sum() / n),
    }
    return raw * keep, keep, metrics


def m2po_cutoff(log_w_sq: torch.Tensor, threshold: float, group=None) -> float | None:
    """M2PO's bound for one step: the largest c such that the tokens with (log w)^2 <= c have a mean
    (log w)^2 of at most ``threshold``; None when every token's already does (nothing is masked).

    ``log_w_sq [N]`` (float64) holds this rank's trained tokens; with ``group`` the step is every rank
    of it, and each rank returns the same c. The mean below c only grows with c, so c is found by
    bisection on sums and counts (two numbers per rank and round), not by gathering every token."""

    def below(c: float) -> tuple[float, float]:
        inside = log_w_sq <= c
        totals = torch.stack([log_w_sq[inside].sum(), inside.sum().to(log_w_sq.dtype)])
        if group is not None:
            torch.distributed.all_reduce(totals, group=group)
        return float(totals[0]), float(totals[1])

    top = log_w_sq.max() if log_w_sq.numel() else log_w_sq.new_zeros(())
    if group is not None:
        torch.distributed.all_reduce(top, op=torch.distributed.ReduceOp.MAX, group=group)
    high = float(top)
    total, count = below(high)
    if total <= threshold * count:
        return None
    low = 0.0  # no token below 0: an empty mean, within the bound
    for _ in range(64):  # float64: the bracket is then below one step between the values
        middle = (low + high) / 2
        total, count = below(middle)
        if total <= threshold * count:
            low = middle
        else:
            high = middle
    return low


# metrics that are a largest value rather than a token-weighted sum: reduced by max over rows, ranks and
# mini-batches
MAXIMA = frozenset({"train_rollout_logprob_abs_diff_max"})


def add_metric(totals: dict[str, float], key: str, value: float, divisor: int = 1) -> None:
    """One more row's, rank's or mini-batch's ``value`` of metric ``key`` (``train/`` prefixed or not)
    into ``totals`` (a defaultdict of 0.0): the larger of the two for MAXIMA, else the sum with
    ``value / divisor``."""
    if key.removeprefix("train/") in MAXIMA:
        totals[key] = max(totals[key], value)
    else:
        totals[key] += value / divisor


def loglinear_proximal(x: LossInputs) -> torch.Tensor:
    """AReaL's ``prox_logp_method: loglinear``: the proximal policy's log-probs without a forward pass,
    interpolated in log space between the behaviour policy and the current one by each token's version:
    ``log pi_prox = log pi_behav + a (log pi_theta - log pi_behav)``, ``a = (v_prox - v_behav) /
    (v_theta - v_behav)`` clamped to [0, 1], with v_theta = v_prox + 1 (the weights this step makes). A
    token the step's own weights generated (a = 0) and one without a version (AReaL's a = 0 there) take
    their behaviour log-prob; one without a behaviour log-prob (never sampled, never trained) the current
    one. Detached: the proximal policy is a constant of the objective."""
    if x.token_versions is None or x.proximal_version is None:
        raise ValueError(
            "--prox-logp-method loglinear needs the weight version of every token (recorded by the rollout) and "
            "the step's version"
        )
    current = x.log_probs.detach()
    behav = x.rollout_log_probs
    versions = x.token_versions.to(current.dtype)
    alpha = ((x.proximal_version - versions) / (x.proximal_version + 1 - versions)).clamp(0.0, 1.0)
    alpha = torch.where(x.token_versions >= 0, alpha, torch.zeros_like(alpha))
    return torch.where(torch.isnan(behav), current, behav + alpha * (current - behav))


def policy_loss(x: LossInputs, cfg: AlgoConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """-> (scalar loss = sum over tokens of per-token loss x weights, metric sums over tokens).

    Metric values are token sums weighted by ``x.weights``; summing them over micro-batches gives
    the global-batch mean under the configured reduction."""
    mask = (x.weights > 0).to(x.log_probs.dtype)  # [T]
    num_seqs = int(x.seq_ids.max()) + 1 if x.seq_ids.numel() else 0
    if cfg.interpolates_proximal:
        x = dataclasses.replace(x, old_log_probs=loglinear_proximal(x))
    log_ratio = x.log_probs - x.old_log_probs  # [T]
    ratio = _ratio(x, cfg, log_ratio, mask, num_seqs)
    low, high = cfg.eps_clip, cfg.eps_clip_high if cfg.eps_clip_high is not None else cfg.eps_clip
    surrogate = -x.advantages * ratio
    clipped = -x.advantages * ratio.clamp(1 - low, 1 + high)
    pg = torch.maximum(surrogate, clipped)
    clip_mask = (clipped > surrogate).to(pg.dtype)
    if cfg.eps_clip_c is not None:
        dual = -x.advantages * cfg.eps_clip_c
        pg = torch.where(x.advantages < 0, torch.minimum(pg, dual), pg)
    weights = x.weights
    metrics: dict[str, float] = {}
    sampled = ~torch.isnan(x.rollout_log_probs)  # [T] False on re-tokenized history (no rollout log-probs)
    if cfg.use_tis or cfg.use_decoupled_loss:  # one or the other (the config refuses both)
        is_weights, keep, correction_metrics = _off_policy(x, cfg, mask, num_seqs, sampled)
        pg = pg * is_weights
        weights = weights * keep
        metrics.update({k: v * float(x.weights.sum()) for k, v in correction_metrics.items()})
    per_token = pg
    if cfg.kl_term:
        if x.ref_log_probs is None:
            raise ValueError("--use-kl-loss needs reference log-probs")
        kl = kl_penalty(x.log_probs, x.ref_log_probs, cfg.kl_loss_type)
        per_token = per_token + cfg.kl_loss_coef * kl
        metrics["kl"] = float((kl.detach() * x.weights).sum())
    if cfg.entropy_coef != 0 and x.entropy is not None:
        per_token = per_token - cfg.entropy_coef * x.entropy
    loss = (per_token * weights).sum()
    w = x.weights
    metrics.update(
        {
            "pg_loss": float((pg.detach() * weights).sum()),
            "clip_fraction": float((clip_mask * w).sum()),
            "approx_kl": float((-log_ratio.detach() * w).sum()),
            "ratio_mean": float((ratio.detach() * w).sum()),
        }
    )
    if bool(sampled.any()):  # over the tokens that have rollout log-probs; absent when none has
        diff = (x.old_log_probs - x.rollout_log_probs).abs()
        metrics["train_rollout_logprob_abs_diff"] = float((diff * w)[sampled].sum())
        trained = sampled & (w > 0)
        if bool(trained.any()):  # the largest gap of a trained token (MAXIMA: reduced by max, not summed)
            metrics["train_rollout_logprob_abs_diff_max"] = float(diff[trained].max())
    if x.entropy is not None:
        metrics["entropy"] = float((x.entropy.detach() * w).sum())
    return loss, metrics


def _ratio(x: LossInputs, cfg: AlgoConfig, log_ratio: torch.Tensor, mask: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """The importance ratio of each token ``[T]``: per token, or GSPO's per sequence."""
    if cfg.advantage_estimator != "gspo":
        return torch.exp(log_ratio)
    counts = segment_sum(mask, x.seq_ids, num_seqs).clamp_min(1)
    if cfg.gspo_gradient == "sequence":  # slime's: exp(mean log-ratio), the gradient through the mean
        return torch.exp(segment_sum(log_ratio * mask, x.seq_ids, num_seqs) / counts)[x.seq_ids]
    # GSPO-token: sg[s_i] * pi/sg[pi], the value is the sequence ratio, the gradient per token
    seq_log_ratio = segment_sum(log_ratio.detach() * mask, x.seq_ids, num_seqs) / counts  # [S]
    return torch.exp(seq_log_ratio[x.seq_ids] + x.log_probs - x.log_probs.detach())


def _off_policy(
    x: LossInputs, cfg: AlgoConfig, mask: torch.Tensor, num_seqs: int, sampled: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """TIS's or the decoupled objective's (weight ``[T]``, kept ``[T]``, metrics) against the behaviour
    policy: the rollout log-probs; a trained token without one is refused, naming the flag."""
    flag, needs = (
        ("--use-tis", "rollout log-probs")
        if cfg.use_tis
        else ("--use-decoupled-loss", "the behaviour policy's log-probs")
    )
    if not bool(sampled[mask > 0].all()):
        raise ValueError(
            f"{flag} needs {needs}, but some trained tokens have none (a "
            "re-tokenized history: --retokenize-chat-history with --sample-format concat)"
        )
    behav = torch.where(sampled, x.rollout_log_probs, x.old_log_probs)  # untrained tokens without one weigh 1
    if cfg.use_tis:
        return off_policy_weights(
            x.old_log_probs, behav, mask, x.seq_ids, num_seqs, cfg.tis_mode, cfg.tis_clip_low, cfg.tis_clip
        )
    return decoupled_weights(x.old_log_probs, behav, mask, cfg.behav_imp_weight_cap, x.m2po_cutoff)


def sft_loss(x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
    """Negative log-likelihood of the trainable tokens, under the same reduction weights."""
    loss = -(x.log_probs * x.weights).sum()
    return loss, {"sft_nll": float(loss.detach())}
