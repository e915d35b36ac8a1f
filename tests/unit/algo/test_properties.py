"""Properties on random linear trajectories:
(a) merge(step_wise(x)) == concat(x) token for token;
(b) with token_mean and trajectory_mean, loss and gradient w.r.t. per-token log-probs are equal for
    concat, step-wise and merged data;
(c) the micro-batch split does not change the loss or the gradient."""

import torch
from algo_helpers import make_sample
from hypothesis import given, settings
from hypothesis import strategies as st

from slime_mt.algo.advantages import compute_advantages
from slime_mt.algo.batching import micro_batches_by_tokens, reduction_weights
from slime_mt.algo.losses import LossInputs, policy_loss
from slime_mt.config import AlgoConfig
from slime_mt.rollout.finalize import merge_step_wise, to_concat_samples, to_step_wise_samples, validate_step_wise

token = st.integers(min_value=5, max_value=500)
turn = st.tuples(st.lists(token, min_size=1, max_size=5), st.lists(token, min_size=0, max_size=4))
trajectory = st.tuples(
    st.lists(token, min_size=1, max_size=4),
    st.lists(turn, min_size=1, max_size=5),
    st.integers(min_value=0, max_value=3),
)
batch = st.lists(trajectory, min_size=1, max_size=6)


def build(raw):
    samples = []
    for i, (prompt, turns, reward) in enumerate(raw):
        spec = []
        for k, (out, obs) in enumerate(turns):
            last = k == len(turns) - 1
            spec.append((out, [-0.01 * (t % 97) for t in out], [] if last else obs))
        samples.append(make_sample(prompt, spec, reward=float(reward), group=i % 2, index=i))
    return samples


@settings(max_examples=60, deadline=None)
@given(batch)
def test_merge_of_step_wise_equals_concat(raw):
    samples = build(raw)
    steps = to_step_wise_samples(samples)
    validate_step_wise(steps)
    merged = merge_step_wise(steps)
    concat = to_concat_samples(samples)
    key = lambda t: (t.prompt_ids, t.response_ids, t.loss_mask, t.rollout_log_probs, t.reward, t.trajectory_id)  # noqa
    assert [key(m) for m in merged] == [key(c) for c in concat]


def loss_and_grad(train_samples, theta, mode, splits=None):
    """Loss over ``train_samples`` with current log-probs gathered from ``theta[trajectory][position]``
    -> (loss, d loss / d theta). ``splits``: micro-batches (index lists) summed separately."""
    advantages = compute_advantages(train_samples, "grpo")
    weights = reduction_weights(train_samples, mode)
    cfg = AlgoConfig(eps_clip=0.2, eps_clip_high=0.3, use_tis=True, tis_clip=1.5, tis_clip_low=0.5)
    splits = splits or [list(range(len(train_samples)))]
    for p in theta.values():
        p.grad = None
    total = 0.0
    for micro in splits:
        lps, olds, rolls, advs, ws, seqs = [], [], [], [], [], []
        for seq_index, i in enumerate(micro):
            s = train_samples[i]
            p = theta[s.trajectory_id]
            positions = torch.arange(len(s.prompt_ids), len(s.prompt_ids) + len(s.response_ids))
            lps.append(p[positions])
            olds.append(p.detach()[positions] + 0.05 * torch.cos(positions.float()))
            rolls.append(torch.tensor(s.rollout_log_probs))
            advs.append(torch.tensor(s.loss_mask, dtype=torch.float32) * advantages[i])
            ws.append(torch.tensor(weights[i]))
            seqs.append(torch.full((len(s.response_ids),), seq_index))
        x = LossInputs(
            torch.cat(lps), torch.cat(olds), torch.cat(rolls), torch.cat(advs), torch.cat(ws).float(), torch.cat(seqs)
        )
        loss, _ = policy_loss(x, cfg)
        loss.backward()
        total += float(loss.detach())
    return total, {k: p.grad.clone() for k, p in theta.items()}


def make_theta(samples):
    g = torch.Generator().manual_seed(0)
    return {
        f"{s.group_index}/{s.index}": (-torch.rand(len(s.tokens), generator=g) - 0.01).requires_grad_() for s in samples
    }


@settings(max_examples=40, deadline=None)
@given(batch, st.sampled_from(["token_mean", "trajectory_mean"]))
def test_loss_and_gradient_equal_across_formats(raw, mode):
    samples = build(raw)
    theta = make_theta(samples)
    concat = to_concat_samples(samples)
    steps = to_step_wise_samples(samples)
    merged = merge_step_wise(steps)
    results = [loss_and_grad(data, theta, mode) for data in (concat, steps, merged)]
    for loss, grads in results[1:]:
        assert abs(loss - results[0][0]) < 1e-6
        for k in grads:
            assert torch.allclose(grads[k], results[0][1][k], atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(
    batch,
    st.integers(min_value=1, max_value=40),
    st.sampled_from(["token_mean", "seq_mean_token_mean", "trajectory_mean"]),
)
def test_micro_batch_split_does_not_change_the_gradient(raw, budget, mode):
    samples = build(raw)
    theta = make_theta(samples)
    steps = to_step_wise_samples(samples)
    whole = loss_and_grad(steps, theta, mode)
    split = micro_batches_by_tokens([len(s.prompt_ids) + len(s.response_ids) for s in steps], budget)
    parts = loss_and_grad(steps, theta, mode, split)
    assert abs(whole[0] - parts[0]) < 1e-6
    for k in whole[1]:
        assert torch.allclose(whole[1][k], parts[1][k], atol=1e-6)
