"""reasoning-gym's procedural tasks (offline: generated, each family with its own verifier) as a ready
dataset, a reward function and an environment.

Data: ``python -m envs.reasoning_tasks OUT --tasks basic_arithmetic,chain_sum --size 64 --seed 1``
writes ``OUT/train.jsonl``: per row a chat prompt (a system prompt asking for ``<answer>...</answer>``
and the task's question), the reference answer as ``label``, and in ``metadata`` the task family and
the generated entry its verifier needs. ``--task-config '{"chain_sum": {"max_digits": 1}}'`` passes
each family's generator its settings (easier tasks for a small model).

Reward: the family's own verifier (``reasoning_gym.get_score_answer_fn``) on the text inside the
response's last ``<answer>...</answer>`` (the whole response when there is none), in [0, 1]:
``--custom-rm-path envs.reasoning_tasks.reward`` for single-turn runs. The environment
(``--rollout-interaction-env-path envs.reasoning_tasks``) grades each answer the same way; a wrong one
gets "incorrect, try again" as the next observation, up to ``--max-turns``; its reward is the last
answer's score.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from envs.base import BaseInteractionEnv
from slime_mt.data import write_jsonl

SYSTEM_PROMPT = "Solve the task. Think briefly, then give only the final answer as <answer>...</answer>."
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _gym():
    try:
        import reasoning_gym
    except ImportError as e:
        raise ImportError("envs.reasoning_tasks needs reasoning-gym: pip install 'slime_mt[envs]'") from e
    return reasoning_gym


def make_rows(tasks: list[str], size: int, seed: int, config: dict | None = None) -> list[dict]:
    """``size`` generated entries of each task family -> dataset rows (interleaved by family);
    ``config``: per family, its generator's settings (``{"chain_sum": {"max_digits": 1}}``)."""
    gym = _gym()
    config = config or {}
    unknown = sorted(set(tasks) - set(gym.factory.DATASETS))
    if unknown:
        raise ValueError(f"--tasks: unknown reasoning-gym families {unknown}; see reasoning_gym.factory.DATASETS")
    if not isinstance(config, dict) or not all(isinstance(v, dict) for v in config.values()):
        raise ValueError('--task-config: a JSON object of family -> settings, e.g. {"chain_sum": {"max_digits": 1}}')
    stray = sorted(set(config) - set(tasks))
    if stray:
        raise ValueError(f"--task-config: settings for families not in --tasks: {stray}")
    per_task = []
    for task in tasks:
        try:
            per_task.append(list(gym.create_dataset(task, size=size, seed=seed, **config.get(task, {}))))
        except (TypeError, AssertionError, ValueError) as e:
            raise ValueError(f"--task-config {task}: {config.get(task)} refused by reasoning-gym ({e})") from None
    rows = []
    for k in range(size):
        for task, entries in zip(tasks, per_task):
            entry = entries[k]
            rows.append(
                {
                    "prompt": [
                        {"role": "system", "content": SYSTEM_PROMPT},
                        {"role": "user", "content": entry["question"]},
                    ],
                    "label": str(entry["answer"]),
                    "metadata": {"task": task, "entry": _plain(entry)},
                }
            )
    return rows


def _plain(value: Any) -> Any:
    """An entry as JSON keeps it (the verifiers read only plain fields)."""
    return json.loads(json.dumps(value, default=str))


def extract_answer(response: str) -> str:
    found = _ANSWER.findall(response or "")
    return (found[-1] if found else response or "").strip()


def score(response: str, metadata: dict) -> float:
    """The family's verifier on the response's answer -> [0, 1]; a row without its task is an error naming the key."""
    if not isinstance(metadata, dict) or "task" not in metadata or "entry" not in metadata:
        raise KeyError("envs.reasoning_tasks: the row needs metadata['task'] and metadata['entry']")
    verify = _gym().get_score_answer_fn(metadata["task"])
    value = verify(extract_answer(response), metadata["entry"])
    return float(value or 0.0)


async def reward(args, sample) -> float:
    """A reward function: the family's verifier on the sample's response."""
    return score(sample.response, sample.metadata)


class ReasoningTaskEnv(BaseInteractionEnv):
    """Each answer graded by the family's verifier; a wrong one is told so, until --max-turns."""

    def __init__(self, metadata: dict) -> None:
        self.metadata = metadata

    def step(self, response_text: str) -> tuple[dict, bool, dict]:
        value = score(response_text, self.metadata)
        if value >= 1.0:
            return {"text": ""}, True, {"reward": value}
        return {"text": "That answer is incorrect. Try again."}, False, {"reward": value}


def build_env(sample=None, args=None, **kw) -> ReasoningTaskEnv:
    return ReasoningTaskEnv((sample.metadata if sample is not None else None) or {})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write reasoning-gym tasks as a slime_mt dataset (train.jsonl).")
    parser.add_argument("out", type=Path)
    parser.add_argument("--tasks", default="basic_arithmetic,chain_sum", help="comma-separated task families")
    parser.add_argument("--size", type=int, default=64, help="entries per family")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--task-config",
        type=json.loads,
        default={},
        help='JSON: per family, its generator\'s settings, e.g. \'{"chain_sum": {"max_terms": 2, "max_digits": 1}}\'',
    )
    given = parser.parse_args(argv)
    tasks = [t.strip() for t in given.tasks.split(",") if t.strip()]
    rows = make_rows(tasks, given.size, given.seed, given.task_config)
    path = write_jsonl(given.out / "train.jsonl", rows)  # never a half-written file
    print(f"wrote {len(rows)} rows to {path}")


if __name__ == "__main__":
    main()
