"""LLM-as-judge: a model behind the SGLang-protocol client grades answers, as a reward function or as
the critic whose critique is the next observation of a multi-turn episode.

Where the judge runs (``--judge-*`` flags): ``--judge-use-policy`` (the policy's own engines),
``--judge-engine-url`` (a running engine serving ``--judge-model-path``, whose tokenizer and chat
template render the prompt), or ``--judge-model-path`` alone (an embedded engine serving it, started
in the rollout process on first use and stopped with the run).

The rubric is a ``str.format`` template (``--judge-template``, a file; default ``DEFAULT_TEMPLATE``)
over ``{prompt}``, ``{response}`` and ``{label}``, sent as one user message. The judge's answer is read
by ``parse_score`` (the last ``Score: N`` or ``N/10``, else the last JSON object with a ``score``),
or by a user parser (``--judge-parser-path``, ``Judge(parse=...)``). Every call has a timeout; a call
that times out, fails or cannot be parsed is tried again (``--judge-retries``; the first call is
greedy, a retry samples), then the result is a recorded failure (``JudgeResult.error``) and its user
decides: ``judge_reward`` fails the sample (left out of its
group's statistics) unless ``--judge-failure-reward`` gives a value. At most ``--judge-concurrency``
calls are in flight; identical prompts within one step share one call (the cache is per step).
Each sample counts its judge calls in ``metadata["judge"]`` (calls, cache_hits, retries, failures,
seconds), which the step's metrics sum as ``judge/...``.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from envs.base import BaseInteractionEnv
from slime_mt.engine.clients import client_for
from slime_mt.plugins import judge_parser_prototype, load_function

DEFAULT_TEMPLATE = (
    "You are grading an answer to a task. Compare the answer with the reference and rate it from 0 "
    "(wrong) to 10 (fully correct). First give a short critique, then end with 'Score: N'.\n\n"
    "Task:\n{prompt}\n\nReference:\n{label}\n\nAnswer (between the markers):\n<<<\n{response}\n>>>"
)
RETRY_TEMPERATURE = 0.7
_NUMBER = r"(-?\d+(?:\.\d+)?)(?![\d.eE])"  # a whole number: "1e400" or "7.5.1" is none
_SCORE = re.compile(rf"score\**\s*[:=]\s*\**\s*{_NUMBER}(?:\s*/\s*{_NUMBER})?", re.IGNORECASE)
_FRACTION = re.compile(rf"{_NUMBER}\s*/\s*10\b")


class JudgeError(RuntimeError):
    """The judge gave no usable score within its retries; the message says what it answered last."""


def parse_score(text: str, low: float = 0.0, high: float = 10.0) -> float | None:
    """The score the judge gave, within ``[low, high]``, or None (never raises): the last ``Score: N``
    (``Score: 7/10`` scaled to ``high``), else the last ``N/10``, else the last JSON object holding a
    numeric ``score``. A value outside the range, not finite, or absent is None."""
    text = str(text or "")
    candidates: list[float] = []
    for match in _SCORE.finditer(text):
        value = float(match.group(1))
        if match.group(2):
            value = value / float(match.group(2)) * high if float(match.group(2)) else math.nan
        candidates.append(value)
    if not candidates:
        candidates = [float(m.group(1)) / 10 * high for m in _FRACTION.finditer(text)]
    if not candidates:
        for start in [m.start() for m in re.finditer(r"\{", text)][::-1][:16]:  # the last few objects only
            end = text.find("}", start)
            try:
                body = json.loads(text[start : end + 1]) if end > start else None
            except json.JSONDecodeError:
                continue
            if isinstance(body, dict) and isinstance(body.get("score"), (int, float)):
                candidates = [float(body["score"])]
                break
    if not candidates:
        return None
    value = candidates[-1]
    return value if math.isfinite(value) and low <= value <= high else None


@dataclass
class JudgeResult:
    score: float | None  # None: no usable score (see ``error``)
    text: str  # the judge's last answer
    error: str | None = None
    cached: bool = False
    attempts: int = 1
    seconds: float = 0.0


class Judge:
    """One judge model: renders the rubric, calls the engine within limits, parses, caches per step."""

    def __init__(
        self,
        client,
        tokenizer,
        template: str = DEFAULT_TEMPLATE,
        parse: Callable[[str], float | None] | None = None,
        timeout: float = 60.0,
        retries: int = 2,
        concurrency: int = 8,
        max_new_tokens: int = 256,
        max_score: float = 10.0,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        from slime_mt.tokenization import ObservationEncoder

        self.client, self.tokenizer, self.template = client, tokenizer, template
        self.encoder = ObservationEncoder(tokenizer)  # the rubric as one user message, with the generation prompt
        self.max_score = max_score
        self.parse = parse or (lambda text: parse_score(text, 0.0, max_score))
        self.timeout, self.retries, self.max_new_tokens = timeout, retries, max_new_tokens
        self.semaphore = asyncio.Semaphore(concurrency)
        self.on_close = on_close
        self._step: Any = None
        self._cache: dict[str, asyncio.Future] = {}

    def render(self, **fields: Any) -> list[int]:
        try:
            text = self.template.format(**{k: "" if v is None else v for k, v in fields.items()})
        except (KeyError, IndexError) as e:
            raise JudgeError(f"the judge template needs the field {e} (it has: {', '.join(fields)})") from None
        return self.encoder.encode_prompt(text).ids

    async def grade(self, step: Any = None, stats: dict | None = None, **fields: Any) -> JudgeResult:
        """The judge's verdict on ``fields`` (the template's); ``step``: identical calls within one step
        share one call; ``stats``: where this call is counted (a sample's ``metadata["judge"]``)."""
        ids = self.render(**fields)
        if step != self._step:
            self._step, self._cache = step, {}
        key = json.dumps(ids)
        cached = key in self._cache
        if not cached:
            self._cache[key] = asyncio.ensure_future(self._call(ids))
        result = await asyncio.shield(self._cache[key])
        if cached:
            result = JudgeResult(result.score, result.text, result.error, True, 0, 0.0)
        if stats is not None:
            for name, value in (
                ("calls", 1),
                ("cache_hits", int(cached)),
                ("retries", max(result.attempts - 1, 0)),
                ("failures", int(result.score is None)),
                ("seconds", result.seconds),
            ):
                stats[name] = stats.get(name, 0) + value
        return result

    async def _call(self, ids: list[int]) -> JudgeResult:
        started = time.perf_counter()
        text, error = "", ""
        for attempt in range(1, self.retries + 2):
            # greedy first; a retry samples (a greedy retry would write the same unparseable answer again)
            params = {"temperature": 0.0, "max_new_tokens": self.max_new_tokens}
            if attempt > 1:  # seeded: the same answer is retried the same way
                params.update(temperature=RETRY_TEMPERATURE, sampling_seed=attempt)
            try:
                async with self.semaphore:
                    response = await asyncio.wait_for(
                        self.client.generate(ids, params, return_logprob=False, timeout=self.timeout), self.timeout
                    )
                text = response.get("text", "")
                score = self.parse(text)
                if score is not None:
                    return JudgeResult(score, text, None, False, attempt, time.perf_counter() - started)
                error = f"no score in the judge's answer: {text[-200:]!r}"
            except asyncio.TimeoutError:
                error = f"the judge did not answer within {self.timeout}s"
            except Exception as e:  # an engine error: the same budget as an unparseable answer
                error = f"the judge's engine failed: {type(e).__name__}: {e}"
        return JudgeResult(None, text, error, False, self.retries + 1, time.perf_counter() - started)

    async def close(self) -> None:
        if self.on_close is not None:
            self.on_close()


def _context(args):
    ctx = getattr(args, "rollout_context", None)
    if ctx is None:
        raise JudgeError(
            "the judge runs in the rollout process (args.rollout_context); envs.llm_judge does not run on "
            "environment workers (--env-num-workers)"
        )
    return ctx


async def judge_of(ctx) -> Judge:
    """The run's judge (built from the ``--judge-*`` flags on first use, then shared)."""
    if getattr(ctx, "judge", None) is not None:
        return ctx.judge
    from slime_mt.processing import load_tokenizer_or_processor, tokenizer_of

    args = ctx.args
    on_close = None
    template = DEFAULT_TEMPLATE
    if args.judge_template:
        path = Path(args.judge_template)
        if not path.is_file():
            raise JudgeError(f"--judge-template {path}: no such file")
        template = path.read_text()
    if args.judge_use_policy:
        client, tokenizer = ctx.client, ctx.tokenizer
    elif args.judge_model_path is None:
        raise JudgeError(
            "no judge: set --judge-use-policy, --judge-engine-url with --judge-model-path, or --judge-model-path"
        )
    else:
        tokenizer = tokenizer_of(load_tokenizer_or_processor(args.judge_model_path))
        url = args.judge_engine_url
        if url is None:  # an embedded engine serving the judge, off the rollout's loop
            from slime_mt.engine.embedded.server import LocalEngine

            engine = await asyncio.to_thread(lambda: LocalEngine(args.judge_model_path, max_batch_size=16).start())
            url, on_close = engine.url, engine.stop
        client = client_for("local", url, timeout=args.judge_timeout, max_retries=1)
    parse = None
    if args.judge_parser_path:
        parse = load_function(args.judge_parser_path, judge_parser_prototype, "--judge-parser-path")
    ctx.judge = Judge(
        client,
        tokenizer,
        template,
        parse=parse,
        timeout=args.judge_timeout,
        retries=args.judge_retries,
        concurrency=args.judge_concurrency,
        max_new_tokens=args.judge_max_new_tokens,
        max_score=args.judge_max_score,
        on_close=on_close,
    )
    return ctx.judge


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    parts = []
    for message in prompt or []:
        content = message.get("content")
        if isinstance(content, list):
            content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(f"{message.get('role', 'user')}: {content}")
    return "\n".join(parts)


async def judge_reward(args, sample) -> float:
    """A reward function (``--custom-rm-path envs.llm_judge.judge_reward``): the judge's score of the
    sample's response over ``--judge-max-score`` (in [0, 1]). A judge failure fails the sample unless
    ``--judge-failure-reward`` gives the reward to use (``metadata["judge_failed"]`` marks it)."""
    judge = await judge_of(_context(args))
    stats = sample.metadata.setdefault("judge", {})
    result = await judge.grade(
        sample.metadata.get("rollout_id"),
        stats,
        prompt=_prompt_text(sample.prompt),
        response=sample.response,
        label=sample.label,
    )
    sample.metadata["judge_text"] = result.text
    if result.score is None:
        if args.judge_failure_reward is None:
            raise JudgeError(result.error)
        sample.metadata["judge_failed"] = result.error
        return float(args.judge_failure_reward)
    return result.score / judge.max_score


class JudgeFeedbackEnv(BaseInteractionEnv):
    """Each turn the judge grades the model's answer; its critique is the next observation. The episode
    ends when the score reaches ``pass_score`` (or at ``--max-turns``); the reward is the last score
    over the judge's maximum. A judge failure is a turn without a score: the critique says so."""

    def __init__(self, judge: Judge, sample, pass_score: float | None = None) -> None:
        self.judge, self.sample = judge, sample
        self.pass_score = judge.max_score if pass_score is None else pass_score
        self.stats = sample.metadata.setdefault("judge", {})

    async def step(self, response_text: str) -> tuple[dict, bool, dict]:
        result = await self.judge.grade(
            self.sample.metadata.get("rollout_id"),
            self.stats,
            prompt=_prompt_text(self.sample.prompt),
            response=response_text,
            label=self.sample.label,
        )
        if result.score is None:
            critique = f"(The grader could not score this answer: {result.error}.) Please try again."
            return {"text": critique}, False, {"reward": 0.0, "judge_failed": 1.0}
        reward = result.score / self.judge.max_score
        done = result.score >= self.pass_score
        return {"text": result.text.strip()}, done, {"reward": reward, "judge_score": result.score}


async def build_env(sample=None, args=None, **kw) -> JudgeFeedbackEnv:
    judge = await judge_of(_context(args))
    return JudgeFeedbackEnv(judge, sample, args.judge_pass_score)
