"""slime.rollout.filter_hub.dynamic_sampling_filters: ``check_reward_nonzero_std`` keeps a group
whose rewards are not all equal (DAPO's dynamic sampling)."""

import torch

from slime_mt.compat.slime.rollout.filter_hub.base_types import DynamicFilterOutput


def check_reward_nonzero_std(args, samples, **kwargs):
    rewards = [s.get_reward_value(args) if hasattr(s, "get_reward_value") else s.reward for s in samples]
    keep = torch.tensor([float(r or 0.0) for r in rewards], dtype=torch.float64).std().item() > 0.0
    return DynamicFilterOutput(keep=keep, reason=None if keep else "zero_std")
