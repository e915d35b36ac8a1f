"""Advantage estimators over prompt groups identified by explicit ``group_id`` (uneven groups allowed).

One scalar advantage per trajectory, computed from the rewards of trajectories (the last step of
each, in step-wise data) and broadcast to every step of the same trajectory by ``trajectory_id``;
token advantages are that scalar times each sequence's own loss mask. FAILED trajectories are left
out of their group's statistics and get advantage 0.

  grpo / gspo: (r - mean_g) / (std_g + eps)   (std unbiased; a group of one gets 0)
  dr_grpo:     r - mean_g
  rloo:        r - mean of the other members = n/(n-1) * (r - mean_g)
  reinforce_plus_plus_baseline: r - mean_g, then whitened over the batch's trajectories
  --normalize-advantages (slime's): any of these, broadcast to tokens, whitened over every trainable
  token of the step (token-weighted; replaces reinforce_plus_plus_baseline's trajectory whitening)
"""

from __future__ import annotations

import collections

import torch

from slime_mt.types import Status, TrainingSample

ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline", "gspo")
EPS = 1e-6


def group_advantages(
    rewards: torch.Tensor,
    group_ids: list[int],
    estimator: str,
    valid: torch.Tensor | None = None,
    normalize_std: bool = True,
    whiten: bool = True,
) -> torch.Tensor:
    """``rewards [N]`` of trajectories, their group ids, ``valid [N]`` (False = FAILED) -> ``[N]``.
    ``whiten``: reinforce_plus_plus_baseline's whitening over the trajectories."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; choose from {ESTIMATORS}")
    rewards = rewards.double()
    valid = torch.ones_like(rewards, dtype=torch.bool) if valid is None else valid
    out = torch.zeros_like(rewards)
    members: dict[int, list[int]] = collections.defaultdict(list)
    for i, g in enumerate(group_ids):
        if valid[i]:
            members[g].append(i)
    for idx in members.values():
        r = rewards[idx]
        n = len(idx)
        centered = r - r.mean()
        if estimator in ("grpo", "gspo"):
            if n < 2:
                continue
            out[idx] = centered / (r.std() + EPS) if normalize_std else centered
        elif estimator == "rloo":
            if n < 2:
                continue
            out[idx] = centered * n / (n - 1)
        else:  # dr_grpo, reinforce_plus_plus_baseline
            out[idx] = centered
    if estimator == "reinforce_plus_plus_baseline" and whiten and int(valid.sum()) > 1:
        live = out[valid]
        out[valid] = (live - live.mean()) / (live.std() + EPS)
    return out.float()


def whiten_over_tokens(advantages: list[float], tokens: list[int]) -> list[float]:
    """slime's ``--normalize-advantages``: each sequence's advantage, on each of its ``tokens``
    trainable tokens, whitened over every trainable token: (a - mean) / sqrt(var + 1e-8), mean and
    variance token-weighted, the variance unbiased over the token count (Bessel)."""
    a = torch.tensor(advantages, dtype=torch.float64)  # [S]
    n = torch.tensor(tokens, dtype=torch.float64)  # [S]
    total = n.sum()
    if total == 0:
        return list(advantages)
    mean = (a * n).sum() / total
    var = (a.square() * n).sum() / total - mean.square()
    if total >= 2:
        var = var * total / (total - 1)
    return ((a - mean) / torch.sqrt(var + 1e-8)).tolist()


def compute_advantages(
    samples: list[TrainingSample], estimator: str, normalize_std: bool = True, normalize_advantages: bool = False
) -> list[float]:
    """One advantage per training sequence: computed per trajectory from the rewards of the last
    steps, then given to every sequence of that trajectory (matched by ``trajectory_id``);
    ``normalize_advantages``: then whitened over the trainable tokens (``whiten_over_tokens``)."""
    last = [s for s in samples if s.is_last_step]
    ids = [s.trajectory_id for s in last]
    if len(set(ids)) != len(ids):
        raise ValueError("two last steps share a trajectory_id; trajectory ids must be unique")
    rewards = torch.tensor([s.reward for s in last])
    valid = torch.tensor([s.status != Status.FAILED for s in last])
    groups = [s.group_id for s in last]
    adv = group_advantages(rewards, groups, estimator, valid, normalize_std, whiten=not normalize_advantages)
    by_trajectory = dict(zip(ids, adv.tolist()))
    missing = {s.trajectory_id for s in samples} - set(by_trajectory)
    if missing:
        raise ValueError(f"trajectories without a last step: {sorted(missing)[:5]}")
    out = [by_trajectory[s.trajectory_id] for s in samples]
    if normalize_advantages:
        out = whiten_over_tokens(out, [sum(s.loss_mask) for s in samples])
    return out
