"""Evaluation beside a fully-async rollout (issue 69): the same run without an evaluation, with one every
step, and with an agentic one every step, measured in one run of this script.

All three are real ``slime-mt train`` runs of ``benchmarks/async_throughput.py``'s workload (tiny Qwen2,
Megatron TP=1, a fresh embedded engine in its own process reached with ``--engine-url``, episodes of
heavy-tailed length with one slow env step in ten) in its goal mode (``--fully-async --partial-rollout
--max-staleness 2 --use-decoupled-loss --prox-logp-method loglinear``). The second adds
``--eval-prompt-data`` with ``--eval-interval 1``: ``--eval-rows`` held-out prompts of one turn each (a
benchmark's question and answer, as slime's aime and gpqa are), one trajectory each, the same env; the
third the same number of held-out prompts drawn as the training rows are (multi-turn, heavy-tailed: an
agentic benchmark). Each evaluation runs beside the rollout, its requests last in the engine's queue
(the embedded engine schedules by priority), and the next weight update waits for it: it sees one
version of the weights, so an evaluation longer than a training step holds the trainer (and, through
``--max-staleness``, the rollout) until it ends.

Per run: the training trajectories per second over the timed steps (the rollout throughput the trainer
sees: the trajectories it trains), the generated tokens per second (every token the training rollout
generated, trained or not) and the trainer's idle share; with eval, every evaluation's weight version
(each must equal its step: one version per evaluation), its length and what the weight updates waited
for it. The goal: with the evaluation of one-turn prompts every step, the rollout throughput at least 90%
of the run without eval (``GOAL FAILED`` and exit 1 otherwise), on the median over ``--runs``; the agentic
evaluation's figure is printed beside it.

    .venv/bin/python benchmarks/async_eval.py [--steps 8] [--runs 1] [--eval-rows 8]
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

from async_throughput import MODES, run_mode, workload_arguments, write_workload

MODE = "fully_async_s2_loglinear"


def write_eval_rows(folder: Path, name: str, rows: int, seed: int, one_turn: bool) -> Path:
    """Held-out rows of the workload: one turn each (``one_turn``), else turns drawn as the training rows'."""
    rng = random.Random(seed)
    path = folder / f"{name}.jsonl"
    lines = [
        json.dumps(
            {
                "prompt": f"Held-out task {i}: explore until you are told to stop.",
                "metadata": {"turns": 1 if one_turn else min(1 + int(rng.paretovariate(1.1)), 12)},
            }
        )
        for i in range(rows)
    ]
    path.write_text("".join(line + "\n" for line in lines))
    return path


RUNS = (("without_eval", None), ("with_eval", True), ("with_agentic_eval", False))


def one_run(args, run: int) -> dict[str, dict]:
    """The three runs on one workload copy -> each one's figures."""
    folder = Path(tempfile.mkdtemp(prefix=f"slime-mt-async-eval-{run}-"))
    turns = write_workload(folder, 400, 0, args.fast, args.slow)
    out: dict[str, dict] = {}
    for name, one_turn in RUNS:
        extra = []
        if one_turn is not None:
            held_out = write_eval_rows(folder, name, args.eval_rows, 1, one_turn)
            extra = ["--eval-prompt-data", "held_out", str(held_out), "--eval-interval", "1"]
        r = run_mode(folder, name, MODES[MODE] + extra, args.steps, args.batch, args.samples, args.threads, turns)
        r.update(_rates(folder / name, args.steps))
        out[name] = r
        versus = "" if one_turn is None else f" ({r['rate'] / out['without_eval']['rate']:.1%} of it without eval)"
        print(
            f"run {run} {name:17s} {r['rate']:6.2f} trajectories/s{versus}, {r['token_rate']:7.1f} generated "
            f"tokens/s; trainer idle {r['idle_fraction']:5.1%} ({r['trajectories']} in {r['seconds']:.1f} s)",
            flush=True,
        )
        if one_turn is not None:
            print(f"{'':23s} {_evaluations(folder / name, args.eval_rows)}", flush=True)
    return out


def _evaluations(run_dir: Path, rows_each: int) -> str:
    """Every evaluation of the weights it names (asserted) -> a line on their length and waits."""
    rows = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    versions = [(row["step"], row["eval/weight_version"]) for row in rows]
    assert all(step == version for step, version in versions), f"an evaluation saw other weights: {versions}"
    assert all("eval/weight_version_max" not in row for row in rows), "an evaluation saw two weight versions"
    waits = sum(row.get("eval/update_wait_seconds", 0.0) for row in rows)
    each = statistics.fmean(row["eval/seconds"] for row in rows)
    return (
        f"{len(rows)} evaluations of {rows_each} trajectories, each of the weights it names (after steps "
        f"{rows[0]['step']}..{rows[-1]['step']}); {each:.1f} s each, the weight updates waited {waits:.1f} s in all"
    )


def _rates(run_dir: Path, steps: int) -> dict:
    """The timed steps' rates (1..steps-1: the first waits for a cold start), as async_throughput times them."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:steps]
    wall = sum(r["time/step_seconds"] for r in rows)
    return {
        "rate": sum(r["rollout/samples"] for r in rows) / wall,
        "token_rate": sum(r.get("async/generated_tokens", 0) for r in rows) / wall,
    }


def main() -> int:
    parser = workload_arguments(__doc__)
    parser.add_argument("--eval-rows", type=int, default=8, help="held-out prompts evaluated every step")
    parser.add_argument("--runs", type=int, default=1, help="runs of the three; the goal holds for the median")
    args = parser.parse_args()
    runs = [one_run(args, run) for run in range(args.runs)]
    ratios = {
        name: statistics.median(r[name]["rate"] / r["without_eval"]["rate"] for r in runs) for name, _ in RUNS[1:]
    }
    print(
        f"{MODE}, eval every step, median of {args.runs}: one-turn eval {ratios['with_eval']:.1%} of the "
        f"trajectories/s without eval (>= 90%); agentic eval {ratios['with_agentic_eval']:.1%}"
    )
    if ratios["with_eval"] < 0.9:
        print(f"GOAL FAILED rollout throughput with eval {ratios['with_eval']:.1%} of the run without (>= 90%)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
