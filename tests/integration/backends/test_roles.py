"""A role beside the policy on the same ranks (integration tier; read from the TP=2 world, ~10 s of it): a
second trainable model, a toy value head (``megatron_checks/train.py``'s ``ToyValueHead``: a
``MegatronModel`` with a head, scored with ``scoring.Values``), sets per-token advantages in the train role
before the policy's step and trains in the same step, through ``roles/train.Estimator`` and no line of
``backends/megatron/actor.py``."""


def test_a_toy_value_head_trains_beside_the_policy_and_sets_its_advantages(world):
    r = world("tp2")["value_head"]
    first, second, third = r["value_loss"]
    assert first == 0.5  # a zeroed head against rewards 0 and 1, token-mean squared error
    assert first > second > third, r["value_loss"]  # its loss falls over 3 steps
    assert all(norm > 0 for norm in r["critic_grad_norm"]) and r["head_trainable"] and r["head_weight_norm"] > 0
    # every scalar advantage was 0 and the policy has no entropy term: it trained on the head's advantages
    assert all(norm > 0 for norm in r["policy_grad_norm"]) and r["policy_moved"] == 24
    assert all(lengths == r["response_lengths"] for lengths in r["advantage_lengths"])  # one per response token
    assert r["advantages_vary"]  # per token, not a scalar broadcast, once the head has learned
