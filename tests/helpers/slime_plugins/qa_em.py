"""Exact-match scoring of a Search-R1 style answer (a sibling module, imported as slime's examples do)."""

import re
import string


def normalize_answer(text: str) -> str:
    text = "".join(c for c in text.lower() if c not in string.punctuation)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def extract_answer(response: str) -> str | None:
    found = re.findall(r"<answer>(.*?)</answer>", response, re.DOTALL)
    return found[-1].strip() if found else None


def em_score(response: str, golden_answers: list[str]) -> float:
    answer = extract_answer(response)
    if answer is None:
        return 0.0
    return float(any(normalize_answer(answer) == normalize_answer(g) for g in golden_answers))
