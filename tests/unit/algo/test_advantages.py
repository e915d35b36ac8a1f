"""Advantage estimators: uneven groups, FAILED members left out, step-wise broadcast by trajectory."""

import math

import pytest
import torch
from algo_helpers import make_sample

from slime_mt.algo.advantages import compute_advantages, group_advantages
from slime_mt.rollout.finalize import to_concat_samples, to_step_wise_samples
from slime_mt.types import Status

REWARDS = torch.tensor([1.0, 0.0, 0.0, 2.0, 4.0])
GROUPS = [0, 0, 0, 1, 1]  # uneven: 3 and 2


def std(xs):
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


@pytest.mark.parametrize(
    "estimator,expected",
    [
        (
            "grpo",
            [
                (1 - 1 / 3) / std([1, 0, 0]),
                (0 - 1 / 3) / std([1, 0, 0]),
                (0 - 1 / 3) / std([1, 0, 0]),
                -1 / std([2, 4]),
                1 / std([2, 4]),
            ],
        ),
        (
            "gspo",
            [
                (1 - 1 / 3) / std([1, 0, 0]),
                (0 - 1 / 3) / std([1, 0, 0]),
                (0 - 1 / 3) / std([1, 0, 0]),
                -1 / std([2, 4]),
                1 / std([2, 4]),
            ],
        ),
        ("dr_grpo", [2 / 3, -1 / 3, -1 / 3, -1.0, 1.0]),
        ("rloo", [1 - 0, 0 - 0.5, 0 - 0.5, 2 - 4, 4 - 2]),
    ],
)
def test_estimators_on_uneven_groups(estimator, expected):
    out = group_advantages(REWARDS, GROUPS, estimator)
    assert out.tolist() == pytest.approx(expected, abs=1e-5)


def test_reinforce_plus_plus_baseline_whitens_the_batch():
    out = group_advantages(REWARDS, GROUPS, "reinforce_plus_plus_baseline")
    centered = torch.tensor([2 / 3, -1 / 3, -1 / 3, -1.0, 1.0])
    assert out.tolist() == pytest.approx(((centered - centered.mean()) / centered.std()).tolist(), abs=1e-5)


def test_failed_members_are_left_out():
    valid = torch.tensor([True, True, False, True, True])
    out = group_advantages(REWARDS, GROUPS, "grpo", valid)
    assert out[2] == 0
    assert out[:2].tolist() == pytest.approx([(1 - 0.5) / std([1, 0]), (0 - 0.5) / std([1, 0])], abs=1e-5)


def test_singleton_groups_get_zero():
    assert group_advantages(torch.tensor([3.0, 1.0]), [0, 1], "grpo").tolist() == [0.0, 0.0]
    assert group_advantages(torch.tensor([3.0, 1.0]), [0, 1], "rloo").tolist() == [0.0, 0.0]


def test_std_off_is_dr_grpo():
    assert group_advantages(REWARDS, GROUPS, "grpo", normalize_std=False).tolist() == pytest.approx(
        group_advantages(REWARDS, GROUPS, "dr_grpo").tolist()
    )


def test_step_wise_broadcast_by_trajectory_not_position():
    turns2 = [([10], [-0.1], [20]), ([11], [-0.2], [])]
    turns3 = [([10], [-0.1], [20]), ([11], [-0.2], [21]), ([12], [-0.3], [])]
    samples = [
        make_sample([1], turns2, reward=1.0, group=0, index=0),
        make_sample([1], turns3, reward=0.0, group=0, index=1),
        make_sample([1], turns2, reward=5.0, group=0, index=2, status=Status.FAILED),
        make_sample([1], [turns2[0]], reward=3.0, group=1, index=3),
        make_sample([1], turns3, reward=1.0, group=1, index=4),
    ]
    steps = to_step_wise_samples(samples)
    per_step = compute_advantages(steps, "grpo")
    per_traj = compute_advantages(to_concat_samples(samples), "grpo")
    expected = [per_traj[0]] * 2 + [per_traj[1]] * 3 + [0.0] * 2 + [per_traj[3]] + [per_traj[4]] * 3
    assert per_step == pytest.approx(expected)
    a, b = (1 - 0.5) / std([1, 0]), (3 - 2) / std([3, 1])
    assert per_traj == pytest.approx([a, -a, 0.0, b, -b], abs=1e-5)


def test_normalize_advantages_is_slimes_token_weighted_whitening():
    """--normalize-advantages: the advantages of reinforce_plus_plus_baseline (group-centred, not
    whitened per trajectory) broadcast to the trainable tokens and whitened over them, as slime's
    distributed_masked_whiten does: long responses weigh more, the FAILED sample's tokens not at all."""
    turns = [([10, 11, 12], [-0.1] * 3, [20]), ([13], [-0.3], [])]  # 4 trainable tokens
    samples = [
        make_sample([1], turns, reward=1.0, group=0, index=0),
        make_sample([1], [turns[1]], reward=0.0, group=0, index=1),  # 1 trainable token
        make_sample([1], turns, reward=3.0, group=1, index=2),
        make_sample([1], [turns[1]], reward=1.0, group=1, index=3),
        make_sample([1], turns, reward=9.0, group=1, index=4, status=Status.FAILED),
    ]
    concat = to_concat_samples(samples)
    out = compute_advantages(concat, "reinforce_plus_plus_baseline", normalize_advantages=True)
    centered = [0.5, -0.5, 1.0, -1.0, 0.0]  # FAILED left out of group 1's mean
    tokens = torch.tensor(
        [a for a, t in zip(centered, concat) for m in t.loss_mask if m], dtype=torch.float64
    )  # slime: one value per trainable token
    mean, var = tokens.mean(), tokens.var(unbiased=True)
    assert out[:4] == pytest.approx(((torch.tensor(centered[:4]) - mean) / torch.sqrt(var + 1e-8)).tolist())
    assert sum(concat[4].loss_mask) == 0
    default = compute_advantages(concat, "reinforce_plus_plus_baseline")
    assert default != pytest.approx(out)  # the default whitens over trajectories, one value each
    step_wise = compute_advantages(to_step_wise_samples(samples), "reinforce_plus_plus_baseline", True, True)
    assert step_wise[:2] == pytest.approx([out[0]] * 2)  # one trajectory's steps share its whitened value
