"""geo3k: answer grading, the env's tool turns and final reward, and data preparation."""

import pytest

from envs.geo3k import Geo3kEnv, grade, last_boxed, to_number


@pytest.mark.parametrize(
    "candidate,reference,expected",
    [
        ("5", "5", 1.0),
        ("5.0", "5", 1.0),
        ("\\frac{7}{2}", "3.5", 1.0),
        ("3\\sqrt{2}", "4.24", 1.0),
        ("2\\sqrt{13}", "7.21", 1.0),
        ("12\\pi", "37.70", 1.0),
        ("45^\\circ", "45", 1.0),
        ("x = 8", "8", 1.0),
        ("\\dfrac{1}{3}", "0.333", 1.0),
        # math-verify's gains over the hand-written grader, which read \frac{\sqrt{3}}{2} as sqrt(3)*2:
        ("\\frac{\\sqrt{3}}{2}", "0.87", 1.0),
        ("\\frac{\\sqrt{3}}{2}", "3.46", 0.0),
        ("\\frac{5\\sqrt{2}}{2}", "3.54", 1.0),
        ("\\frac{1}{\\sqrt{2}}", "0.71", 1.0),
        ("\\sqrt[3]{27}", "3", 1.0),
        ("8 \\text{ cm}", "8", 1.0),
        ("2^{\\frac{1}{2}}", "1.41", 1.0),
        ("6", "5", 0.0),
        ("banana", "5", 0.0),
        (None, "5", 0.0),
    ],
)
def test_grading(candidate, reference, expected):
    assert grade(candidate, reference) == expected


def test_boxed_and_numbers():
    assert last_boxed("first \\boxed{1} then \\boxed{\\frac{3}{4}}.") == "\\frac{3}{4}"
    assert last_boxed("no box") is None
    assert to_number("2(3+1)") == 8.0


def test_env_tool_turns_and_final_reward():
    env = Geo3kEnv("59")
    obs, done, info = env.step(
        'Let me check. <tool_call>{"name": "calc_score", "arguments": {"answer": "60"}}</tool_call>'
    )
    assert not done and "incorrect" in obs["text"] and info["reward"] == 0.0
    assert env.format_observation(obs)["role"] == "tool"
    obs, done, info = env.step('<tool_call>{"name": "calc_score", "arguments": {"answer": "59"}}</tool_call>')
    assert not done and "is correct" in obs["text"] and info["reward"] == 0.0  # tool feedback is not the reward
    obs, done, info = env.step("So x = \\boxed{59}.")
    assert done and info["reward"] == 1.0
    assert (
        Geo3kEnv("59", tool_reward=True).step(
            '<tool_call>{"name": "calc_score", "arguments": {"answer": "59"}}</tool_call>'
        )[2]["reward"]
        == 1.0
    )
    obs, done, info = Geo3kEnv("59").step("I think it is 58.")
    assert not done and "boxed" in obs["text"]


def test_synthetic_answers_hold_by_construction(tmp_path):
    from slime_mt.geo3k_data import synthetic_rows

    rows = synthetic_rows(8, tmp_path, seed=3)
    assert len(rows) == 8 and all((tmp_path / r["images"][0]).is_file() for r in rows)
    triangle = [r for r in rows if r["problem"] == "<image>Find x."]
    assert triangle and all(float(r["answer"]) > 0 for r in triangle)
