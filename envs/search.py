"""Retrieval search: a ``search(query, k)`` tool over a local corpus with BM25, in Search-R1 episodes.

The corpus is a jsonl of passages, one ``{"id": ..., "text": ...}`` (``title`` optional) per line;
its BM25 index (``bm25s``: sparse scores precomputed at index time, numpy only) is built once per
corpus content and cached in ``SLIME_MT_CACHE/search-index-<sha256>`` (and in memory per process).

An episode: the model searches, reads, and answers. Each turn it writes one of
  ``<search>query</search>``                      Search-R1's form; the passages come back inside
                                                  ``<information>...</information>`` (role user)
  ``<tool_call>{"name": "search", "arguments": {"query": ..., "k": 3}}</tool_call>``
                                                  the tool form (``tools`` declares it; role tool)
  ``<answer>...</answer>``                        ends the episode: reward is the exact match with
                                                  the label (SQuAD normalization; a list of labels:
                                                  any), ``info`` carries ``em`` and ``f1``
Anything else is an invalid action (``InvalidActionError``) whose feedback says what to write.

Settings: the row's ``metadata["corpus"]`` or the custom setting ``search_corpus`` (a jsonl path),
``search_top_k`` (default 3), ``search_reward`` (``em`` or ``f1``), ``search_format_reward`` (default 0,
Search-R1's ``structure_format_score``): each well-formed action, a search or an answer, sets the
episode's reward to at least this much, so a model that has not yet found an answer is still told
which turns followed the format; a right answer still earns its grade, an invalid action nothing.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from pathlib import Path
from typing import Any

from envs.base import BaseInteractionEnv
from slime_mt.assets.cache import cached_dir
from slime_mt.errors import InvalidActionError
from slime_mt.rollout.rewards import exact_match, f1_reward

SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the corpus; returns the best-matching passages.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "description": "What to look for"},
                "k": {"type": "integer", "description": "How many passages (default 3)"},
            },
            "required": ["query"],
        },
    },
}
SYSTEM_PROMPT = (
    "Answer the question. To look something up, write <search>your query</search> and the results "
    "come back between <information> and </information>. Search as often as you need, then give "
    "the final answer as <answer>the answer</answer>."
)
MAX_K = 10

_SEARCH = re.compile(r"<search>(.*?)</search>", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


class CorpusError(ValueError):
    """A corpus file that cannot be indexed; names the file and the line."""


def read_corpus(path: str | Path) -> list[dict]:
    """The passages of a jsonl corpus; each line needs a non-empty ``text`` (``id`` defaults to its line)."""
    passages = []
    with open(path) as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise CorpusError(f"{path} line {number}: not JSON: {e}") from e
            if not isinstance(row, dict) or not isinstance(row.get("text"), str) or not row["text"].strip():
                raise CorpusError(f"{path} line {number}: a passage needs a non-empty string 'text'")
            passages.append({"id": str(row.get("id", number)), "title": row.get("title"), "text": row["text"]})
    if not passages:
        raise CorpusError(f"{path}: no passages")
    return passages


def _tokenize(texts: list[str]):
    import bm25s

    return bm25s.tokenize(texts, stopwords="en", show_progress=False)


class SearchIndex:
    """BM25 over one corpus; ``open`` builds it once per corpus content and caches it."""

    _open: dict[str, SearchIndex] = {}
    _lock = threading.Lock()

    def __init__(self, passages: list[dict], retriever) -> None:
        self.passages = passages
        self.retriever = retriever

    @classmethod
    def open(cls, corpus_path: str | Path) -> SearchIndex:
        """The index of ``corpus_path``: from memory, else from the cache folder, else built and cached."""
        try:
            import bm25s
        except ImportError as e:
            raise ImportError("envs.search needs bm25s: pip install 'slime_mt[envs]'") from e

        digest = hashlib.sha256(Path(corpus_path).read_bytes()).hexdigest()[:16]
        with cls._lock:
            if digest not in cls._open:
                passages = read_corpus(corpus_path)

                def build(out: Path) -> None:
                    retriever = bm25s.BM25()
                    retriever.index(_tokenize([_document(p) for p in passages]), show_progress=False)
                    retriever.save(str(out), show_progress=False)

                folder = cached_dir(f"search-index-{digest}", build)
                cls._open[digest] = cls(passages, bm25s.BM25.load(str(folder), show_progress=False))
            return cls._open[digest]

    def search(self, query: str, k: int = 3) -> list[dict]:
        """The ``k`` best passages for ``query``, best first, each with its BM25 ``score`` (> 0 only:
        a query that shares no term with the corpus finds nothing)."""
        k = max(1, min(int(k), MAX_K, len(self.passages)))
        documents, scores = self.retriever.retrieve(_tokenize([query]), k=k, show_progress=False)
        return [{**self.passages[int(d)], "score": float(s)} for d, s in zip(documents[0], scores[0]) if float(s) > 0]


def _document(passage: dict) -> str:
    return f"{passage['title']}\n{passage['text']}" if passage.get("title") else passage["text"]


def format_passages(passages: list[dict]) -> str:
    if not passages:
        return "No passage matches the query."
    lines = []
    for n, p in enumerate(passages, 1):
        title = f" (Title: {p['title']})" if p.get("title") else ""
        lines.append(f"Doc {n}{title}: {p['text']}")
    return "\n".join(lines)


class SearchEnv(BaseInteractionEnv):
    """One Search-R1 episode over an index (see the module docstring)."""

    tools = [SEARCH_TOOL]

    def __init__(
        self, index: SearchIndex, label: Any, top_k: int = 3, reward: str = "em", format_reward: float = 0.0
    ) -> None:
        if reward not in ("em", "f1"):
            raise ValueError(f"search_reward {reward!r}: one of em, f1")
        if not 0.0 <= format_reward < 1.0:
            raise ValueError(f"search_format_reward {format_reward!r}: in [0, 1), below a right answer's 1")
        self.index, self.label, self.top_k, self.reward = index, label, top_k, reward
        self.format_reward = format_reward
        self.searches = 0
        self.role = "user"

    def reset(self) -> None:
        self.searches = 0

    def _query(self, text: str) -> tuple[str, int, str] | None:
        """(query, k, role) of the action, if it is a search."""
        call = _TOOL_CALL.search(text)
        if call:
            try:
                body = json.loads(call.group(1))
            except json.JSONDecodeError as e:
                raise InvalidActionError(f"The tool call is not valid JSON ({e.msg}).") from None
            arguments = body.get("arguments") if isinstance(body, dict) else None
            if not isinstance(body, dict) or body.get("name") != "search" or not isinstance(arguments, dict):
                raise InvalidActionError('Unknown tool call: the only tool is "search" with {"query": ...}.')
            query, k = arguments.get("query"), arguments.get("k", self.top_k)
            if not isinstance(query, str) or not query.strip() or not isinstance(k, int):
                raise InvalidActionError('search needs a non-empty string "query" and an integer "k".')
            return query.strip(), k, "tool"
        found = _SEARCH.search(text)
        if found:
            if not found.group(1).strip():
                raise InvalidActionError("The search query is empty.")
            return found.group(1).strip(), self.top_k, "user"
        return None

    def step(self, response_text: str) -> tuple[dict, bool, dict]:
        answer = _ANSWER.search(response_text)
        query = None if answer else self._query(response_text)
        if answer:
            given = answer.group(1).strip()
            em = exact_match(given, self.label)
            f1 = f1_reward(given, self.label, {})
            reward = max(em if self.reward == "em" else f1, self.format_reward)
            return {"text": ""}, True, {"reward": reward, "em": em, "f1": f1, "searches": self.searches}
        if query is None:
            raise InvalidActionError(
                "Write <search>query</search> to search, or give the final answer as <answer>...</answer>."
            )
        text, k, self.role = query
        self.searches += 1
        passages = self.index.search(text, k)
        info: dict[str, Any] = {"found": len(passages)}
        if self.format_reward:
            info["reward"] = self.format_reward  # the episode's, unless a later answer sets another
        return {"text": f"<information>{format_passages(passages)}</information>"}, False, info

    def format_observation(self, observation: dict) -> dict:
        return {"role": self.role, "content": observation.get("text", "")}


def build_env(sample=None, args=None, **kw) -> SearchEnv:
    metadata = (sample.metadata if sample is not None else None) or {}
    corpus = metadata.get("corpus") or getattr(args, "search_corpus", None)
    if not corpus:
        raise ValueError("envs.search: no corpus; give the row's metadata['corpus'] or the setting search_corpus")
    return SearchEnv(
        SearchIndex.open(corpus),
        sample.label if sample is not None else None,
        top_k=int(getattr(args, "search_top_k", 3) or 3),
        reward=str(getattr(args, "search_reward", "em") or "em"),
        format_reward=float(getattr(args, "search_format_reward", 0.0) or 0.0),
    )
