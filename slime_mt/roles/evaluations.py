"""When the rollout role evaluates, and where its figures go.

Sync runs evaluate between steps: the baseline before the first rollout, then after every
``--eval-interval`` steps, the run waiting for it (slime's order). ``--async`` and ``--fully-async``
(``config.eval_beside_rollout``) evaluate beside the rollout: an evaluation starts once the weights it
evaluates reach the engines, runs while the next step generates and trains (its requests last, where
the engines schedule by priority: ``engine/clients/priority.py``), and the next weight update waits
for it (``settle``, from the role's ``drain``), so every token it generates comes from the weights it
evaluates. Its figures are logged when it is settled: ``eval/weight_version`` is read from its samples
(the version each turn was generated with), and ``eval/update_wait_seconds`` is what the weight update
waited for it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time

from slime_mt.plugins import load_function
from slime_mt.rollout.evaluation import evaluate
from slime_mt.rollout.failures import StepReport
from slime_mt.rollout.staleness import turn_versions
from slime_mt.timeline import maybe_span

logger = logging.getLogger(__name__)


class Evaluations:
    """The rollout role's evaluations (``side``: the role, whose context, records, metrics and errors
    file they use)."""

    def __init__(self, side, beside: bool) -> None:
        self.side = side
        # beside the rollout: one thread for the evaluation in flight (None: sync runs evaluate now)
        self.pool = concurrent.futures.ThreadPoolExecutor(1, "slime-mt-eval") if beside else None
        self.pending: concurrent.futures.Future | None = None

    def due(self, steps_trained: int) -> None:
        """The engines serve the weights after ``steps_trained`` steps and an evaluation is due: it runs
        now (sync runs), or starts beside the rollout (one at a time: one still running is settled first)."""
        if self.pool is None:
            self.now(steps_trained)
            return
        self.settle()
        self.pending = self.pool.submit(self.run, steps_trained)

    def now(self, steps_trained: int) -> None:
        """An evaluation run here and logged, the caller waiting for it."""
        self.log(*self.run(steps_trained))

    def settle(self) -> float:
        """The evaluation in flight, if any, finished and logged -> seconds waited for it."""
        if self.pending is None:
            return 0.0
        waited = time.perf_counter()
        pending, self.pending = self.pending, None
        result = pending.result()
        seconds = time.perf_counter() - waited
        self.log(*result, {"eval/update_wait_seconds": seconds})
        return seconds

    def run(self, steps_trained: int) -> tuple[int, dict[str, float], list]:
        """Every held-out dataset on the engines' current weights -> (steps trained, metrics, each
        dataset's groups)."""
        side = self.side
        path = side.cfg.evaluation.eval_function_path
        eval_fn = load_function(path, what="--eval-function-path") if path else None
        began = time.perf_counter()
        with maybe_span(side.ctx.timeline, "evaluate", "step", lane="eval", step=steps_trained):
            metrics, reports = evaluate(side.ctx, side.eval_sets, eval_fn, steps_trained)
        metrics["eval/seconds"] = time.perf_counter() - began
        return steps_trained, metrics, reports

    def log(self, steps_trained: int, metrics: dict[str, float], reports: list, extra: dict | None = None) -> None:
        """An evaluation's failures, dump and figures (its weight version read from its samples)."""
        side = self.side
        for name, groups in reports:
            StepReport(steps_trained, groups, label=f"eval {name} after steps").log(side.errors_path)
        side.records.evaluated(steps_trained, reports)
        metrics.update(weight_versions(reports, steps_trained))
        side.metrics.log_eval(steps_trained, {**metrics, **(extra or {})})

    def close(self) -> None:
        """The run ends: the evaluation in flight is logged (the last one, after the last step), or,
        where it failed, its error logged without hiding what ended the run."""
        if self.pool is None:
            return
        try:
            self.settle()
        except Exception:
            logger.exception("the evaluation in flight failed")
        finally:
            self.pool.shutdown(wait=False, cancel_futures=True)


def weight_versions(reports: list, steps_trained: int) -> dict[str, float]:
    """The weight version an evaluation's samples were generated with (``eval/weight_version``; the
    steps trained where no turn recorded one); two or more: the highest as well, and a warning, for an
    evaluation must see one version."""
    versions = {v for _, groups in reports for v in turn_versions(groups)}
    if not versions:
        return {"eval/weight_version": float(steps_trained)}
    if len(versions) == 1:
        return {"eval/weight_version": float(versions.pop())}
    logger.warning("the evaluation after %d steps saw weight versions %s", steps_trained, sorted(versions))
    return {"eval/weight_version": float(min(versions)), "eval/weight_version_max": float(max(versions))}
