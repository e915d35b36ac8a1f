"""Sync vs --async vs --fully-async on a long-tailed multi-turn workload, measured in one run.

Each mode is a real ``slime-mt train`` (tiny Qwen2, Megatron TP=1) on the same data, against a fresh
embedded engine served in its own process (``slime-mt serve``, reached with ``--engine-url``; weights
go to it through a safetensors folder, as they go to SGLang), so generation and training do not share
one Python interpreter: on GPUs they do not share anything. Every prompt's episode length is drawn
from a heavy-tailed (Pareto) distribution, and one env step in ten is slow. Per mode: trajectories
trained per second over the training steps (from the first step's start to the last step's end),
the trainer's idle fraction (waiting for groups), and for --fully-async the largest version gap of
any trained token, asserted to be within --max-staleness, and what the bound removed: the share of
generated tokens in dropped groups (or masked, with --mask-offpolicy-in-partial-rollout) and the mean
turns and generated tokens per trajectory of dropped against trained groups (the groups that outlive
the bound are the long ones). The modes run one after another: run it on a quiet machine.

    .venv/bin/python benchmarks/async_throughput.py [--steps 8]
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


def run_mode(folder: Path, name: str, flags: list[str], steps: int, batch: int, samples: int) -> dict:
    from slime_mt.assets import tiny_model_dir
    from slime_mt.engine.embedded.server import wait_healthy
    from slime_mt.engine.launch import free_port

    run_dir = folder / name
    model = str(tiny_model_dir("qwen2"))
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
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
        "--use-tis",
        "--log-dir",
        str(run_dir),
        *flags,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env)
    if proc.returncode:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = rows[1:]  # the first step waits for a cold start in every mode
    wall = sum(r["time/step_seconds"] for r in rows)
    idle = sum(r["time/trainer_idle_seconds"] for r in rows)
    kept = [
        (r["rollout/samples"], r.get("async/trained_turns_mean"), r.get("async/trained_generated_tokens_mean"))
        for r in rows
    ]
    lost = [
        (
            r.get("async/dropped_groups", 0) * samples,
            r.get("async/dropped_turns_mean"),
            r.get("async/dropped_generated_tokens_mean"),
        )
        for r in rows
    ]
    kept_tokens, lost_tokens = _total(kept, 2), _total(lost, 2)
    return {
        "mode": name,
        "trajectories": sum(r["rollout/samples"] for r in rows),
        "seconds": wall,
        "idle_fraction": idle / wall,
        "dropped": sum(r.get("async/dropped_groups", 0) for r in rows),
        "resumes": sum(r.get("async/partial_resumes", 0) for r in rows),
        "gap_max": max(r.get("rollout/token_version_gap_max", 0) for r in rows),
        "dropped_token_share": lost_tokens / max(kept_tokens + lost_tokens, 1),
        "masked_token_share": sum(r.get("rollout/masked_stale_tokens", 0) for r in rows) / max(kept_tokens, 1),
        "trained_turns": _mean(kept, 1),
        "trained_tokens": _mean(kept, 2),
        "dropped_turns": _mean(lost, 1),
        "dropped_tokens": _mean(lost, 2),
    }


def _total(steps: list[tuple], k: int) -> float:
    """Sum over steps of (trajectories x the step's mean of field k)."""
    return sum(step[0] * step[k] for step in steps if step[k] is not None)


def _mean(steps: list[tuple], k: int) -> float | None:
    """Per-trajectory mean of field k over the steps (weighted by their trajectories); None without any."""
    n = sum(step[0] for step in steps if step[k] is not None)
    return _total(steps, k) / n if n else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4, help="prompt groups per step")
    parser.add_argument("--samples", type=int, default=4, help="trajectories per prompt")
    parser.add_argument("--fast", type=float, default=0.5, help="seconds of an env step")
    parser.add_argument("--slow", type=float, default=5.0, help="seconds of a slow env step (one in ten)")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="slime-mt-async-bench-"))
    write_workload(folder, 400, 0, args.fast, args.slow)
    modes = [
        ("sync", []),
        ("async", ["--async"]),
        ("fully_async_s1", ["--fully-async", "--partial-rollout", "--max-staleness", "1"]),
        ("fully_async_s2", ["--fully-async", "--partial-rollout", "--max-staleness", "2"]),
        (
            "fully_async_s1_mask",
            ["--fully-async", "--partial-rollout", "--max-staleness", "1", "--mask-offpolicy-in-partial-rollout"],
        ),
    ]
    results = {}
    for name, flags in modes:
        results[name] = r = run_mode(folder, name, flags, args.steps, args.batch, args.samples)
        print(
            f"{name:15s} {r['trajectories'] / r['seconds']:6.2f} trajectories/s  trainer idle "
            f"{r['idle_fraction']:5.1%}  ({r['trajectories']} in {r['seconds']:.1f} s; dropped groups "
            f"{r['dropped']:.0f}, partial resumes {r['resumes']:.0f}, max token version gap {r['gap_max']:.0f})",
            flush=True,
        )
        if name.startswith("fully_async"):
            lost = (
                f"dropped {r['dropped_token_share']:.1%} of generated tokens"
                if r["dropped"]
                else f"dropped none, masked {r['masked_token_share']:.1%} of trained tokens"
            )
            dropped = (
                f"; dropped groups {r['dropped_turns']:.2f} turns, {r['dropped_tokens']:.1f} tokens"
                if r["dropped_turns"] is not None
                else ""
            )
            print(
                f"{'':15s} bias: {lost}; per trajectory, trained groups {r['trained_turns']:.2f} turns, "
                f"{r['trained_tokens']:.1f} tokens{dropped}",
                flush=True,
            )
    for name, bound in (("fully_async_s1", 1), ("fully_async_s2", 2), ("fully_async_s1_mask", 1)):
        assert results[name]["gap_max"] <= bound, f"{name}: a trained token is {results[name]['gap_max']} versions old"
    rate = {k: v["trajectories"] / v["seconds"] for k, v in results.items()}
    for name in ("fully_async_s1", "fully_async_s2"):
        print(
            f"{name}: {rate[name] / rate['sync']:.2f}x sync (goal >= 1.5), "
            f"{rate[name] / rate['async']:.2f}x --async (goal >= 1.2)"
        )
    print("staleness bound held in every fully-async step")


if __name__ == "__main__":
    main()
