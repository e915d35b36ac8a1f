"""Concat, step-wise and merged training samples: exact tokens, masks and log-probs."""

import dataclasses

import pytest
import torch
from algo_helpers import make_sample

from slime_mt.errors import StepWiseError
from slime_mt.rollout.finalize import (
    finalize,
    merge_step_wise,
    sequence_metrics,
    to_concat_samples,
    to_step_wise_samples,
    validate_step_wise,
)
from slime_mt.types import Status, TrainingSample

P = [1, 2, 3]
TWO_TURNS = [([10, 11], [-0.1, -0.2], [20, 21]), ([12], [-0.3], [])]


def test_concat_one_per_trajectory():
    [t] = to_concat_samples([make_sample(P, TWO_TURNS, reward=0.5, group=4, index=9)])
    assert (t.prompt_ids, t.response_ids) == ([1, 2, 3], [10, 11, 20, 21, 12])
    assert t.loss_mask == [1, 1, 0, 0, 1]
    assert t.rollout_log_probs == [-0.1, -0.2, 0.0, 0.0, -0.3]
    assert (t.reward, t.group_id, t.trajectory_id, t.is_last_step) == (0.5, 4, "4/9", True)


def test_step_wise_one_per_turn():
    steps = to_step_wise_samples([make_sample(P, TWO_TURNS, reward=0.5)])
    assert [
        (s.prompt_ids, s.response_ids, s.loss_mask, s.rollout_log_probs, s.reward, s.is_last_step) for s in steps
    ] == [
        ([1, 2, 3], [10, 11], [1, 1], [-0.1, -0.2], 0.0, False),
        ([1, 2, 3, 10, 11, 20, 21], [12], [1], [-0.3], 0.5, True),
    ]


def test_step_wise_uses_rewritten_context():
    # turn 2's context dropped the first answer (history rewriting): prompt is what the model saw
    sample = make_sample(P, TWO_TURNS, contexts=[None, [1, 2, 3, 20, 21]])
    steps = to_step_wise_samples([sample])
    assert steps[1].prompt_ids == [1, 2, 3, 20, 21]
    merged = merge_step_wise(steps)
    assert len(merged) == 2  # not a prefix: no merge


@pytest.mark.parametrize(
    "name,trajectories,expected",
    [
        ("full merge", [TWO_TURNS], [([1, 2, 3], [10, 11, 20, 21, 12], [1, 1, 0, 0, 1], [-0.1, -0.2, 0.0, 0.0, -0.3])]),
        ("single step", [[([7], [-0.7], [])]], [([1, 2, 3], [7], [1], [-0.7])]),
        (
            "three turns",
            [[([10], [-0.1], [20]), ([11], [-0.2], [21, 22]), ([12], [-0.3], [])]],
            [([1, 2, 3], [10, 20, 11, 21, 22, 12], [1, 0, 1, 0, 0, 1], [-0.1, 0.0, -0.2, 0.0, 0.0, -0.3])],
        ),
        (
            "multi-trajectory",
            [TWO_TURNS, [([30], [-0.5], [40]), ([31], [-0.6], [])]],
            [
                ([1, 2, 3], [10, 11, 20, 21, 12], [1, 1, 0, 0, 1], [-0.1, -0.2, 0.0, 0.0, -0.3]),
                ([1, 2, 3], [30, 40, 31], [1, 0, 1], [-0.5, 0.0, -0.6]),
            ],
        ),
    ],
)
def test_merge_table(name, trajectories, expected):
    samples = [make_sample(P, t, index=i) for i, t in enumerate(trajectories)]
    steps = to_step_wise_samples(samples)
    validate_step_wise(steps)
    merged = merge_step_wise(steps)
    assert [(m.prompt_ids, m.response_ids, m.loss_mask, m.rollout_log_probs) for m in merged] == expected
    assert all(m.is_last_step for m in merged)
    assert [m.trajectory_id for m in merged] == [t.trajectory_id for t in to_concat_samples(samples)]


def test_partial_merge_after_retokenised_prefix():
    # turn 3's context re-tokenised turn 1's answer ([10, 11] -> [99]): turns 1+2 merge, turn 3 starts anew
    turns = [([10, 11], [-0.1, -0.2], [20]), ([12], [-0.3], [21]), ([13], [-0.4], [])]
    contexts = [None, None, [1, 2, 3, 99, 20, 12, 21]]
    steps = to_step_wise_samples([make_sample(P, turns, reward=2.0, contexts=contexts)])
    merged = merge_step_wise(steps)
    assert [
        (m.prompt_ids, m.response_ids, m.loss_mask, m.rollout_log_probs, m.is_last_step, m.reward) for m in merged
    ] == [
        ([1, 2, 3], [10, 11, 20, 12], [1, 1, 0, 1], [-0.1, -0.2, 0.0, -0.3], False, 0.0),
        ([1, 2, 3, 99, 20, 12, 21], [13], [1], [-0.4], True, 2.0),
    ]
    metrics = sequence_metrics(steps, merged)
    assert metrics == {
        "train/sequences_before_merge": 3,
        "train/sequences_after_merge": 2,
        "train/tokens_before_merge": 5 + 7 + 8,
        "train/tokens_after_merge": 7 + 8,
    }


def vlm_sample():
    pad = 151655
    # prompt has image 0 (4 pads), turn-1 observation adds image 1 (2 pads)
    sample = make_sample([1, pad, pad, pad, pad, 2], [([10], [-0.1], [3, pad, pad, 4]), ([11], [-0.2], [])])
    grid = torch.tensor([[1, 4, 4], [1, 2, 4]])  # 16 and 8 pixel rows -> 4 and 2 pads
    pixels = torch.arange(24 * 3, dtype=torch.float32).reshape(24, 3)
    sample.multimodal_train_inputs = {"pixel_values": pixels, "image_grid_thw": grid}
    sample.turns[0].num_images, sample.turns[1].num_images = 1, 2
    return sample, pixels, grid


def test_vlm_step_wise_slices_images_and_merge_keeps_last_context():
    sample, pixels, grid = vlm_sample()
    steps = to_step_wise_samples([sample])
    assert torch.equal(steps[0].multimodal_train_inputs["pixel_values"], pixels[:16])
    assert torch.equal(steps[0].multimodal_train_inputs["image_grid_thw"], grid[:1])
    assert torch.equal(steps[1].multimodal_train_inputs["pixel_values"], pixels)
    [merged] = merge_step_wise(steps)
    assert merged.response_ids == [10, 3, 151655, 151655, 4, 11] and merged.loss_mask == [1, 0, 0, 0, 0, 1]
    assert torch.equal(merged.multimodal_train_inputs["pixel_values"], pixels)
    assert torch.equal(merged.multimodal_train_inputs["image_grid_thw"], grid)


@pytest.mark.parametrize("shown, merged", [(1, False), (0, True)])
def test_merge_needs_the_same_images_not_only_the_same_tokens(shown, merged):
    """A GUI trajectory: screenshot A in the prompt, screenshot B (same size, so the same pad run)
    after turn 1. A context policy shows turn 2 only one screenshot, in the prompt's place: B
    (``shown=1``) gives turn 2 a context whose tokens extend turn 1's, but merging would train turn
    1's tokens against B's pixels, so the steps stay apart; A again (``shown=0``) merges."""
    pad = 151655
    context_2 = [1, pad, pad, pad, pad, 2, 10, 3, 4]  # the observation's screenshot moved into the prompt
    sample = make_sample(
        [1, pad, pad, pad, pad, 2],
        [([10], [-0.1], [3, pad, pad, pad, pad, 4]), ([11], [-0.2], [])],
        contexts=[None, context_2],
    )
    grid = torch.tensor([[1, 4, 4], [1, 4, 4]])  # 16 pixel rows -> 4 pads each
    pixels = torch.cat([torch.zeros(16, 3), torch.ones(16, 3)])  # A, then B
    sample.multimodal_train_inputs = {"pixel_values": pixels, "image_grid_thw": grid}
    sample.turns[0].num_images, sample.turns[1].num_images = 1, 2
    sample.turns[1].image_indices = [shown]
    steps = to_step_wise_samples([sample])
    assert steps[1].prompt_ids[: len(steps[0].prompt_ids) + 1] == steps[0].prompt_ids + steps[0].response_ids
    out = merge_step_wise(steps)
    assert len(out) == (1 if merged else 2)
    if merged:
        assert out[0].response_ids == [10, 3, 4, 11] and out[0].loss_mask == [1, 0, 0, 1]
        assert torch.equal(out[0].multimodal_train_inputs["pixel_values"], pixels[:16])
    else:
        assert [
            torch.equal(s.multimodal_train_inputs["pixel_values"], p) for s, p in zip(out, (pixels[:16], pixels[16:]))
        ] == [True, True]


@pytest.mark.parametrize(
    "status,mask_truncated,trainable",
    [
        (Status.FAILED, False, False),
        (Status.TRUNCATED, False, True),
        (Status.TRUNCATED, True, False),
        (Status.ABORTED, True, False),
        (Status.COMPLETED, True, True),
    ],
)
def test_failed_and_truncated_masking(status, mask_truncated, trainable):
    sample = make_sample(P, TWO_TURNS, status=status)
    for fmt, merge in (("concat", False), ("step_wise", False), ("step_wise", True)):
        out, _ = finalize([sample], fmt, merge, mask_truncated)
        assert (sum(sum(t.loss_mask) for t in out) > 0) == trainable, (fmt, merge)
        assert all(t.status == status for t in out)


def ts(tid, last, n=1):
    return TrainingSample([1], [2] * n, [1] * n, [0.0] * n, 0.0, tid, 0, last)


@pytest.mark.parametrize(
    "samples,message",
    [
        ([], "no step-wise samples"),
        ([ts("a", False)], "the last entry .* is not a last step"),
        ([ts("a", False), ts("b", True)], r"entry 0 \(trajectory a\): is_last_step=False but the trajectory ends here"),
        ([ts("a", True), ts("a", True)], r"entry 0 \(trajectory a\): is_last_step=True but the trajectory continues"),
        ([ts("a", True), ts("b", True), ts("a", True)], "steps of trajectory a are not contiguous"),
        ([dataclasses.replace(ts("a", True), loss_mask=[1, 1])], r"response 1, mask 2, log-probs 1, versions 1 differ"),
    ],
)
def test_validation_failures(samples, message):
    with pytest.raises(StepWiseError, match=message):
        validate_step_wise(samples)


def test_samples_without_turns_give_no_step_and_leave_their_groups_statistics():
    from slime_mt.algo.advantages import compute_advantages, group_advantages

    one = [([10], [-0.1], [])]
    failed = make_sample(P, [], reward=0.0, group=0, index=2, status=Status.FAILED)  # env reset raised
    exhausted = make_sample(P * 400, [], reward=0.0, group=1, index=3, status=Status.TRUNCATED)
    exhausted.metadata["termination"] = "context_exhausted"
    samples = [
        make_sample(P, one, reward=1.0, group=0, index=0),
        make_sample(P, one, reward=0.0, group=0, index=1),
        failed,
        exhausted,
        make_sample(P, one, reward=2.0, group=1, index=4),
        make_sample(P, one, reward=5.0, group=1, index=5),
    ]
    for merge in (False, True):
        out, metrics = finalize(samples, "step_wise", merge)
        assert [t.trajectory_id for t in out] == ["0/0", "0/1", "1/4", "1/5"]
        assert metrics["train/samples_without_turns"] == 2
        advantages = compute_advantages(out, "grpo")
        expected = group_advantages(torch.tensor([1.0, 0.0, 2.0, 5.0]), [0, 0, 1, 1], "grpo")
        assert advantages == pytest.approx(expected.tolist())
        assert advantages[2] == pytest.approx(-advantages[3])  # the exhausted sample's reward 0 is not in group 1
    with pytest.raises(StepWiseError, match="all 2 samples ended before their first turn"):
        finalize([failed, exhausted], "step_wise", False)
