"""reasoning-gym tasks (envs/reasoning_tasks.py): a dataset of two families written and loaded back
through the project's data loader, each family's own verifier as the reward, and the environment on
a real engine."""

import asyncio

import pytest

from envs.reasoning_tasks import main, make_rows, reward, score  # noqa: E402
from slime_mt.config import DataConfig  # noqa: E402
from slime_mt.data import load_rows  # noqa: E402
from slime_mt.types import Sample  # noqa: E402

TASKS = ["basic_arithmetic", "chain_sum"]


def test_two_families_are_written_loaded_and_graded_by_their_own_verifiers(tmp_path, capsys):
    main([str(tmp_path), "--tasks", ",".join(TASKS), "--size", "4", "--seed", "3"])
    assert "wrote 8 rows" in capsys.readouterr().out
    rows = load_rows(tmp_path / "train.jsonl", DataConfig(apply_chat_template=True))
    assert [r.metadata["task"] for r in rows] == TASKS * 4
    assert make_rows(TASKS, 4, 3)[0]["prompt"] == rows[0].prompt  # the same seed, the same tasks
    for row in rows:  # after a JSON round trip the verifier still reads its entry
        assert row.prompt[1]["content"] == row.metadata["entry"]["question"]
        assert score(f"Reasoning... <answer>{row.label}</answer>", row.metadata) == 1.0
        assert score(f"<answer>{int(row.label) + 1}</answer>", row.metadata) == 0.0
        assert score(row.label, row.metadata) == 1.0  # no tags: the whole response is the answer
    sample = Sample(response=f"<answer>1</answer> then <answer>{rows[1].label}</answer>", metadata=rows[1].metadata)
    assert asyncio.run(reward(None, sample)) == 1.0  # the last answer counts


def test_a_family_generates_with_its_settings_and_bad_settings_are_named():
    """--task-config: one-digit chain sums of two terms (what a 135M model can answer at the start)."""
    rows = make_rows(["chain_sum"], 8, 1, {"chain_sum": {"min_terms": 2, "max_terms": 2, "max_digits": 1}})
    for row in rows:
        terms = row["metadata"]["entry"]["question"].rsplit(":", 1)[1].strip(" =").split()
        assert len(terms) == 3 and all(len(t.lstrip("-")) == 1 for t in terms[::2]), terms
    with pytest.raises(ValueError, match=r"--task-config: settings for families not in --tasks: \['chain_sum'\]"):
        make_rows(["basic_arithmetic"], 2, 1, {"chain_sum": {"max_digits": 1}})
    with pytest.raises(ValueError, match=r"--task-config chain_sum: .*refused by reasoning-gym"):
        make_rows(["chain_sum"], 2, 1, {"chain_sum": {"no_such_setting": 1}})
    with pytest.raises(ValueError, match=r"--task-config: a JSON object"):
        make_rows(["chain_sum"], 2, 1, {"chain_sum": 3})


def test_bad_families_and_rows_are_named():
    with pytest.raises(ValueError, match=r"unknown reasoning-gym families \['no_such_task'\]"):
        make_rows(["basic_arithmetic", "no_such_task"], 2, 1)
    with pytest.raises(KeyError, match=r"metadata\['task'\]"):
        score("<answer>1</answer>", {})
