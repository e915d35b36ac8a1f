"""Mini-batches by prompt groups, each data-parallel rank's share, micro-batches by a token budget, and
the global loss weights.

An optimizer step takes a fixed number of prompt groups (a variable number of sequences, as SkyRL
does: step-wise data has one sequence per turn). Its sequences are packed into micro-batches by a
token budget (first-fit decreasing). The reduction weights of every token are computed ONCE per
optimizer step from the whole mini-batch, so how it is split into micro-batches does not change
the gradient.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from slime_mt.types import TrainingSample

REDUCTIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "trajectory_mean")


def mini_batches_by_groups(samples: list[TrainingSample], prompts_per_step: int) -> list[list[int]]:
    """Indices of ``samples`` per optimizer step: ``prompts_per_step`` whole prompt groups each,
    groups in first-appearance order (the last step may hold fewer groups)."""
    if prompts_per_step <= 0:
        raise ValueError(f"prompts_per_step must be positive, got {prompts_per_step}")
    order: dict[int, list[int]] = collections.OrderedDict()
    for i, s in enumerate(samples):
        order.setdefault(s.group_id, []).append(i)
    groups = list(order.values())
    return [[i for g in groups[k : k + prompts_per_step] for i in g] for k in range(0, len(groups), prompts_per_step)]


@dataclass
class RankShare:
    """What one data-parallel rank trains on in a step (its TP peers train on the same): its prompt
    groups of each mini-batch, with what only the whole batch knows. ``indices``: the samples' places
    in the step's batch (kept log-probs are reported by them); ``advantages``: each sample's, a scalar
    from the rollout role's group estimator, or one per response token where an estimator on the train
    ranks set them from model outputs (values, a teacher's log-probs) after scoring this share;
    ``weights``: each token's reduction weight, computed from its whole mini-batch; ``mini_batch``: the
    optimizer step of each sample, of ``mini_batches`` steps every rank takes; ``trainable``: whether the
    step trains at all (a batch with no trainable token is skipped by every rank)."""

    indices: list[int]
    samples: list[TrainingSample]
    advantages: list[float | list[float]]
    weights: list[list[float]]
    mini_batch: list[int]
    mini_batches: int
    trainable: bool

    def of_mini_batch(self, m: int) -> list[int]:
        """Positions in this share of mini-batch ``m``'s samples, in batch order."""
        return [k for k, b in enumerate(self.mini_batch) if b == m]

    def token_advantages(self, k: int) -> list[float]:
        """Sample ``k``'s advantage on each response token, 0 where its loss mask is (a scalar advantage
        on every trained token)."""
        advantage, mask = self.advantages[k], self.samples[k].loss_mask
        if isinstance(advantage, list):
            if len(advantage) != len(mask):
                raise ValueError(
                    f"sample {self.indices[k]}: {len(advantage)} per-token advantages for {len(mask)} response tokens"
                )
            return [a * m for a, m in zip(advantage, mask)]
        return [advantage * m for m in mask]


def split_by_dp(
    samples: list[TrainingSample],
    advantages: list[float],
    prompts_per_step: int,
    dp_size: int,
    loss_reduction: str,
    max_len: int | None = None,
) -> list[RankShare]:
    """The step's batch split into one ``RankShare`` per data-parallel rank (slime's
    ``_split_train_data_by_dp``): each mini-batch's prompt groups dealt round robin in order, whole
    groups to a rank, every token's reduction weight from its whole mini-batch."""
    trainable = any(s.num_trainable for s in samples)
    picked: list[list[tuple[int, int, list[float]]]] = [[] for _ in range(dp_size)]
    mini_batches = mini_batches_by_groups(samples, prompts_per_step)
    for m, mb in enumerate(mini_batches):
        weights = reduction_weights([samples[i] for i in mb], loss_reduction, max_len)
        order: dict[int, int] = {}
        for i, w in zip(mb, weights):
            rank = order.setdefault(samples[i].group_id, len(order)) % dp_size
            picked[rank].append((i, m, w))
    return [
        RankShare(
            indices=[i for i, _, _ in mine],
            samples=[samples[i] for i, _, _ in mine],
            advantages=[advantages[i] for i, _, _ in mine],
            weights=[w for _, _, w in mine],
            mini_batch=[m for _, m, _ in mine],
            mini_batches=len(mini_batches),
            trainable=trainable,
        )
        for mine in picked
    ]


def micro_batches_by_tokens(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """First-fit decreasing: indices into ``lengths`` grouped so each group's total stays within
    ``max_tokens`` (a longer sequence gets a micro-batch of its own). Indices keep input order inside
    a micro-batch."""
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda k: -lengths[k]):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(max_tokens - lengths[i])
    return [sorted(b) for b in bins]


def micro_batches_by_count(n: int, size: int) -> list[list[int]]:
    return [list(range(k, min(k + size, n))) for k in range(0, n, size)]


def reduction_weights(samples: list[TrainingSample], mode: str, max_len: int | None = None) -> list[list[float]]:
    """Per response token of each sample, its weight in the step's loss (0 where masked).

    token_mean:              1 / (trainable tokens in the step)
    seq_mean_token_mean:     1 / (tokens of its sequence x sequences in the step)
    seq_mean_token_sum_norm: 1 / (max_len x sequences in the step)        (Dr. GRPO)
    trajectory_mean:         1 / (tokens of its trajectory x trajectories in the step): every
                             trajectory weighs the same, however it was split into steps.
    Sequences (trajectories) without a trainable token are not counted."""
    if mode not in REDUCTIONS:
        raise ValueError(f"unknown loss reduction {mode!r}; choose from {REDUCTIONS}")
    counts = [sum(s.loss_mask) for s in samples]
    live = [c for c in counts if c > 0]
    if mode == "token_mean":
        total = max(sum(counts), 1)
        scale = [1.0 / total] * len(samples)
    elif mode == "seq_mean_token_mean":
        scale = [1.0 / (c * len(live)) if c else 0.0 for c in counts]
    elif mode == "seq_mean_token_sum_norm":
        if not max_len:
            raise ValueError("seq_mean_token_sum_norm needs max_len (the fixed generation budget)")
        scale = [1.0 / (max_len * max(len(live), 1))] * len(samples)
    else:
        per_trajectory: dict[str, int] = collections.defaultdict(int)
        for s, c in zip(samples, counts):
            per_trajectory[s.trajectory_id] += c
        n_traj = max(sum(1 for c in per_trajectory.values() if c > 0), 1)
        scale = [
            1.0 / (per_trajectory[s.trajectory_id] * n_traj) if per_trajectory[s.trajectory_id] else 0.0
            for s in samples
        ]
    return [[w * m for m in s.loss_mask] for s, w in zip(samples, scale)]
