"""Loss terms against hand-computed values on small tensors, clip and TIS edges included."""

import dataclasses
import math

import pytest
import torch

from slime_mt.algo.batching import micro_batches_by_tokens, mini_batches_by_groups, reduction_weights
from slime_mt.algo.losses import LossInputs, kl_penalty, off_policy_weights, policy_loss, sft_loss
from slime_mt.config import AlgoConfig
from slime_mt.types import TrainingSample


def inputs(lp, old, adv, weights=None, seq=None, rollout=None, **kw):
    lp = torch.tensor(lp, requires_grad=True)
    n = lp.numel()
    return LossInputs(
        lp,
        torch.tensor(old),
        torch.tensor(rollout if rollout is not None else old),
        torch.tensor(adv),
        torch.tensor(weights if weights is not None else [1.0 / n] * n),
        torch.tensor(seq if seq is not None else [0] * n),
        **kw,
    )


def test_ppo_asymmetric_clip_by_hand():
    # ratios e^0.5=1.649 (clipped at 1.28 for A>0), e^-0.5=0.607 (clipped at 0.8 for A<0 -> max picks 0.8)
    x = inputs([0.5, -0.5, 0.1], [0.0, 0.0, 0.0], [1.0, -1.0, 2.0], weights=[1.0, 1.0, 1.0])
    cfg = AlgoConfig(eps_clip=0.2, eps_clip_high=0.28)
    loss, m = policy_loss(x, cfg)
    expected = -1.0 * 1.28 + (1.0 * 0.8) + -2.0 * math.exp(0.1)
    assert float(loss) == pytest.approx(expected, rel=1e-6)
    assert m["clip_fraction"] == 2.0  # tokens 0 and 1 clipped
    loss.backward()
    assert x.log_probs.grad.tolist() == pytest.approx([0.0, 0.0, -2.0 * math.exp(0.1)], rel=1e-6)


def test_dual_clip_caps_negative_advantage_loss():
    x = inputs([2.0], [0.0], [-1.0], weights=[1.0])  # ratio e^2 = 7.39; unbounded loss would be 7.39
    loss, _ = policy_loss(x, AlgoConfig(eps_clip=0.2, eps_clip_c=3.0))
    assert float(loss) == pytest.approx(3.0)


def test_gspo_uses_the_sequence_ratio():
    # seq 0: mean log-ratio (0.2 + 0.4)/2 = 0.3 -> ratio e^0.3 for both tokens; seq 1: e^-0.1
    x = inputs([0.2, 0.4, -0.1], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0], weights=[1.0, 1.0, 1.0], seq=[0, 0, 1])
    loss, _ = policy_loss(x, AlgoConfig(advantage_estimator="gspo", eps_clip=0.5, eps_clip_high=0.5))
    assert float(loss) == pytest.approx(-(2 * math.exp(0.3) + math.exp(-0.1)), rel=1e-6)
    loss.backward()
    assert x.log_probs.grad.tolist() == pytest.approx([-math.exp(0.3), -math.exp(0.3), -math.exp(-0.1)], rel=1e-6)


@pytest.mark.parametrize(
    "kind,expected",
    [
        ("k1", 0.5),
        ("k2", 0.125),
        ("k3", math.exp(-0.5) - 1 + 0.5),
        ("low_var_kl", math.exp(-0.5) - 1 + 0.5),
    ],
)
def test_kl_estimators(kind, expected):
    assert float(kl_penalty(torch.tensor([0.5]), torch.tensor([0.0]), kind)[0]) == pytest.approx(expected)


def test_only_low_var_kl_is_clamped_as_in_slime():
    far = (torch.tensor([-20.0]), torch.tensor([0.0]))  # log r = -20: k3 = e^20 - 21
    assert float(kl_penalty(*far, "k3")[0]) == pytest.approx(math.exp(20) - 21, rel=1e-6)
    assert float(kl_penalty(*far, "low_var_kl")[0]) == 10.0


def slime_gspo_tis_loss(lp, old, rollout, adv, weights, seq, eps, tis_clip):
    """slime's GSPO with TIS, from its formulas (not its code): per sequence the KL
    sum(mask * (old - lp)) / max(sum(mask), 1), expanded to the sequence's tokens; ratio = exp(-KL);
    the PPO-clipped loss per token, times clip(exp(old - rollout), 0, tis_clip); reduced by ``weights``."""
    mask = (weights > 0).to(lp.dtype)
    kl = torch.stack([((old - lp) * mask)[seq == s].sum() / mask[seq == s].sum().clamp_min(1) for s in seq.unique()])
    ratio = torch.exp(-kl[seq])
    loss = torch.maximum(-ratio * adv, -ratio.clamp(1 - eps, 1 + eps) * adv)
    return (loss * torch.exp(old - rollout).clamp(0, tis_clip) * weights).sum()


def test_gspo_with_tis_takes_slimes_gradient_with_gspo_gradient_sequence():
    """Two sequences whose tokens carry different TIS weights. With --gspo-gradient sequence the loss
    and every token's gradient are slime's; GSPO-token (the default) has the same loss, but each token's
    gradient carries its own TIS weight where slime's carries its sequence's mean weight."""
    lp = [-1.0, -0.7, -1.2, -0.4, -2.0]
    old = [-1.1, -0.6, -1.2, -0.5, -1.9]
    rollout = [-1.4, -0.5, -1.0, -0.5, -2.3]  # TIS weights exp(old - rollout) vary within a sequence
    adv, seq, weights = [1.0, 1.0, 1.0, -0.5, -0.5], [0, 0, 0, 1, 1], [0.2] * 5
    cfg = AlgoConfig(advantage_estimator="gspo", eps_clip=0.3, use_tis=True, tis_clip=2.0)

    def grad(loss_of):
        x = inputs(lp, old, adv, weights=weights, seq=seq, rollout=rollout)
        loss = loss_of(x)
        loss.backward()
        return float(loss), x.log_probs.grad

    t = {k: torch.tensor(v) for k, v in dict(old=old, rollout=rollout, adv=adv, weights=weights).items()}
    slime_loss, slime_grad = grad(
        lambda x: slime_gspo_tis_loss(x.log_probs, t["old"], t["rollout"], t["adv"], t["weights"], x.seq_ids, 0.3, 2.0)
    )
    sequence_loss, sequence_grad = grad(lambda x: policy_loss(x, dataclasses.replace(cfg, gspo_gradient="sequence"))[0])
    token_loss, token_grad = grad(lambda x: policy_loss(x, cfg)[0])
    assert sequence_loss == pytest.approx(slime_loss, rel=1e-6) and token_loss == pytest.approx(slime_loss, rel=1e-6)
    assert torch.allclose(sequence_grad, slime_grad, rtol=1e-6, atol=1e-8)
    assert not torch.allclose(token_grad, slime_grad, rtol=1e-3)
    # GSPO-token by hand: token k gets -A * r_seq * w_k * tis_k; slime's gives every token the mean of w * tis
    tis = torch.exp(t["old"] - t["rollout"]).clamp(0, 2.0)
    r = torch.exp(torch.tensor([sum(a - b for a, b in zip(lp[:3], old[:3])) / 3, (0.1 + -0.1) / 2]))
    assert torch.allclose(token_grad, -t["adv"] * r[torch.tensor(seq)] * t["weights"] * tis, rtol=1e-5)
    assert torch.allclose(sequence_grad[:3], (-r[0] * (t["weights"] * tis)[:3].mean()).expand(3), rtol=1e-5)


def test_kl_and_entropy_terms_enter_the_loss():
    x = inputs([0.0], [0.0], [0.0], weights=[1.0], ref_log_probs=torch.tensor([-0.5]), entropy=torch.tensor([2.0]))
    loss, m = policy_loss(x, AlgoConfig(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k1", entropy_coef=0.01))
    assert float(loss) == pytest.approx(0.1 * 0.5 - 0.01 * 2.0)
    assert m["kl"] == pytest.approx(0.5)


def test_token_tis_clips_weights_at_both_ends():
    # old - rollout = [1.0, -3.0, 0.0] -> raw weights e, e^-3, 1 -> clipped to [2.0, 0.1, 1.0]
    mask = torch.ones(3)
    w, keep, m = off_policy_weights(
        torch.tensor([1.0, -3.0, 0.0]), torch.zeros(3), mask, torch.zeros(3, dtype=torch.long), 1, "token", 0.1, 2.0
    )
    assert w.tolist() == pytest.approx([2.0, 0.1, 1.0])
    assert m["tis_weight_max"] == pytest.approx(2.0) and m["tis_weight_min"] == pytest.approx(0.1)
    assert m["tis_clipped_fraction"] == pytest.approx(2 / 3) and m["tis_masked_fraction"] == 0.0


def test_sequence_tis_and_masks():
    log_w = torch.tensor([0.5, 0.5, -0.2])
    seq = torch.tensor([0, 0, 1])
    w, _, m = off_policy_weights(log_w, torch.zeros(3), torch.ones(3), seq, 2, "sequence", 0.0, 2.0)
    assert w.tolist() == pytest.approx([2.0, 2.0, math.exp(-0.2)])  # e^1 = 2.72 clipped to 2
    assert m["tis_clipped_fraction"] == pytest.approx(2 / 3)  # both tokens of the clipped sequence
    w, keep, m = off_policy_weights(log_w, torch.zeros(3), torch.ones(3), seq, 2, "token_mask", 0.9, 1.5)
    assert keep.tolist() == [0.0, 0.0, 0.0]  # e^0.5 = 1.65 > 1.5; e^-0.2 = 0.82 < 0.9
    assert m["tis_clipped_fraction"] == m["tis_masked_fraction"] == 1.0
    w, keep, m = off_policy_weights(log_w, torch.zeros(3), torch.ones(3), seq, 2, "geo_mean_mask", 0.8, 1.5)
    assert keep.tolist() == [0.0, 0.0, 1.0] and m["tis_masked_fraction"] == pytest.approx(2 / 3)


def test_tis_multiplies_the_policy_gradient():
    x = inputs([0.0, 0.0], [0.0, 0.0], [1.0, 1.0], weights=[0.5, 0.5], rollout=[-1.0, 0.0])
    loss, m = policy_loss(x, AlgoConfig(use_tis=True, tis_clip=2.0))
    assert float(loss) == pytest.approx(-(0.5 * 2.0 + 0.5 * 1.0))
    assert m["train_rollout_logprob_abs_diff"] == pytest.approx(0.5)
    assert m["train_rollout_logprob_abs_diff_max"] == 1.0  # the largest gap, unweighted


def test_sft_loss_is_weighted_nll():
    x = inputs([-1.0, -3.0], [0.0, 0.0], [0.0, 0.0], weights=[0.5, 0.5])
    loss, _ = sft_loss(x)
    assert float(loss) == pytest.approx(2.0)


def sample(n_mask, tid, group=0):
    return TrainingSample([1], [2] * len(n_mask), list(n_mask), [0.0] * len(n_mask), 0.0, tid, group, True)


def test_reduction_weights_by_hand():
    batch = [sample([1, 1, 0], "a"), sample([1, 1, 1, 1], "b"), sample([0, 0], "c")]
    assert reduction_weights(batch, "token_mean") == [[1 / 6, 1 / 6, 0.0], [1 / 6] * 4, [0.0, 0.0]]
    assert reduction_weights(batch, "seq_mean_token_mean") == [[1 / 4, 1 / 4, 0.0], [1 / 8] * 4, [0.0, 0.0]]
    assert reduction_weights(batch, "seq_mean_token_sum_norm", max_len=10) == [
        [1 / 20, 1 / 20, 0.0],
        [1 / 20] * 4,
        [0.0, 0.0],
    ]
    steps = [sample([1], "t1"), sample([1, 1, 1], "t1"), sample([1, 1], "t2")]
    assert reduction_weights(steps, "trajectory_mean") == [[1 / 8], [1 / 8] * 3, [1 / 4] * 2]


def test_mini_batches_take_whole_groups_and_micro_batches_respect_budget():
    batch = [sample([1], str(i), group=g) for i, g in enumerate([0, 0, 1, 1, 1, 2, 3, 3])]
    assert mini_batches_by_groups(batch, 2) == [[0, 1, 2, 3, 4], [5, 6, 7]]
    assert micro_batches_by_tokens([5, 3, 8, 2, 9], 10) == [[4], [2, 3], [0, 1]]
    assert micro_batches_by_tokens([12], 10) == [[0]]
