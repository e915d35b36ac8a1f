"""slime.rollout.rm_hub.math_utils: ``extract_answer`` (the last ``\\boxed{}``'s content, or None) and
``grade_answer_verl`` (that answer against the label, by math-verify as ``--rm-type math`` grades;
slime's own normalisation is mathd's then sympy's, so a rare pair may grade otherwise)."""

from slime_mt.rollout.rewards import last_boxed, math_equal

__all__ = ["extract_answer", "extract_boxed_answer", "grade_answer_verl"]


def extract_boxed_answer(solution: str) -> str | None:
    return last_boxed(solution)


def extract_answer(passage: str) -> str | None:
    return last_boxed(passage) if "\\boxed" in passage else None


def grade_answer_verl(solution_str: str, ground_truth) -> bool:
    """slime's order: no label -> False; a boxed label is unboxed; no boxed answer -> False."""
    if not ground_truth:
        return False
    ground_truth = str(ground_truth)
    if "\\boxed" in ground_truth:
        ground_truth = extract_answer(ground_truth) or ""
    given = extract_answer(solution_str)
    return given is not None and math_equal(f"\\boxed{{{given}}}", ground_truth)
