"""Retrieval search (envs/search.py): BM25 ranking over a corpus built here, a Search-R1 episode with
two searches and an answer, exact match and F1 against hand-computed values, bad corpora."""

import json
from types import SimpleNamespace

import pytest

from envs.search import CorpusError, SearchEnv, SearchIndex, build_env
from slime_mt.errors import InvalidActionError
from slime_mt.rollout.rewards import exact_match, f1_reward
from slime_mt.types import Sample

PASSAGES = [
    {"id": "p1", "title": "Zorvania", "text": "Zorvania is a small island nation. Its capital is Quellport."},
    {"id": "p2", "title": "Quellport", "text": "Quellport was founded in 1712 by the sailor Ada Brenn."},
    {"id": "p3", "title": "Marovia", "text": "Marovia is a mountain state whose capital is Tessin."},
    {"id": "p4", "text": "Bread is baked from flour, water and yeast."},
    {"id": "p5", "text": "The island of Zorvania exports salt and wool."},
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("search") / "corpus.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PASSAGES))
    return path


def test_bm25_ranks_the_passage_with_the_answer_first(corpus):
    index = SearchIndex.open(corpus)
    assert SearchIndex.open(corpus) is index  # built once per corpus
    assert [p["id"] for p in index.search("capital of Zorvania", 2)] == ["p1", "p5"]
    assert index.search("who founded Quellport", 1)[0]["id"] == "p2"
    assert index.search("capital Marovia", 3)[0]["id"] == "p3"
    assert index.search("photosynthesis chlorophyll", 3) == []  # no shared term: nothing found
    scores = [p["score"] for p in index.search("Zorvania", 5)]
    assert scores == sorted(scores, reverse=True) and len(scores) == 2


def test_an_episode_with_two_searches_and_an_answer(corpus):
    env = build_env(Sample(label="Ada Brenn", metadata={"corpus": str(corpus)}), None)
    env.reset()
    observation, done, info = env.step("I need the capital first. <search>capital of Zorvania</search>")
    assert not done and observation["text"].startswith("<information>Doc 1 (Title: Zorvania): Zorvania is")
    assert env.format_observation(observation)["role"] == "user"
    call = {"name": "search", "arguments": {"query": "Quellport founded by", "k": 1}}
    observation, done, info = env.step(f"<tool_call>{json.dumps(call)}</tool_call>")
    assert observation["text"] == (
        "<information>Doc 1 (Title: Quellport): Quellport was founded in 1712 by the sailor Ada Brenn.</information>"
    )
    assert env.format_observation(observation)["role"] == "tool" and info == {"found": 1}
    observation, done, info = env.step("<answer>the sailor Ada Brenn</answer>")
    # normalized "sailor ada brenn" vs "ada brenn": EM 0; F1 = 2 * (2/3 * 2/2) / (2/3 + 1) = 0.8
    assert done and info["reward"] == 0.0 and info["em"] == 0.0
    assert info["f1"] == pytest.approx(0.8) and info["searches"] == 2


def test_exact_match_and_f1_by_hand():
    assert exact_match("The  Ada Brenn!", "ada brenn") == 1.0  # case, punctuation, articles, spaces
    assert exact_match("Ada", ["Ada Brenn", "ada"]) == 1.0  # any label of a list
    assert exact_match("Ada B.", "Ada Brenn") == 0.0
    # "ada brenn founder" vs "ada brenn": precision 2/3, recall 1 -> 0.8
    assert f1_reward("Ada Brenn, founder", "Ada Brenn", {}) == pytest.approx(0.8)
    assert f1_reward("Quellport", "Ada Brenn", {}) == 0.0


def test_f1_reward_setting_and_invalid_actions(corpus):
    env = SearchEnv(SearchIndex.open(corpus), "Tessin", reward="f1")
    assert env.step("<answer>Tessin city</answer>")[2]["reward"] == pytest.approx(2 * 0.5 / 1.5)
    for bad, says in [
        ("I think it is Tessin.", "<search>query</search>"),
        ("<search>  </search>", "empty"),
        ('<tool_call>{"name": "browse", "arguments": {"url": "x"}}</tool_call>', "Unknown tool"),
        ("<tool_call>{not json}</tool_call>", "not valid JSON"),
    ]:
        with pytest.raises(InvalidActionError, match=says):
            env.step(bad)


def test_a_format_reward_marks_well_formed_turns_and_never_outranks_a_right_answer(corpus):
    """search_format_reward (Search-R1's structure_format_score): a search sets the episode's reward
    to it, a wrong answer keeps it, a right one earns 1; without the setting a search sets none."""
    args = SimpleNamespace(search_format_reward=0.1)
    env = build_env(Sample(label="Tessin", metadata={"corpus": str(corpus)}), args)
    assert env.step("<search>capital of Zorvania</search>")[2] == {"found": 3, "reward": 0.1}
    assert env.step("<answer>Quellport</answer>")[2]["reward"] == 0.1  # well-formed, wrong
    assert env.step("<answer>Tessin</answer>")[2]["reward"] == 1.0
    with pytest.raises(InvalidActionError):
        env.step("no tags")
    plain = build_env(Sample(label="Tessin", metadata={"corpus": str(corpus)}), None)
    assert "reward" not in plain.step("<search>capital of Zorvania</search>")[2]
    assert plain.step("<answer>Quellport</answer>")[2]["reward"] == 0.0
    with pytest.raises(ValueError, match="search_format_reward 1.0"):
        SearchEnv(SearchIndex.open(corpus), "Tessin", format_reward=1.0)


def test_bad_corpora_name_the_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": 1, "text": "fine"}\n{"id": 2}\n')
    with pytest.raises(CorpusError, match=r"bad.jsonl line 2: a passage needs a non-empty string 'text'"):
        SearchIndex.open(path)
    path.write_text("not json\n")
    with pytest.raises(CorpusError, match="bad.jsonl line 1: not JSON"):
        SearchIndex.open(path)
    with pytest.raises(ValueError, match="no corpus"):
        build_env(Sample(label="x"), None)
