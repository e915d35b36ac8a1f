"""The example's judge parser (``--judge-parser-path examples/judge_feedback/parse.py:score``): a
135M judge seldom ends with the rubric's "Score: N", so its verdict in words counts too. With a
judge that follows the rubric, leave the flag unset (the default reads "Score: N", "N/10" or JSON)."""

import re

from envs.llm_judge import parse_score

_WRONG = re.compile(r"\b(incorrect|wrong|not (?:correct|right)|mistaken?|error)\b")
_RIGHT = re.compile(r"\b(correct|right)\b")


def score(text: str) -> float | None:
    """The rubric's score when the judge wrote one; else "wrong" (or a negated "correct") -> 0 and
    "correct" -> 10; None (unparseable: the call is tried again) when it says neither."""
    found = parse_score(text)
    if found is not None:
        return found
    lowered = text.lower()
    if _WRONG.search(lowered):
        return 0.0
    if _RIGHT.search(lowered):
        return 10.0
    return None
