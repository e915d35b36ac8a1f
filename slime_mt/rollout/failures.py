"""Failures and truncations a user can fix, made visible: one record per sample, one report per step.

Where a sample fails (env step, env build, engine, generate function, reward), ``fail`` marks it
FAILED and keeps on ``sample.metadata``: ``error`` (the full message), ``error_cause`` (a short cause
that groups like failures: ``env step raised ValueError``, ``bad env return``), ``error_turn`` and
``traceback``. ``StepReport`` reads a step's samples: it logs one line per failed or truncated sample
(the first ``LINES_PER_CAUSE`` of each cause in full, then a count), appends every failure with its
traceback to ``RUN_DIR/errors.jsonl``, gives the step line's summary (``3 failed: env step raised
ValueError x2, bad env return x1``) and warns when the step cannot teach the model anything: most
turns cut at the length limit, or every group's rewards equal.
"""

from __future__ import annotations

import collections
import json
import logging
import traceback
from pathlib import Path

from slime_mt.types import Sample, Status

logger = logging.getLogger("slime_mt.failures")

LINES_PER_CAUSE = 3  # per step; the rest of a cause is counted
LENGTH_WARNING_SHARE = 0.5  # warn when more than this share of a step's turns end at the length limit

TRUNCATION_CAUSES = {
    "engine_length": "turn hit the length limit (--rollout-max-response-len, or what --rollout-max-context-len left)",
    "context_exhausted": "context full before the turn (--rollout-max-context-len)",
    "observation_cut": "observation cut to fit --rollout-max-context-len",
    "invalid_actions": "the env rejected more actions in a row than --max-invalid-actions-per-turn allows",
}


def fail(sample: Sample, cause: str, message: str, error: BaseException | None = None) -> None:
    """Mark ``sample`` FAILED with a grouping ``cause``, the full ``message`` and, for an exception,
    its traceback; the turn is the one in progress (the number of turns recorded so far)."""
    sample.status = Status.FAILED
    sample.metadata["error"] = message
    sample.metadata["error_cause"] = cause
    sample.metadata["error_turn"] = len(sample.turns)
    if error is not None:
        sample.metadata["traceback"] = "".join(traceback.format_exception(error))


def cause_of(sample: Sample) -> str | None:
    """Why a sample failed or was truncated (None: neither)."""
    if sample.status == Status.FAILED:
        return sample.metadata.get("error_cause") or "failed (no cause recorded)"
    if sample.status == Status.TRUNCATED:
        reason = sample.metadata.get("termination")
        return TRUNCATION_CAUSES.get(reason, reason or "no reason recorded")
    return None


def summary(counts: collections.Counter, what: str) -> str:
    """``3 failed: env step raised ValueError x2, bad env return x1`` ('' when there are none)."""
    total = sum(counts.values())
    if not total:
        return ""
    parts = ", ".join(f"{cause} x{n}" for cause, n in counts.most_common())
    return f"{total} {what}: {parts}"


class StepReport:
    """What went wrong in one step's samples; ``log`` writes it out once."""

    def __init__(self, step: int, groups: list[list[Sample]], label: str = "step"):
        self.step = step
        self.label = label
        self.samples = [s for g in groups for s in g]
        self.groups = [g for g in groups if g]
        self.failed = collections.Counter(cause_of(s) for s in self.samples if s.status == Status.FAILED)
        self.truncated = collections.Counter(cause_of(s) for s in self.samples if s.status == Status.TRUNCATED)

    @property
    def all_failed(self) -> bool:
        return bool(self.samples) and all(s.status == Status.FAILED for s in self.samples)

    def line(self) -> str:
        """The step line's part: ``3 failed: ...`` and ``2 truncated: ...``; '' when all went well."""
        truncated = collections.Counter({_short(c): n for c, n in self.truncated.items()})
        return " | ".join(p for p in (summary(self.failed, "failed"), summary(truncated, "truncated")) if p)

    def log(self, errors_path: Path | None = None) -> None:
        """One line per failed or truncated sample (rate-limited per cause), every failure to
        ``errors_path`` (jsonl, appended), and the no-learning-signal warnings."""
        shown: collections.Counter = collections.Counter()
        for s in self.samples:
            cause = cause_of(s)
            if cause is None:
                continue
            cause = f"{s.status.value}: {cause}"
            shown[cause] += 1
            if shown[cause] > LINES_PER_CAUSE:
                continue
            level = logging.WARNING if s.status == Status.FAILED else logging.INFO
            logger.log(level, "%s %d: %s", self.label, self.step, _sample_line(s))
        for cause, n in shown.items():
            if n > LINES_PER_CAUSE:
                level = logging.WARNING if cause.startswith(Status.FAILED.value) else logging.INFO
                logger.log(level, "%s %d: ... and %d more: %s", self.label, self.step, n - LINES_PER_CAUSE, cause)
        if errors_path is not None:
            self._write_errors(errors_path)
        self._warn_length()
        self._warn_equal_rewards()

    def _write_errors(self, path: Path) -> None:
        rows = [
            {
                "step": self.step,
                "kind": self.label,
                "sample": s.index,
                "group": s.group_index,
                "turn": s.metadata.get("error_turn", len(s.turns)),
                "cause": cause_of(s),
                "error": s.metadata.get("error", ""),
                "traceback": s.metadata.get("traceback"),
            }
            for s in self.samples
            if s.status == Status.FAILED
        ]
        if rows:
            with open(path, "a") as fh:
                fh.write("".join(json.dumps(row) + "\n" for row in rows))

    def _warn_length(self) -> None:
        turns = [t for s in self.samples for t in s.turns]
        cut = sum(t.finish_reason == "length" for t in turns)
        if turns and cut / len(turns) > LENGTH_WARNING_SHARE:
            logger.warning(
                "%s %d: %d of %d turns ended at the length limit (finish_reason length), so the env saw "
                "few finished answers: raise --rollout-max-response-len or check the stop tokens "
                "(--rollout-stop, --rollout-stop-token-ids)",
                self.label,
                self.step,
                cut,
                len(turns),
            )

    def _warn_equal_rewards(self) -> None:
        rewards = [
            [float(s.reward or 0.0) for s in g if s.status != Status.FAILED and not isinstance(s.reward, dict)]
            for g in self.groups
        ]
        rewards = [r for r in rewards if len(r) > 1]
        if not rewards or any(max(r) != min(r) for r in rewards):
            return
        values = sorted({r[0] for r in rewards})
        shown = ", ".join(f"{v:g}" for v in values[:4]) + (", ..." if len(values) > 4 else "")
        logger.warning(
            "%s %d: every group's rewards are equal within the group (%s): the advantages are 0, so the "
            "loss and the grad norm are 0 and nothing is learned from this step; check the reward "
            "(--custom-rm-path, the env's info['reward'], --label-key) or the task's difficulty",
            self.label,
            self.step,
            shown,
        )


def _short(cause: str) -> str:
    """A truncation cause without its flag advice, for the step line."""
    return cause.split(" (")[0]


def _sample_line(s: Sample) -> str:
    if s.status == Status.FAILED:
        turn = s.metadata.get("error_turn", len(s.turns))
        return f"sample {s.index} (group {s.group_index}) failed at turn {turn}: {s.metadata.get('error', '')}"
    return f"sample {s.index} (group {s.group_index}) truncated at turn {max(len(s.turns) - 1, 0)}: {cause_of(s)}"
