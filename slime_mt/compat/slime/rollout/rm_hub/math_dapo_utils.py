"""slime.rollout.rm_hub.math_dapo_utils: ``compute_score`` (DAPO's grade: the last ``Answer: ...`` in the
final 300 characters, normalised, against the label -> ``{"score": 1.0 or -1.0, "acc", "pred"}``), as
``--rm-type dapo`` grades. slime's ``strict_box_verify`` is not mapped."""

from slime_mt.rollout.rewards import dapo_reward

__all__ = ["compute_score"]


def compute_score(solution_str: str, ground_truth, strict_box_verify: bool = False, pause_tokens_index=None) -> dict:
    if strict_box_verify:
        raise NotImplementedError("slime_mt.compat: compute_score(strict_box_verify=True) is not mapped")
    return dapo_reward(solution_str, ground_truth, {})
