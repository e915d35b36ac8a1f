"""Rule-based rewards by name: ``--rm-type`` (slime's built-in graders; a row's ``metadata["rm_type"]``
overrides it for that row).

  math        the response's final answer (its last ``\\boxed{}`` or expression) equals the label, by
              ``math-verify`` (symbolic equivalence: ``\\frac{1}{2}`` = ``0.5``) -> 1 / 0
  deepscaler  DeepScaleR's rule: only the text after ``</think>`` counts (no ``</think>``: 0); its last
              ``\\boxed{}`` must equal the label (or one of a list of labels) by ``math-verify`` -> 1 / 0
  dapo        DAPO's rule: the last ``Answer: ...`` in the response's final 300 characters, normalized,
              equals the normalized label -> ``{"score": 1.0 | -1.0, "acc": bool, "pred": str}``
              (read with ``--reward-key score``)
  f1          SQuAD's token F1 between the response and the label (the best over a list of labels)
  gpqa        the multiple-choice letter the response ends on (``Answer: C``, ``\\boxed{C}``, ``(C)``)
              equals the label's letter (a letter, or an option's text found in ``metadata["choices"]``)
  random      0 or 1 at random, seeded by the run's seed, the step and the sample (a pipeline check)
  remote_rm   POST ``{"prompt", "response", "label"}`` to ``--rm-url``; its JSON answer is the reward
  boxed_<t>   any of the above on the response's last ``\\boxed{}`` only (``boxed_f1``)

Graders run on the run's worker threads, each within ``GRADE_SECONDS`` (``math-verify`` guards its own
parsing with ``signal.alarm``, which only the main thread may use, so its timeouts are off and this one
stands in).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import re
import string
from collections.abc import Callable
from typing import Any

import httpx

from slime_mt.config.rollout import BOXED_PREFIX, check_rm_type
from slime_mt.errors import RewardError

GRADE_SECONDS = 10.0
REMOTE_RM_RETRIES = 5

logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled" on every call: ours applies


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces; None if none."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def _labels(label: Any) -> list[str]:
    values = label if isinstance(label, (list, tuple)) else [label]
    return [str(v) for v in values if v is not None]


def math_equal(answer: str, label: str) -> bool:
    from math_verify import parse, verify

    boxed = last_boxed(label)
    gold = parse(f"${boxed if boxed is not None else label}$", parsing_timeout=None)
    if not gold:
        gold = parse(label, parsing_timeout=None)
    predicted = parse(answer, parsing_timeout=None)
    return bool(gold and predicted and verify(gold, predicted, timeout_seconds=None))


def math_reward(response: str, label: Any, metadata: dict) -> float:
    return float(any(math_equal(response, gold) for gold in _labels(label)))


def deepscaler_reward(response: str, label: Any, metadata: dict) -> float:
    if "</think>" not in response:
        return 0.0
    answer = last_boxed(response.split("</think>", 1)[1])
    if answer is None:
        return 0.0
    return float(any(math_equal(f"\\boxed{{{answer}}}", gold) for gold in _labels(label)))


_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")


def normalize_final_answer(text: str) -> str:
    """DAPO-style normalization: boxed and ``\\text{}`` unwrapped, ``$``, spaces, a trailing period and
    thousands separators removed."""
    text = text.strip()
    boxed = last_boxed(text)
    if boxed is not None:
        text = boxed
    text = re.sub(r"\\text\{(.*?)\}", r"\1", text)
    text = text.replace("$", "").replace("\\!", "").replace(" ", "").rstrip(".")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", text):
        text = text.replace(",", "")
    return text


def dapo_reward(response: str, label: Any, metadata: dict) -> dict:
    matches = _ANSWER_LINE.findall(response[-300:])
    pred = normalize_final_answer(matches[-1]) if matches else ""
    correct = bool(pred) and any(pred == normalize_final_answer(gold) for gold in _labels(label))
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}


def _squad_tokens(text: str) -> list[str]:
    text = "".join(c for c in str(text).lower() if c not in string.punctuation)
    return re.sub(r"\b(a|an|the)\b", " ", text).split()


def exact_match(response: str, label: Any) -> float:
    """SQuAD's exact match: 1.0 when the normalized response (lower case, no punctuation or articles,
    single spaces) equals a normalized label (any of a list), else 0.0."""
    predicted = _squad_tokens(response)
    return float(any(predicted == _squad_tokens(gold) for gold in _labels(label)))


def f1_reward(response: str, label: Any, metadata: dict) -> float:
    predicted = _squad_tokens(response)
    best = 0.0
    for gold in _labels(label):
        truth = _squad_tokens(gold)
        common = sum((collections.Counter(predicted) & collections.Counter(truth)).values())
        if common:
            precision, recall = common / len(predicted), common / len(truth)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


_CHOICE_PATTERNS = (
    re.compile(r"(?i)answer\s*(?:is|:)?\s*\(?\**([A-J])\b"),
    re.compile(r"\\boxed\{\s*\(?([A-J])\)?\s*\}"),
    re.compile(r"\(([A-J])\)"),
    re.compile(r"\b([A-J])\b"),
)


def _choice(response: str) -> str | None:
    for pattern in _CHOICE_PATTERNS:
        found = pattern.findall(response)
        if found:
            return found[-1].upper()
    return None


def gpqa_reward(response: str, label: Any, metadata: dict) -> float:
    gold = str(label).strip()
    if not re.fullmatch(r"[A-Ja-j]", gold):
        choices = [str(c).strip() for c in (metadata or {}).get("choices") or []]
        if gold not in choices:
            raise RewardError(
                f"gpqa: label {gold!r} is neither a letter nor one of the row's metadata['choices'] {choices}"
            )
        gold = string.ascii_uppercase[choices.index(gold)]
    return float(_choice(response) == gold.upper())


def random_reward(response: str, label: Any, metadata: dict) -> float:
    """0 or 1, drawn from the sample's seed (``metadata["random_seed"]``, set per sample) when there is one."""
    return float(random.Random(metadata.get("random_seed")).randint(0, 1))


# the graders of --rm-type (config.rollout.RM_TYPES names them, and remote_rm)
GRADERS: dict[str, Callable[[str, Any, dict], float | dict]] = {
    "math": math_reward,
    "deepscaler": deepscaler_reward,
    "dapo": dapo_reward,
    "f1": f1_reward,
    "gpqa": gpqa_reward,
    "random": random_reward,
}


async def rule_based_rm(args, sample) -> float | dict:
    """slime's ``async_rm`` for built-in graders: the row's ``metadata["rm_type"]`` or ``--rm-type``."""
    metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
    name = (metadata.get("rm_type") or args.rm_type or "").strip()
    if not name:
        raise RewardError("no reward: set --rm-type, --custom-rm-path, or metadata['rm_type'] in the row")
    check_rm_type(name, "metadata['rm_type']" if metadata.get("rm_type") else "--rm-type")
    if name == "remote_rm":
        return await remote_rm(args, sample)
    response = sample.response
    if name.startswith(BOXED_PREFIX):
        response = last_boxed(response) or ""
        name = name.removeprefix(BOXED_PREFIX)
    grade = GRADERS[name]
    if name == "random":  # reproducible: the run's seed, the step and the sample
        seed = (getattr(args, "rollout_seed", 0), metadata.get("rollout_id", 0), sample.index)
        metadata = {**metadata, "random_seed": hash(seed)}
    return await asyncio.wait_for(asyncio.to_thread(grade, response, sample.label, metadata), GRADE_SECONDS)


async def remote_rm(args, sample) -> Any:
    """POST the sample to ``--rm-url``; connection errors and 5xx are retried with backoff."""
    url = getattr(args, "rm_url", None)
    if not url:
        raise RewardError("--rm-type remote_rm needs --rm-url")
    payload = {"prompt": sample.prompt, "response": sample.response, "label": sample.label}
    async with httpx.AsyncClient(timeout=120.0) as client:
        for attempt in range(REMOTE_RM_RETRIES):
            try:
                answer = await client.post(url, json=payload)
                if answer.status_code < 500:
                    answer.raise_for_status()
                    return answer.json()
                error: Exception = RewardError(f"--rm-url {url} answered {answer.status_code}: {answer.text[:200]}")
            except httpx.TransportError as e:
                error = e
            if attempt + 1 < REMOTE_RM_RETRIES:
                await asyncio.sleep(min(2**attempt * 0.1, 2.0))
    raise RewardError(f"--rm-url {url}: no answer after {REMOTE_RM_RETRIES} attempts: {error}")


def overlong_penalty(length: int, max_len: int, buffer_len: int, factor: float) -> float:
    """DAPO's soft over-long punishment of a response of ``length`` generated tokens: 0 up to
    ``max_len - buffer_len``, then falling linearly to ``-factor`` at ``max_len`` (and no lower past
    it): ``max(min(-(length - (max_len - buffer_len)) / buffer_len * factor, 0), -factor)``."""
    if buffer_len <= 0:
        return 0.0
    exceed = length - (max_len - buffer_len)
    return max(min(-exceed / buffer_len * factor, 0.0), -factor)


async def turn_rewards_sum(args, sample) -> float:
    """A reward function (``--custom-rm-path slime_mt.rollout.rewards.turn_rewards_sum``): the sum of
    the per-turn rewards the environment reported (``info["reward"]`` of each step, ``Turn.reward``)."""
    return float(sum(t.reward for t in sample.turns if t.reward is not None))
