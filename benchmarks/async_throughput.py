"""Sync vs --async vs --fully-async on a long-tailed multi-turn workload, measured in one run.

Each mode is a real ``slime-mt train`` (tiny Qwen2, Megatron TP=1) on the same data, against a fresh
embedded engine served in its own process (``slime-mt serve``, reached with ``--engine-url``; weights
go to it through a safetensors folder, as they go to SGLang), so generation and training do not share
one Python interpreter: on GPUs they do not share anything. Every prompt's episode length is drawn
from a heavy-tailed (Pareto) distribution, and one env step in ten is slow. Per mode: trajectories
trained per second over the training steps (from the first step's start to the last step's end),
the trainer's idle fraction (waiting for groups), and for --fully-async the largest version gap of
any trained token (asserted within --max-staleness where the bound drops or masks), what the bound removed: the share of
generated tokens in dropped groups and masked ones (beyond the bound with
--mask-offpolicy-in-partial-rollout; by the decoupled objective's weight cap and M2PO filter), the
mean turns and generated tokens per trajectory of dropped against trained groups (the groups that
outlive the bound are the long ones) and the length bias: trained mean tokens per trajectory over the
generated mean. The last lines check the decoupled modes (``--use-decoupled-loss``, S=2; the proximal log-probs
recomputed, with M2PO, or interpolated by version, ``--prox-logp-method loglinear``) against the
goals: at least 2.5x sync, trainer idle at most 15%, at most 5% of generated tokens dropped or
masked, length bias within 10%. Each process takes one torch thread by default (``--threads``): the
engine and the trainer each hold a core of their own, as on GPUs each holds its device, instead of
oversubscribing both. The modes run one after another: run it on a quiet machine.

    .venv/bin/python benchmarks/async_throughput.py [--steps 8] [--modes sync fully_async_s2_decoupled]
"""

from __future__ import annotations

import argparse
import json
import os
import random
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


def write_workload(folder: Path, prompts: int, seed: int, fast: float, slow: float) -> None:
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


def run_mode(folder: Path, name: str, flags: list[str], steps: int, batch: int, samples: int, threads: int) -> dict:
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
        return _train(folder, run_dir, name, model, port, flags, steps, batch, samples, env)
    finally:
        engine.terminate()
        engine.wait()


def _train(folder, run_dir, name, model, port, flags, steps, batch, samples, env) -> dict:
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
        "16",
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
        str(steps),
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
    return summary(name, rows[1:], samples)  # the first step waits for a cold start in every mode


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4, help="prompt groups per step")
    parser.add_argument("--samples", type=int, default=4, help="trajectories per prompt")
    parser.add_argument("--fast", type=float, default=0.5, help="seconds of an env step")
    parser.add_argument("--slow", type=float, default=5.0, help="seconds of a slow env step (one in ten)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES), help="sync first")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of the engine's and of the trainer's process (0: torch's default, each takes every "
        "core and they oversubscribe them)",
    )
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="slime-mt-async-bench-"))
    write_workload(folder, 400, 0, args.fast, args.slow)
    results = {}
    for name in args.modes:
        results[name] = r = run_mode(folder, name, MODES[name], args.steps, args.batch, args.samples, args.threads)
        rate = r["trajectories"] / r["seconds"]
        versus = "".join(
            f", {rate / (results[k]['trajectories'] / results[k]['seconds']):.2f}x {k}"
            for k in ("sync", "async")
            if k in results and k != name
        )
        print(
            f"{name:25s} {rate:6.2f} trajectories/s{versus}; trainer idle {r['idle_fraction']:5.1%} "
            f"({r['trajectories']} in {r['seconds']:.1f} s; dropped groups {r['dropped']:.0f}, partial resumes "
            f"{r['resumes']:.0f}, max token version gap {r['gap_max']:.0f})",
            flush=True,
        )
        if r["fully_async"]:
            dropped = (
                f"; dropped trajectories {r['dropped_turns']:.2f} turns, {r['dropped_tokens']:.1f} tokens"
                if r["dropped_turns"] is not None
                else ""
            )
            print(
                f"{'':25s} generated tokens dropped {r['dropped_token_share']:.1%}, masked "
                f"{r['masked_token_share']:.1%} (M2PO {r['m2po_masked_share']:.1%} of trained); per trajectory "
                f"trained {r['trained_turns']:.2f} turns, {r['trained_tokens']:.1f} tokens against "
                f"{r['generated_tokens']:.1f} generated: length bias {r['length_bias']:.3f}{dropped}",
                flush=True,
            )
    for name, bound in BOUNDED.items():
        if name in results:
            assert results[name]["gap_max"] <= bound, f"{name}: a trained token is {results[name]['gap_max']} old"
    for name in ("fully_async_s2_decoupled", "fully_async_s2_loglinear"):
        goal = results.get(name)
        if goal is None or "sync" not in results:
            continue
        sync = results["sync"]
        speedup = (goal["trajectories"] / goal["seconds"]) / (sync["trajectories"] / sync["seconds"])
        waste = goal["dropped_token_share"] + goal["masked_token_share"]
        print(
            f"{name} against the goals: {speedup:.2f}x sync (>= 2.5), trainer idle "
            f"{goal['idle_fraction']:.1%} (<= 15%), generated tokens dropped or masked {waste:.1%} (<= 5%), "
            f"length bias {goal['length_bias']:.3f} (within 0.9-1.1)"
        )


if __name__ == "__main__":
    main()
