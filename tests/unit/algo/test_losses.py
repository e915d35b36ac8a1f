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


@pytest.mark.parametrize("mode", ["token", "sequence", "token_mask", "geo_mean_mask"])
def test_tis_over_an_untrained_token_without_a_rollout_log_prob_is_the_loss_without_it(mode):
    """A sample none of whose tokens is trained may come without rollout log-probs (NaN): TIS weighs its
    tokens 1 and the loss is what it is with any value there (it was NaN: NaN * 0 is NaN)."""
    cfg = AlgoConfig(use_tis=True, tis_mode=mode, tis_clip_low=0.5, tis_clip=2.0)
    kw = dict(weights=[0.5, 0.5, 0.0], seq=[0, 0, 1])
    loss, m = policy_loss(
        inputs([-0.2, -0.1, -0.3], [0.0, 0.0, -0.3], [1.0, 1.0, 1.0], rollout=[-0.5, 0.0, math.nan], **kw), cfg
    )
    same, m_same = policy_loss(
        inputs([-0.2, -0.1, -0.3], [0.0, 0.0, -0.3], [1.0, 1.0, 1.0], rollout=[-0.5, 0.0, 4.0], **kw), cfg
    )
    assert math.isfinite(float(loss)) and float(loss) == float(same)
    assert {k: v for k, v in m.items() if "rollout" not in k} == {k: v for k, v in m_same.items() if "rollout" not in k}


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


# the decoupled objective: a batch trained at version 2 with tokens of three behaviour versions. Each
# token: (current log-prob, proximal = the trainer's at the step's start, behaviour = the engine's when
# it generated the token, its version, advantage). Version 2's tokens are fresh (behaviour = proximal up
# to the engine's noise), the older ones drift further; token 4's weight e^1.8 is past the cap of 5.
DECOUPLED = [
    (-1.00, -1.10, -1.10, 2, 1.0),
    (-0.50, -0.70, -0.60, 1, 1.0),
    (-2.00, -1.60, -1.90, 0, -0.5),  # ratio e^-0.4: clipped at 0.8 for A < 0
    (-0.30, -0.40, -0.45, 2, 2.0),
    (-1.20, -1.20, -3.00, 0, 1.0),  # w = e^1.8 = 6.05 > 5: no loss
    (-0.90, -0.80, -0.20, 1, -1.0),  # w = e^-0.6, (log w)^2 = 0.36: M2PO's largest kept
]


def _decoupled_by_hand(cutoff: float | None, cap: float = 5.0, low: float = 0.2, high: float = 0.2):
    """AReaL's decoupled PPO, token by token in floats: loss sum_t w_t * max(-A r_t, -A clip(r_t)) / n
    with r_t = pi_theta / pi_prox and w_t = pi_prox / pi_behav, 0 where w_t > cap or (log w_t)^2 >
    cutoff; the gradient in the current log-prob is -A r_t w_t / n where the clip does not bind."""
    n = len(DECOUPLED)
    loss, grad = 0.0, []
    for lp, prox, behav, _version, adv in DECOUPLED:
        r = math.exp(lp - prox)
        log_w = prox - behav
        w = math.exp(log_w)
        kept = w <= cap and (cutoff is None or log_w**2 <= cutoff)
        clipped = min(max(r, 1 - low), 1 + high)
        pg = max(-adv * r, -adv * clipped)
        loss += (w * pg / n) if kept else 0.0
        grad.append(-adv * r * w / n if kept and -adv * r >= -adv * clipped else 0.0)
    return loss, grad


def _decoupled_inputs(cutoff=None):
    lp, prox, behav, _, adv = zip(*DECOUPLED)
    return inputs(list(lp), list(prox), list(adv), rollout=list(behav), seq=[0, 0, 0, 1, 1, 1], m2po_cutoff=cutoff)


@pytest.mark.parametrize("cutoff", [None, 0.05])
def test_the_decoupled_loss_and_gradient_by_hand_over_three_versions(cutoff):
    """Loss and gradient of the decoupled objective against the hand computation, without M2PO and with
    a cutoff that also drops token 5 ((log w)^2 = 0.36) and token 2 (0.09)."""
    x = _decoupled_inputs(cutoff)
    loss, m = policy_loss(x, AlgoConfig(use_decoupled_loss=True, behav_imp_weight_cap=5.0))
    expected, grad = _decoupled_by_hand(cutoff)
    assert float(loss) == pytest.approx(expected, rel=1e-6)
    loss.backward()
    assert x.log_probs.grad.tolist() == pytest.approx(grad, rel=1e-6, abs=1e-9)
    n = len(DECOUPLED)
    assert m["behav_capped_fraction"] == pytest.approx(1 / n)
    assert m["m2po_masked_fraction"] == pytest.approx(0.0 if cutoff is None else 2 / n)
    log_w = [prox - behav for _, prox, behav, _, _ in DECOUPLED]
    assert m["behav_log_weight_second_moment"] == pytest.approx(sum(v * v for v in log_w) / n, rel=1e-6)
    assert m["behav_weight_mean"] == pytest.approx(sum(math.exp(v) for v in log_w) / n, rel=1e-6)


def test_the_decoupled_loss_on_fresh_tokens_is_the_plain_ppo_loss():
    """Every token of the current version, its behaviour log-prob the proximal one: weight 1, so the
    objective on is the objective off, loss and gradient bit for bit."""
    lp, prox, _, _, adv = zip(*DECOUPLED)
    on = inputs(list(lp), list(prox), list(adv), rollout=list(prox))
    off = inputs(list(lp), list(prox), list(adv), rollout=list(prox))
    loss_on, _ = policy_loss(on, AlgoConfig(use_decoupled_loss=True, behav_imp_weight_cap=5.0))
    loss_off, _ = policy_loss(off, AlgoConfig())
    assert float(loss_on) == float(loss_off)
    loss_on.backward()
    loss_off.backward()
    assert on.log_probs.grad.tolist() == off.log_probs.grad.tolist()


def _m2po_by_hand(values: list[float], threshold: float) -> float | None:
    """The largest kept value: drop the largest values until the mean of the rest is <= threshold."""
    kept = sorted(values)
    if sum(kept) <= threshold * len(kept):
        return None
    while kept and sum(kept) > threshold * len(kept):
        top = kept[-1]
        kept = [v for v in kept if v != top]  # ties go together
    return kept[-1] if kept else 0.0


@pytest.mark.parametrize("seed", range(4))
def test_m2po_cutoff_keeps_exactly_the_tokens_the_definition_keeps(seed):
    from slime_mt.algo.losses import m2po_cutoff

    g = torch.Generator().manual_seed(seed)
    values = (torch.randn(200, generator=g, dtype=torch.float64) * 0.3).square()
    values[:5] = values[5]  # ties
    cutoff = m2po_cutoff(values, 0.04)
    expected = _m2po_by_hand(values.tolist(), 0.04)
    assert (values <= cutoff).tolist() == [v <= expected for v in values.tolist()]
    kept = values[values <= cutoff]
    assert float(kept.mean()) <= 0.04
    assert m2po_cutoff(values, float(values.mean()) + 1e-9) is None  # within the bound: nothing masked
    assert m2po_cutoff(values[:0], 0.04) is None


@pytest.mark.parametrize("tis", [False, True])
def test_with_the_decoupled_loss_off_the_new_inputs_change_nothing(tis):
    """The objective off is today's loss: the same inputs with a step's M2PO cutoff and the decoupled
    options set (but not switched on) give the same loss, gradient and metrics as without them."""
    lp, prox, behav, _, adv = zip(*DECOUPLED)
    plain = inputs(list(lp), list(prox), list(adv), rollout=list(behav))
    extra = inputs(list(lp), list(prox), list(adv), rollout=list(behav), m2po_cutoff=0.01)
    today = AlgoConfig(use_tis=tis)
    loss_a, m_a = policy_loss(plain, today)
    loss_b, m_b = policy_loss(extra, dataclasses.replace(today, behav_imp_weight_cap=1.5, m2po_threshold=0.01))
    assert float(loss_a) == float(loss_b) and m_a == m_b
    assert not any(k.startswith(("behav_", "m2po_")) for k in m_a)
    loss_a.backward()
    loss_b.backward()
    assert plain.log_probs.grad.tolist() == extra.log_probs.grad.tolist()


def test_loglinear_proximal_log_probs_and_the_loss_by_hand():
    """--prox-logp-method loglinear (AReaL's): no recomputed proximal log-probs; trained at version 2,
    a = (2 - v) / (3 - v) is 0, 1/2 and 2/3 for versions 2, 1 and 0 and log pi_prox = log pi_behav +
    a (log pi_theta - log pi_behav); the decoupled loss and its gradient then as by hand with those
    (the proximal is a constant: the gradient does not flow through it). A token without a version
    keeps its behaviour log-prob; the flag without versions is refused by name."""
    from slime_mt.algo.losses import loglinear_proximal

    lp, _, behav, versions, adv = zip(*DECOUPLED)
    alphas = {2: 0.0, 1: 0.5, 0: 2 / 3}
    prox = [b + alphas[v] * (c - b) for c, b, v in zip(lp, behav, versions)]
    x = inputs(list(lp), [0.0] * len(lp), list(adv), rollout=list(behav), seq=[0, 0, 0, 1, 1, 1])
    x = dataclasses.replace(x, token_versions=torch.tensor(versions), proximal_version=2)
    assert loglinear_proximal(x).tolist() == pytest.approx(prox, rel=1e-6)
    cfg = AlgoConfig(use_decoupled_loss=True, behav_imp_weight_cap=5.0, prox_logp_method="loglinear")
    loss, m = policy_loss(x, cfg)
    n, expected, grad = len(lp), 0.0, []
    for c, p, b, a in zip(lp, prox, behav, adv):
        r, w = math.exp(c - p), math.exp(p - b)
        clipped = min(max(r, 0.8), 1.2)
        kept = w <= 5.0
        expected += w * max(-a * r, -a * clipped) / n if kept else 0.0
        grad.append(-a * r * w / n if kept and -a * r >= -a * clipped else 0.0)
    assert float(loss) == pytest.approx(expected, rel=1e-6)
    loss.backward()
    assert x.log_probs.grad.tolist() == pytest.approx(grad, rel=1e-6, abs=1e-9)
    # token 4's proximal lies two thirds of the way to the current policy: w = e^1.2 = 3.32, under the cap
    assert m["behav_capped_fraction"] == 0.0
    unversioned = dataclasses.replace(x, token_versions=torch.tensor([-1] * n))
    assert loglinear_proximal(unversioned).tolist() == pytest.approx(list(behav))
    with pytest.raises(ValueError, match="--prox-logp-method loglinear needs the weight version"):
        policy_loss(dataclasses.replace(x, token_versions=None), cfg)
