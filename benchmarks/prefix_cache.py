"""Multi-turn rollout time with the embedded engine's prefix cache on vs off.

    .venv/bin/python benchmarks/prefix_cache.py [--episodes 4] [--turns 8] [--max-new-tokens 24]

SmolLM2-135M-Instruct (real weights), greedy: ``--episodes`` trajectories run concurrently, each
``--turns`` turns; a turn's prompt is the previous prompt, the model's output and an observation (a
user message), as a token-in/token-out multi-turn rollout sends it. The same episodes run against
one engine with ``--engine-cache-tokens`` and one without; printed: wall time, prompt tokens sent,
prompt tokens served from the cache (``meta_info.cached_tokens``), the speed-up, and whether both
engines generated exactly the same tokens.
"""

import argparse
import asyncio
import time

import torch

from slime_mt.assets import smollm2_dir
from slime_mt.engine.clients.sglang import EngineClient
from slime_mt.engine.embedded.server import LocalEngine
from slime_mt.processing import load_tokenizer_or_processor

TASKS = [
    "Play the grid game: reach the goal.",
    "Sort the cards you are shown.",
    "Find the hidden word.",
    "Guide the robot out of the maze.",
    "Balance the scales.",
    "Count the red squares.",
]


async def episode(client: EngineClient, tokenizer, index: int, turns: int, max_new_tokens: int):
    """-> (outputs per turn, prompt tokens sent, prompt tokens cached)."""
    prompt = tokenizer(
        f"<|im_start|>user\n{TASKS[index % len(TASKS)]}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )["input_ids"]
    outputs, sent, cached = [], 0, 0
    for turn in range(turns):
        answer = await client.generate(prompt, {"temperature": 0.0, "max_new_tokens": max_new_tokens})
        outputs.append(answer["output_ids"])
        sent += len(prompt)
        cached += answer["meta_info"]["cached_tokens"]
        observation = f"\n<|im_start|>user\nStep {turn}: nothing changed. Try again.<|im_end|>\n<|im_start|>assistant\n"
        prompt = prompt + answer["output_ids"] + tokenizer(observation, add_special_tokens=False)["input_ids"]
    return outputs, sent, cached


async def rollout(url: str, tokenizer, args) -> tuple[float, list, int, int]:
    async with EngineClient(url) as client:
        start = time.perf_counter()
        results = await asyncio.gather(
            *(episode(client, tokenizer, i, args.turns, args.max_new_tokens) for i in range(args.episodes))
        )
        seconds = time.perf_counter() - start
    return seconds, [r[0] for r in results], sum(r[1] for r in results), sum(r[2] for r in results)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=4)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--cache-tokens", type=int, default=16384)
    args = parser.parse_args()
    torch.set_num_threads(2)
    path = smollm2_dir()
    tokenizer = load_tokenizer_or_processor(path)
    figures = {}
    for name, cache_tokens in (("off", 0), ("on", args.cache_tokens), ("off again", 0)):
        with LocalEngine(path, max_batch_size=args.episodes, cache_tokens=cache_tokens) as engine:
            asyncio.run(
                rollout(engine.url, tokenizer, argparse.Namespace(**{**vars(args), "episodes": 1, "turns": 1}))
            )  # warm-up
            figures[name] = asyncio.run(rollout(engine.url, tokenizer, args))
        seconds, _, sent, cached = figures[name]
        print(
            f"cache {name:9s}: {seconds:6.1f} s for {args.episodes} episodes x {args.turns} turns; "
            f"{sent} prompt tokens sent, {cached} served from the cache",
            flush=True,
        )
    off = (figures["off"][0] + figures["off again"][0]) / 2  # before and after: the machine's drift cancels
    print(
        f"multi-turn rollout time, cache off / on: {off / figures['on'][0]:.2f}x; prefilled tokens "
        f"{figures['on'][2]} -> {figures['on'][2] - figures['on'][3]}; identical outputs: "
        f"{figures['on'][1] == figures['off'][1] == figures['off again'][1]}"
    )


if __name__ == "__main__":
    main()
