"""What a step's failed and truncated samples show: the lines, the step summary, errors.jsonl, and
the warnings for steps that teach nothing."""

import json
import logging

from slime_mt.rollout.failures import LINES_PER_CAUSE, StepReport, fail
from slime_mt.types import Sample, Status, Turn


def sample(index: int, group: int, status=Status.COMPLETED, reward=0.0, finish="stop", **metadata) -> Sample:
    s = Sample(index=index, group_index=group, tokens=[1, 2, 3], status=status, reward=reward, metadata=metadata)
    s.turns.append(Turn(output_start=3, output_end=3, observation_end=3, finish_reason=finish))
    return s


def failed(index: int, group: int, error: Exception, cause: str) -> Sample:
    s = sample(index, group)
    try:
        raise error
    except Exception as e:
        fail(s, cause, f"{cause}: {e}", e)
    return s


def test_failures_log_one_line_each_up_to_the_limit_then_a_count(tmp_path, caplog):
    groups = [
        [failed(k, 0, ValueError("boom"), "env step raised ValueError") for k in range(LINES_PER_CAUSE + 2)],
        [failed(9, 1, KeyError("x"), "reward raised KeyError"), sample(10, 1, reward=1.0)],
        [sample(11, 2, Status.TRUNCATED, termination="engine_length", finish="length"), sample(12, 2)],
    ]
    report = StepReport(4, groups)
    with caplog.at_level(logging.INFO, logger="slime_mt.failures"):
        report.log(tmp_path / "errors.jsonl")
    messages = [r.getMessage() for r in caplog.records]
    assert messages[: LINES_PER_CAUSE + 1] == [
        f"step 4: sample {k} (group 0) failed at turn 1: env step raised ValueError: boom"
        for k in range(LINES_PER_CAUSE)
    ] + ["step 4: sample 9 (group 1) failed at turn 1: reward raised KeyError: 'x'"]
    assert (
        "step 4: sample 11 (group 2) truncated at turn 0: turn hit the length limit (--rollout-max-response-len, "
        "or what --rollout-max-context-len left)" in messages
    )
    assert "step 4: ... and 2 more: failed: env step raised ValueError" in messages
    assert report.line() == (
        "6 failed: env step raised ValueError x5, reward raised KeyError x1 | 1 truncated: turn hit the length limit x1"
    )
    assert not report.all_failed
    rows = [json.loads(line) for line in (tmp_path / "errors.jsonl").read_text().splitlines()]
    assert [(r["step"], r["sample"], r["group"], r["cause"]) for r in rows] == [
        (4, k, 0, "env step raised ValueError") for k in range(5)
    ] + [(4, 9, 1, "reward raised KeyError")]
    assert "raise error" in rows[0]["traceback"] and "ValueError: boom" in rows[0]["traceback"]


def test_a_step_of_equal_rewards_or_cut_turns_warns_and_a_good_one_does_not(caplog):
    equal = [[sample(0, 0, reward=1.0), sample(1, 0, reward=1.0)], [sample(2, 1), sample(3, 1)]]
    cut = [[sample(k, 0, Status.TRUNCATED, reward=k, finish="length", termination="engine_length") for k in range(3)]]
    good = [[sample(0, 0, reward=1.0), sample(1, 0, reward=0.0)], [sample(2, 1), sample(3, 1)]]
    with caplog.at_level(logging.WARNING, logger="slime_mt.failures"):
        StepReport(0, equal).log()
        assert [r.getMessage().split(":")[0:2] for r in caplog.records] == [
            ["step 0", " every group's rewards are equal within the group (0, 1)"]
        ]
        caplog.clear()
        StepReport(1, cut).log()
        assert [r.getMessage() for r in caplog.records] == [
            "step 1: 3 of 3 turns ended at the length limit (finish_reason length), so the env saw few finished "
            "answers: raise --rollout-max-response-len or check the stop tokens (--rollout-stop, "
            "--rollout-stop-token-ids)"
        ]
        caplog.clear()
        StepReport(2, good).log()
        assert caplog.records == []
    assert StepReport(3, [[failed(0, 0, OSError("down"), "engine error")]]).all_failed
