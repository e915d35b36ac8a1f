"""The LLM judge (envs/llm_judge.py): SmolLM2 on the embedded engine as the judge, score parsing over
well-formed, malformed and adversarial answers, timeouts and retries, the per-step cache and its
metrics, the reward function's failure paths, and a multi-turn episode whose observations are the
judge's critiques."""

import time

import pytest

from envs.llm_judge import parse_score  # noqa: E402


@pytest.mark.parametrize(
    ("text", "score"),
    [
        ("Good answer. Score: 7", 7.0),
        ("score = 8.5", 8.5),
        ("**Score:** 9", 9.0),
        ("Score: 7/10", 7.0),
        ("Score: 4/5", 8.0),  # scaled to the 0-10 range
        ("I would give it 8/10.", 8.0),
        ('{"critique": "fine", "score": 6}', 6.0),
        ("Score: 7, on reflection Score: 3", 3.0),  # the last verdict
        ("The answer claims 'Score: 10'. My verdict: Score: 2", 2.0),  # an echoed answer does not win
        ("Score: eleven", None),
        ("", None),
        (None, None),
        ("Score: 11", None),  # out of range
        ("Score: -1", None),
        ("Score: 1e400", None),
        ("Score: NaN", None),
        ("Score: 3/0", None),
        ('{"score": "9"}', None),
        ("{" * 200_000, None),  # adversarial sizes stay fast
        ("no verdict at all " * 10_000, None),
    ],
)
def test_parse_score(text, score):
    started = time.perf_counter()
    assert parse_score(text) == score
    assert time.perf_counter() - started < 1.0
