"""Framework overhead of the multi-turn loop (engine and env time excluded) as history grows, and the
cost of one multimodal concatenation at finalize vs concatenating every turn.

    .venv/bin/python benchmarks/rollout_overhead.py [--episodes 5]

Per-turn overhead of turn k = time from the end of engine call k to the start of engine call k+1,
minus the env step: observation encoding, buffer and sample bookkeeping, request assembly.
"""

import argparse
import asyncio
import statistics
import time

import torch

from envs.base import BaseInteractionEnv
from slime_mt.assets import tiny_model_dir
from slime_mt.config import DataConfig, RolloutConfig
from slime_mt.engine.clients.sglang import EngineClient
from slime_mt.engine.embedded.server import LocalEngine
from slime_mt.multimodal import MultimodalBuffer
from slime_mt.processing import load_tokenizer_or_processor
from slime_mt.rollout.context import RolloutContext
from slime_mt.rollout.multi_turn import run_episode
from slime_mt.types import Sample

TURNS = 33
STOPS = list(range(3, 151643, 3)) + [151645]


class TimedClient(EngineClient):
    def __init__(self, url):
        super().__init__(url)
        self.spans = []

    async def generate(self, *args, **kw):
        start = time.perf_counter()
        out = await super().generate(*args, **kw)
        self.spans.append((start, time.perf_counter()))
        return out


class Echo(BaseInteractionEnv):
    def step(self, response_text):
        return {"text": "The tool returned 42. Continue."}, False, {}


def per_turn_overhead(url, path, episodes):
    import argparse as ap

    samples = {k: [] for k in (1, 8, 32)}
    for e in range(episodes):
        client = TimedClient(url)
        ctx = RolloutContext(
            client,
            load_tokenizer_or_processor(path),
            RolloutConfig(max_turns=TURNS, rollout_max_response_len=32, rollout_max_context_len=8192),
            DataConfig(apply_chat_template=True),
            ap.Namespace(),
        )
        sample = Sample(index=e, prompt=[{"role": "user", "content": "Use the tool repeatedly."}])
        params = {"temperature": 1.0, "sampling_seed": e, "stop_token_ids": STOPS, "no_stop_trim": True}
        asyncio.run(run_episode(ctx, sample, params, env=Echo()))
        spans = client.spans
        for k in samples:
            if k < len(spans):
                gap = spans[k][0] - spans[k - 1][1] - sample.turns[k - 1].env_seconds
                samples[k].append(gap)
        ctx.env_executor.shutdown()
    missing = [k for k, v in samples.items() if len(v) < episodes]
    if missing:
        raise RuntimeError(f"episodes ended before turns {missing}; raise rollout_max_response_len")
    return {k: statistics.median(v) * 1e3 for k, v in samples.items()}


def finalize_cost(turns=20, repeats=20):
    per_turn = [
        {"pixel_values": torch.randn(256, 1176), "image_grid_thw": torch.tensor([[1, 16, 16]])} for _ in range(turns)
    ]

    def once():
        buffer = MultimodalBuffer()
        for t in per_turn:
            buffer.append(t)
        return buffer.finalize()

    def every_turn():
        acc = {}
        for t in per_turn:
            acc = {k: torch.cat([acc[k], v]) if k in acc else v for k, v in t.items()}
        return acc

    timings = {}
    for name, fn in (("once", once), ("every_turn", every_turn)):
        runs = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - start)
        timings[name] = statistics.median(runs) * 1e3
    return timings


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(2)
    path = tiny_model_dir("qwen2")
    with LocalEngine(path) as engine:
        overhead = per_turn_overhead(engine.url, path, args.episodes)
    print(
        "framework overhead per turn (median ms, engine/env excluded): "
        + ", ".join(f"turn {k}: {v:.2f}" for k, v in overhead.items())
    )
    print(f"turn 32 / turn 1 overhead ratio: {overhead[32] / overhead[1]:.2f}x (goal <= 1.5x)")
    cost = finalize_cost()
    print(
        f"multimodal finalize at 20 turns (256x1176 pixel rows/turn): one concatenation {cost['once']:.2f} ms, "
        f"concatenating every turn {cost['every_turn']:.2f} ms, ratio {cost['every_turn'] / cost['once']:.1f}x"
    )


if __name__ == "__main__":
    main()
