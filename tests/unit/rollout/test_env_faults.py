"""Recoverable environment faults (reset, replay, restart, the reset budget), env-declared tools,
per-turn rewards and DAPO's over-long shaping, on a real engine and tokenizer."""

import pytest

from slime_mt.rollout.rewards import overlong_penalty


@pytest.mark.parametrize(
    ("length", "expected"),
    [(0, 0.0), (12, 0.0), (13, -0.25), (14, -0.5), (16, -1.0), (40, -1.0)],
)
def test_overlong_penalty_by_hand(length, expected):
    # Lmax 16, buffer 4: free up to 12 tokens, then -1/4 per token, at most -factor
    assert overlong_penalty(length, 16, 4, 1.0) == pytest.approx(expected)
    assert overlong_penalty(length, 16, 4, 0.5) == pytest.approx(expected / 2)
    assert overlong_penalty(length, 16, 0, 1.0) == 0.0
