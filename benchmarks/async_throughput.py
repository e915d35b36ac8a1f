"""Sync vs --async vs --fully-async on a long-tailed multi-turn workload, measured in one run.

Each mode is a real ``slime-mt train`` (tiny Qwen2, Megatron TP=1) on the same data, against a fresh
embedded engine served in its own process (``slime-mt serve``, reached with ``--engine-url``; weights
go to it through a safetensors folder, as they go to SGLang), so generation and training do not share
one Python interpreter: on GPUs they do not share anything. Every prompt's episode length is drawn
from a heavy-tailed (Pareto) distribution, and one env step in ten is slow. Per mode: trajectories
trained per second over the training steps (from the first step's start to the last step's end),
the trainer's idle fraction (waiting for groups), and for --fully-async the largest version gap of
any trained token (asserted within --max-staleness where the bound drops or masks) and what the bound
removed: the share of generated tokens in dropped groups and masked ones (beyond the bound with
--mask-offpolicy-in-partial-rollout; by the decoupled objective's weight cap and M2PO filter).

Every group the run started counts, not only those that reached a step: the run records how many it
started (``async/groups_started``), each group's scheduled turns are known from its row, and the
turns of the trajectories trained are compared with the scheduled turns of every group started (the
groups still running at the end are the long ones: a figure over finished groups only would pass by
construction); those never trained (dropped, or unfinished at the end) are reported with their
scheduled turns. Every mode runs ``--runs`` times (3) on a fresh workload copy; the decoupled modes
(``--use-decoupled-loss``, S=2; the proximal log-probs recomputed, with M2PO, or interpolated by
version, ``--prox-logp-method loglinear``) are checked against the goals on the median of the runs,
with the spread printed: at least 2.5x sync, trainer idle at most 15%, at most 5% of generated tokens
dropped or masked, trained turns within 10% of the scheduled turns of every group started; a goal
missed prints ``GOAL FAILED`` and exits 1. Each process takes one torch thread by default
(``--threads``): the engine and the trainer each hold a core of their own, as on GPUs each holds its
device, instead of oversubscribing both. The modes run one after another: run it on a quiet machine;
the speedup depends on how long generation takes against training (the env's step times, the tiny
model's speed on these cores) and on the cores free for the two processes.

    .venv/bin/python benchmarks/async_throughput.py [--steps 8] [--runs 3] [--modes sync fully_async_s2_loglinear]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STOPS = [str(t) for t in range(3, 151643, 6)] + ["151645"]  # a random tiny model ends its turns after ~6 tokens
ENV = '''
import asyncio
import random

from envs.base import BaseInteractionEnv


class LongTailEnv(BaseInteractionEnv):
    """Ends after the row's number of turns; one step in ten is slow (a tool that takes its time)."""

    def __init__(self, turns, seed):
        self.turns, self.rng, self.steps = turns, random.Random(seed), 0

    async def step(self, response_text):
        await asyncio.sleep(SLOW if self.rng.random() < 0.1 else FAST)
        self.steps += 1
        done = self.steps >= self.turns
        return {"text": f"Result {self.steps}. Go on."}, done, {"reward": float(len(response_text) % 3 == 0)}


def build_env(sample=None, args=None, **kw):
    return LongTailEnv(sample.metadata["turns"], sample.index)
'''


def write_workload(folder: Path, prompts: int, seed: int, fast: float, slow: float) -> list[int]:
    """The rows and the env -> each row's scheduled turns (group g plays row g mod ``prompts``: no shuffle)."""
    rng = random.Random(seed)
    rows = [
        {
            "prompt": f"Task {i}: explore until you are told to stop.",
            "metadata": {"turns": min(1 + int(rng.paretovariate(1.1)), 12)},
        }
        for i in range(prompts)
    ]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "long_tail_env.py").write_text(textwrap.dedent(ENV).replace("SLOW", str(slow)).replace("FAST", str(fast)))
    return [r["metadata"]["turns"] for r in rows]


def run_mode(
    folder: Path, name: str, flags: list[str], steps: int, batch: int, samples: int, threads: int, turns: list[int]
) -> dict:
    from slime_mt.assets import tiny_model_dir
    from slime_mt.engine.embedded.server import wait_healthy
    from slime_mt.engine.launch import free_port

    run_dir = folder / name
    model = str(tiny_model_dir("qwen2"))
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    if threads:  # torch threads of the engine's and the trainer's process each
        env["OMP_NUM_THREADS"] = str(threads)
    engine = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "slime_mt.cli",
            "serve",
            "--model-path",
            model,
            "--port",
            str(port),
            "--max-batch-size",
            "64",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_healthy(f"http://127.0.0.1:{port}", timeout=120)
        return _train(folder, run_dir, name, model, port, flags, steps, batch, samples, env, turns)
    finally:
        engine.terminate()
        engine.wait()


def _train(folder, run_dir, name, model, port, flags, steps, batch, samples, env, turns) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "slime_mt.cli",
        "train",
        "--hf-checkpoint",
        model,
        "--engine-url",
        f"http://127.0.0.1:{port}",
        "--prompt-data",
        str(folder / "train.jsonl"),
        "--input-key",
        "prompt",
        "--apply-chat-template",
        "--rollout-interaction-env-path",
        str(folder / "long_tail_env.py"),
        "--max-turns",
        "12",
        "--rollout-max-response-len",
        "64",  # turns end at a stop id (~6 tokens), never at the limit: every episode plays its scheduled turns
        "--rollout-max-context-len",
        "2048",
        "--rollout-stop-token-ids",
        *STOPS,
        "--n-samples-per-prompt",
        str(samples),
        "--rollout-batch-size",
        str(batch),
        "--global-batch-size",
        str(batch * samples),
        "--micro-batch-size",
        str(samples),
        "--num-rollout",
        str(steps + (EXTRA_STEPS if "--fully-async" in flags else 0)),
        "--lr",
        "1e-5",
        "--rollout-concurrency",
        "64",
        "--log-dir",
        str(run_dir),
        *flags,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env)
    if proc.returncode:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    records = [json.loads(line) for line in (run_dir / "turns.jsonl").read_text().splitlines()]
    # the timed window: steps 1..steps-1 (the first waits for a cold start in every mode); the extra
    # steps of a fully-async run let the groups started in the window finish, and their waste counts
    timed, whole = summary(name, rows[1:steps], samples), summary(name, rows[1:], samples)
    waste = {k: whole[k] for k in ("dropped_token_share", "masked_token_share", "m2po_masked_share", "dropped")}
    return {**timed, **waste, **started_groups(rows, records, steps, turns)}


# steps a fully-async run goes on after its timed ones, so that every group started in them finishes
# and reaches a step (trained, or dropped beyond the bound): at most (S + 1) x batch groups are out
EXTRA_STEPS = 6


def started_groups(rows: list[dict], records: list[dict], steps: int, turns: list[int]) -> dict:
    """Every group started up to the last timed step (the first, cold, step's too), followed to its end:
    how many; the turns of those trained, per trajectory, against the scheduled turns of all of them
    (the long ones finish last: counted over the groups that finished in time only, the figure would pass
    by construction); those never trained (dropped beyond the bound, or still running when the run
    ended), with their scheduled turns. Sync and --async start exactly the groups they train."""
    last = rows[steps - 1]
    started = int(last.get("async/groups_started", sum(len(r["trained_groups"]) for r in rows[:steps])))
    scheduled = {g: turns[g % len(turns)] for g in range(started)}
    trajectories: dict[int, int] = {}  # sample -> its trained turns
    for line in records:
        if line["group"] in scheduled:
            trajectories[line["sample"]] = max(trajectories.get(line["sample"], 0), line["turn"] + 1)
    trained = {g for r in rows for g in r["trained_groups"]}
    lost = [scheduled[g] for g in scheduled if g not in trained]
    return {
        "started": started,
        "not_trained": len(lost),
        "not_trained_turns": sum(lost) / len(lost) if lost else None,
        "scheduled_turns": sum(scheduled.values()) / max(started, 1),
        "trained_turns_all": sum(trajectories.values()) / max(len(trajectories), 1),
    }


def summary(name: str, rows: list[dict], samples: int) -> dict:
    """One mode's figures over its steps. Generated: the trajectories of the groups that finished and
    reached a step (trained or dropped); sync and --async train every one they generate."""
    wall = sum(r["time/step_seconds"] for r in rows)
    idle = sum(r["time/trainer_idle_seconds"] for r in rows)
    trained_n = sum(r["rollout/samples"] for r in rows)
    dropped_n = sum(r.get("async/dropped_groups", 0) * samples for r in rows)
    fully_async = all("async/generated_tokens" in r for r in rows)
    generated_tokens = sum(r.get("async/generated_tokens", 0) for r in rows)
    trained_tokens = sum(r.get("async/trained_token_share", 0) * r.get("async/generated_tokens", 0) for r in rows)
    dropped_tokens = sum(r.get("async/dropped_token_share", 0) * r.get("async/generated_tokens", 0) for r in rows)
    # masked inside trained groups: beyond the bound (--mask-offpolicy-...), or by the decoupled loss's
    # weight cap and M2PO filter (fractions of each step's trained tokens under --loss-reduction token_mean)
    masked = sum(
        r.get("rollout/masked_stale_tokens", 0)
        + (r.get("train/behav_capped_fraction", 0) + r.get("train/m2po_masked_fraction", 0))
        * r.get("async/trained_token_share", 0)
        * r.get("async/generated_tokens", 0)
        for r in rows
    )
    turns = {
        kind: sum(r.get(f"async/{kind}_turns_mean", 0) * n for r, n in zip(rows, counts))
        for kind, counts in (
            ("trained", [r["rollout/samples"] for r in rows]),
            ("dropped", [r.get("async/dropped_groups", 0) * samples for r in rows]),
        )
    }
    trained_mean = trained_tokens / max(trained_n, 1)
    generated_mean = generated_tokens / max(trained_n + dropped_n, 1)
    return {
        "mode": name,
        "trajectories": trained_n,
        "seconds": wall,
        "idle_fraction": idle / wall,
        "dropped": sum(r.get("async/dropped_groups", 0) for r in rows),
        "resumes": sum(r.get("async/partial_resumes", 0) for r in rows),
        "gap_max": max(r.get("rollout/token_version_gap_max", 0) for r in rows),
        "fully_async": fully_async,
        "dropped_token_share": dropped_tokens / max(generated_tokens, 1),
        "masked_token_share": masked / max(generated_tokens, 1),
        "m2po_masked_share": sum(r.get("train/m2po_masked_fraction", 0) for r in rows) / len(rows),
        "trained_turns": turns["trained"] / max(trained_n, 1),
        "trained_tokens": trained_mean,
        "dropped_turns": turns["dropped"] / dropped_n if dropped_n else None,
        "dropped_tokens": dropped_tokens / dropped_n if dropped_n else None,
        "generated_tokens": generated_mean,
        "length_bias": trained_mean / max(generated_mean, 1e-9) if fully_async else 1.0,
    }


MODES = {
    "sync": ["--use-tis"],
    "async": ["--async", "--use-tis"],
    "fully_async_s1": ["--fully-async", "--partial-rollout", "--max-staleness", "1", "--use-tis"],
    "fully_async_s2": ["--fully-async", "--partial-rollout", "--max-staleness", "2", "--use-tis"],
    "fully_async_s1_mask": [
        "--fully-async",
        "--partial-rollout",
        "--max-staleness",
        "1",
        "--mask-offpolicy-in-partial-rollout",
        "--use-tis",
    ],
    # the decoupled objective: stale groups trained, each token weighted by its own behaviour policy
    "fully_async_s2_decoupled": [
        "--fully-async",
        "--partial-rollout",
        "--max-staleness",
        "2",
        "--use-decoupled-loss",
        "--m2po-threshold",
        "0.04",
    ],
    # the same without the proximal forward pass: its log-probs interpolated by version (AReaL's loglinear)
    "fully_async_s2_loglinear": [
        "--fully-async",
        "--partial-rollout",
        "--max-staleness",
        "2",
        "--use-decoupled-loss",
        "--prox-logp-method",
        "loglinear",
    ],
}
BOUNDED = {"fully_async_s1": 1, "fully_async_s2": 2, "fully_async_s1_mask": 1}  # no trained token staler


GOALS = ("fully_async_s2_decoupled", "fully_async_s2_loglinear")  # checked against the goal line


def one_run(args, run: int) -> dict[str, dict]:
    """Every mode once, on a fresh copy of the workload -> each mode's figures; prints a line each."""
    folder = Path(tempfile.mkdtemp(prefix=f"slime-mt-async-bench-{run}-"))
    turns = write_workload(folder, 400, 0, args.fast, args.slow)
    results: dict[str, dict] = {}
    for name in args.modes:
        flags = MODES[name]
        results[name] = r = run_mode(folder, name, flags, args.steps, args.batch, args.samples, args.threads, turns)
        rate = r["trajectories"] / r["seconds"]
        versus = "".join(
            f", {rate / (results[k]['trajectories'] / results[k]['seconds']):.2f}x {k}"
            for k in ("sync", "async")
            if k in results and k != name
        )
        print(
            f"run {run} {name:25s} {rate:6.2f} trajectories/s{versus}; trainer idle {r['idle_fraction']:5.1%} "
            f"({r['trajectories']} in {r['seconds']:.1f} s; dropped groups {r['dropped']:.0f}, partial resumes "
            f"{r['resumes']:.0f}, max token version gap {r['gap_max']:.0f})",
            flush=True,
        )
        lost = (
            f"; {r['not_trained']} never trained (dropped, or unfinished at the end), scheduled "
            f"{r['not_trained_turns']:.2f} turns each"
            if r["not_trained"]
            else ""
        )
        print(
            f"{'':31s} groups started {r['started']}: scheduled {r['scheduled_turns']:.2f} turns per trajectory, "
            f"trained {r['trained_turns_all']:.2f} (bias {r['trained_turns_all'] / r['scheduled_turns']:.3f}){lost}",
            flush=True,
        )
        if r["fully_async"]:
            print(
                f"{'':31s} generated tokens dropped {r['dropped_token_share']:.1%}, masked "
                f"{r['masked_token_share']:.1%} (M2PO {r['m2po_masked_share']:.1%} of trained); tokens per "
                f"trajectory trained {r['trained_tokens']:.1f} against {r['generated_tokens']:.1f} generated",
                flush=True,
            )
    for name, bound in BOUNDED.items():
        if name in results:
            assert results[name]["gap_max"] <= bound, f"{name}: a trained token is {results[name]['gap_max']} old"
    return results


def goal_figures(runs: list[dict[str, dict]], name: str) -> dict[str, list[float]]:
    """``name``'s figures in each run: its rate over sync's, its waste and its turn bias."""
    out: dict[str, list[float]] = {"speedup": [], "idle": [], "waste": [], "bias": []}
    for results in runs:
        goal, sync = results[name], results["sync"]
        out["speedup"].append((goal["trajectories"] / goal["seconds"]) / (sync["trajectories"] / sync["seconds"]))
        out["idle"].append(goal["idle_fraction"])
        out["waste"].append(goal["dropped_token_share"] + goal["masked_token_share"])
        out["bias"].append(goal["trained_turns_all"] / goal["scheduled_turns"])
    return out


def workload_arguments(doc: str) -> argparse.ArgumentParser:
    """The workload's flags (steps, batch, samples, env step times, torch threads), which
    ``benchmarks/async_eval.py`` shares."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4, help="prompt groups per step")
    parser.add_argument("--samples", type=int, default=4, help="trajectories per prompt")
    parser.add_argument("--fast", type=float, default=0.5, help="seconds of an env step")
    parser.add_argument("--slow", type=float, default=5.0, help="seconds of a slow env step (one in ten)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of the engine's and of the trainer's process (0: torch's default, each takes every "
        "core and they oversubscribe them)",
    )
    return parser


def main() -> int:
    parser = workload_arguments(__doc__)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES), help="sync first")
    parser.add_argument("--runs", type=int, default=3, help="runs of every mode; the goals hold for the median")
    args = parser.parse_args()
    runs = [one_run(args, run) for run in range(args.runs)]
    failed = []
    for name in GOALS:
        if name not in args.modes or "sync" not in args.modes:
            continue
        f = goal_figures(runs, name)
        med = {k: statistics.median(v) for k, v in f.items()}
        spread = {k: f"{min(v):.2f}-{max(v):.2f}" for k, v in f.items()}
        checks = [
            (med["speedup"] >= 2.5, f"{med['speedup']:.2f}x sync (>= 2.5; runs {spread['speedup']})"),
            (med["idle"] <= 0.15, f"trainer idle {med['idle']:.1%} (<= 15%)"),
            (med["waste"] <= 0.05, f"generated tokens dropped or masked {med['waste']:.1%} (<= 5%)"),
            (
                abs(med["bias"] - 1) <= 0.1,
                f"trained turns over the scheduled turns of every group started {med['bias']:.3f} (within 0.9-1.1; "
                f"runs {spread['bias']})",
            ),
        ]
        print(f"{name}, median of {args.runs} runs: " + "; ".join(text for _, text in checks))
        failed += [f"{name}: {text}" for ok, text in checks if not ok]
    for line in failed:
        print(f"GOAL FAILED {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
