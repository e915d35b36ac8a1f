"""Environments in the rollout's threads against environment workers (``--env-num-workers``), in one run.

The environment is CPU-heavy: each step is pure Python (a loop calibrated to about 200 ms here), the
kind a simulator or a checker is, which threads of one interpreter cannot run side by side. The same
trajectories (build, reset, ``--steps`` steps, close; 16 in flight) go through the rollout's own env
calls (``open_env``, ``step_with_retries``) twice: in-process, where a sync step runs on the rollout's
thread pool, and on 2 environment workers (Ray actors, one CPU each, on a local Ray); the two
alternate ``--repeats`` times, so the shared machine's load falls on both alike. Printed: the median
trajectories per second of each and their ratio (goal: at least 1.5x on a 2-core machine), and the
median time of one ``step`` call of an environment that does nothing, in-process and remote, whose
difference is the remote call's overhead (goal: at most 2 ms).

    .venv/bin/python benchmarks/env_workers.py [--trajectories 16] [--steps 3] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

ENV = """
from envs.base import BaseInteractionEnv


def burn(iterations):
    total = 0
    for i in range(iterations):
        total += i * i % 7
    return total


class Heavy(BaseInteractionEnv):
    def __init__(self, iterations):
        self.iterations = iterations

    def step(self, response_text):
        burn(self.iterations)
        return {"text": "ok"}, False, {}


def build_env(sample=None, args=None, **kw):
    return Heavy(int(sample.label))
"""


def calibrate(module, seconds: float) -> int:
    """Loop iterations that take ``seconds`` in this interpreter."""
    iterations = 200_000
    while True:
        started = time.perf_counter()
        module.burn(iterations)
        took = time.perf_counter() - started
        if took > 0.05:
            return int(iterations * seconds / took)
        iterations *= 2


async def trajectories(ctx, open_env, count: int, steps: int, label: str) -> float:
    """``count`` trajectories at once -> seconds for all."""
    from slime_mt.rollout.env_steps import call_env, step_with_retries
    from slime_mt.types import Sample

    async def one(i: int) -> None:
        env = await open_env(Sample(index=i, prompt="p", label=label))
        await call_env(ctx, env.reset)
        for _ in range(steps):
            await step_with_retries(ctx, env, "move")
        await call_env(ctx, env.close)

    started = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(count)))
    return time.perf_counter() - started


async def step_latency(ctx, open_env, calls: int) -> float:
    """Median seconds of one ``step`` of an environment that does nothing."""
    from slime_mt.rollout.env_steps import step_with_retries
    from slime_mt.types import Sample

    env = await open_env(Sample(index=0, prompt="p", label="0"))
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        await step_with_retries(ctx, env, "move")
        times.append(time.perf_counter() - started)
    close = env.close()
    if asyncio.iscoroutine(close):
        await close
    return statistics.median(times[10:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trajectories", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--step-seconds", type=float, default=0.2)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import ray

    from slime_mt.config import RolloutConfig
    from slime_mt.plugins import load_module
    from slime_mt.rollout.env_workers import EnvWorkerPool

    folder = Path(tempfile.mkdtemp(prefix="env_workers_bench_"))
    path = folder / "heavy_env.py"
    path.write_text(ENV)
    module = load_module(str(path))
    iterations = calibrate(module, args.step_seconds)
    ctx = argparse.Namespace(rollout=RolloutConfig(), env_executor=ThreadPoolExecutor(64, "slime-mt-env"))

    async def in_process(sample):
        return module.build_env(sample=sample)

    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    pool = EnvWorkerPool(2, 1, str(path), argparse.Namespace())
    try:
        threads, workers = [], []
        for _ in range(args.repeats):
            for seconds, open_env in ((threads, in_process), (workers, pool.open_env)):
                seconds.append(asyncio.run(trajectories(ctx, open_env, args.trajectories, args.steps, str(iterations))))
        threads, workers = statistics.median(threads), statistics.median(workers)
        local_step = asyncio.run(step_latency(ctx, in_process, args.calls))
        remote_step = asyncio.run(step_latency(ctx, pool.open_env, args.calls))
    finally:
        pool.close()
        ray.shutdown()
    n = args.trajectories
    print(f"one step: {iterations} iterations of pure Python, about {args.step_seconds * 1000:.0f} ms")
    print(f"{n} trajectories of {args.steps} steps, all in flight (median of {args.repeats}, alternating):")
    print(f"  in-process threads    {n / threads:6.2f} trajectories/s  ({threads:.2f} s)")
    print(f"  2 environment workers {n / workers:6.2f} trajectories/s  ({workers:.2f} s)")
    print(f"  ratio                 {threads / workers:6.2f}x (goal >= 1.5x)")
    print(f"step of an environment that does nothing, median of {args.calls - 10} calls:")
    print(f"  in-process            {local_step * 1000:6.3f} ms")
    print(f"  remote                {remote_step * 1000:6.3f} ms")
    print(f"  overhead              {(remote_step - local_step) * 1000:6.3f} ms (goal <= 2 ms)")


if __name__ == "__main__":
    main()
