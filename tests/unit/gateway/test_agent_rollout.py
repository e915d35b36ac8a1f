"""rollouts.agent.generate on its own: what an agent returns, raises or overruns becomes the sample's
reward, metrics or failure, and nothing it started outlives it."""

import pytest

from rollouts.agent import parse_result


def test_parse_result_takes_the_last_line_that_is_a_reward():
    assert parse_result("0.5") == 0.5
    assert parse_result('starting\n{"reward": 1}\n') == {"reward": 1}
    with pytest.raises(Exception, match="no reward JSON"):
        parse_result("true\n")
