"""Each data-parallel rank's share of a step (``split_by_dp``): the shares partition the batch, whole
prompt groups each, dealt round robin per mini-batch, with every token's weight from its whole
mini-batch, so DP ranks that train their shares sum to the step a single rank trains. Unit tier,
about 1 s (hypothesis, 60 examples)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slime_mt.algo.batching import REDUCTIONS, mini_batches_by_groups, reduction_weights, split_by_dp
from slime_mt.types import TrainingSample


def _sample(group: int, n: int, trainable: bool, tid: str) -> TrainingSample:
    mask = [1 if trainable and k % 3 else 0 for k in range(n)]
    return TrainingSample([1, 2], [5] * n, mask, [0.0] * n, 0.0, tid, group, True)


batches = st.lists(
    st.tuples(st.integers(0, 5), st.integers(1, 6), st.booleans()), min_size=1, max_size=14
)  # (group, response length, trainable) in arrival order: a group's samples may interleave with others'


@settings(max_examples=60, deadline=None)
@given(batches, st.integers(1, 4), st.integers(1, 4), st.sampled_from(REDUCTIONS))
def test_the_shares_partition_the_batch_by_whole_groups_with_the_mini_batchs_weights(raw, dp, per_step, reduction):
    samples = [_sample(g, n, t, f"t{g}-{k % 2}") for k, (g, n, t) in enumerate(raw)]
    advantages = [float(k) for k in range(len(samples))]
    shares = split_by_dp(samples, advantages, per_step, dp, reduction, max_len=8)
    assert len(shares) == dp
    assert sorted(i for s in shares for i in s.indices) == list(range(len(samples)))  # each sample once
    mini_batches = mini_batches_by_groups(samples, per_step)
    for m, mb in enumerate(mini_batches):
        weights = dict(zip(mb, reduction_weights([samples[i] for i in mb], reduction, 8)))
        groups = list(dict.fromkeys(samples[i].group_id for i in mb))
        for rank, share in enumerate(shares):
            mine = [share.indices[k] for k in share.of_mini_batch(m)]
            assert mine == [i for i in mb if groups.index(samples[i].group_id) % dp == rank]  # round robin, in order
            for k in share.of_mini_batch(m):
                i = share.indices[k]
                assert share.samples[k] is samples[i] and share.advantages[k] == advantages[i]
                assert share.weights[k] == weights[i]  # the whole mini-batch's weight, not the share's
    for share in shares:
        assert share.mini_batches == len(mini_batches)
        assert share.trainable == any(s.num_trainable for s in samples)
    if dp == 1:
        assert sorted(shares[0].indices) == list(range(len(samples)))


def test_token_advantages_broadcast_a_scalar_and_keep_a_train_side_estimators_per_token_ones():
    """A group estimator's scalar on every trained token; an estimator on the train ranks sets one per
    response token (values, a teacher's log-probs), kept where the loss mask is 1; a length that does not
    fit names the sample."""
    samples = [
        TrainingSample([1, 2], [3, 4, 5], [1, 0, 1], [-1.0] * 3, 1.0, "0/0", 0, True),
        TrainingSample([1, 2], [6, 7], [1, 1], [-1.0] * 2, 0.0, "0/1", 0, True),
    ]
    share = split_by_dp(samples, [0.5, -0.5], 1, dp_size=1, loss_reduction="token_mean")[0]
    assert [share.token_advantages(k) for k in range(2)] == [[0.5, 0.0, 0.5], [-0.5, -0.5]]
    share.advantages = [[0.25, 9.0, -0.75], [1.0, 2.0]]
    assert [share.token_advantages(k) for k in range(2)] == [[0.25, 0.0, -0.75], [1.0, 2.0]]
    share.advantages[1] = [1.0]
    with pytest.raises(ValueError, match="sample 1: 1 per-token advantages for 2 response tokens"):
        share.token_advantages(1)
