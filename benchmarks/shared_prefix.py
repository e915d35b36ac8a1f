"""Prefix-tree packing (--shared-prefix-training) vs flat packing: forwarded tokens and train-step time.

    .venv/bin/python benchmarks/shared_prefix.py [--model smollm2] [--steps 1]

Workloads (random token ids; what is shared is what matters):
  (a) a GRPO group: 8 responses of 128 tokens to one 1,024-token prompt;
  (b) step-wise ``strip_thinking`` trajectories of T = 4, 8, 16 turns: step k's prompt is the system
      prompt (256 tokens) and the earlier answers (32) and observations (64), its response this turn's
      thinking (128, stripped from later contexts) and answer. Steps share their history but do not
      extend one another (the thinking is gone), so the prefix-aware merge cannot fold them.

For each: one Megatron train step (forward, backward, Adam) flat and as a prefix tree, with the same
``--max-tokens-per-micro-batch`` (the tree's rows are counted in tree tokens), the median of
``--steps`` timed steps after a warm-up step (``--steps 0``: the one step alone). Printed: tokens
forwarded, seconds, the token ratio flat/tree, the time ratio flat/tree, and the time ratio as a
fraction of the token ratio (the goal on CPU: >= 0.7). The response tokens' log-probs (the vocabulary
projection) are computed in both; only the shared context is saved.
"""

import argparse
import json
import os
import statistics
import time

import torch

from slime_mt.backends.megatron import scoring
from slime_mt.backends.megatron.actor import MegatronActor
from slime_mt.backends.megatron.parallel import init_parallel
from slime_mt.config import AlgoConfig, TrainConfig
from slime_mt.types import TrainingSample

SYSTEM, THINKING, ANSWER, OBSERVATION = 256, 128, 32, 64


def token_source(vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return lambda n: torch.randint(100, vocab - 100, (n,), generator=g).tolist()


def grpo_group(ids) -> list[TrainingSample]:
    prompt = ids(1024)
    return [
        TrainingSample(prompt, ids(128), [1] * 128, [-10.0] * 128, float(i % 2), f"0/{i}", 0, i == 7) for i in range(8)
    ]


def strip_thinking_steps(ids, turns: int) -> list[TrainingSample]:
    steps, history = [], ids(SYSTEM)
    for k in range(turns):
        thinking, answer = ids(THINKING), ids(ANSWER)
        response = thinking + answer
        steps.append(
            TrainingSample(
                list(history),
                response,
                [1] * len(response),
                [-10.0] * len(response),
                float(k == turns - 1),
                "0/0",
                0,
                k == turns - 1,
            )
        )
        history += answer + ids(OBSERVATION)
    return steps


def measure(path, samples, tree: bool, budget: int, steps: int, info) -> dict:
    actor = MegatronActor(
        str(path),
        TrainConfig(lr=1e-6, max_tokens_per_micro_batch=budget, shared_prefix_training=tree),
        AlgoConfig(),
        info,
    )
    everything = list(range(len(samples)))
    rows = scoring.micro_batches(actor.policy, samples, everything)
    forwarded = sum(scoring.pack(actor.policy, samples, r).num_real_tokens for r in rows)
    advantages = [1.0 if i % 2 else -1.0 for i in everything]
    times = []
    for _ in range(1 + steps if steps else 1):
        started = time.perf_counter()
        actor.train(actor.share_of(samples, advantages, 1))
        times.append(time.perf_counter() - started)
    del actor
    return {"forwarded": forwarded, "rows": len(rows), "seconds": statistics.median(times[1:]) if steps else times[0]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", choices=["smollm2", "tiny-llama"])
    parser.add_argument("--turns", default="4,8,16")
    parser.add_argument("--max-tokens-per-micro-batch", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("SLIME_MT_THREADS", "2")))
    info = init_parallel(1, seed=0)
    from slime_mt.assets import smollm2_dir, tiny_model_dir

    path = smollm2_dir() if args.model == "smollm2" else tiny_model_dir("llama")
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    ids = token_source(vocab, 0)
    workloads = {"(a) GRPO group, 8 x 128 on a 1,024-token prompt": grpo_group(ids)}
    for t in (int(t) for t in args.turns.split(",")):
        workloads[f"(b) strip_thinking step-wise, T = {t}"] = strip_thinking_steps(ids, t)
    print(
        f"{args.model} fp32, Megatron TP=1, fused attention, --max-tokens-per-micro-batch "
        f"{args.max_tokens_per_micro_batch}, {torch.get_num_threads()} threads",
        flush=True,
    )
    for name, samples in workloads.items():
        flat = measure(path, samples, False, args.max_tokens_per_micro_batch, args.steps, info)
        tree = measure(path, samples, True, args.max_tokens_per_micro_batch, args.steps, info)
        tokens, seconds = flat["forwarded"] / tree["forwarded"], flat["seconds"] / tree["seconds"]
        print(
            f"{name}: tokens {flat['forwarded']} -> {tree['forwarded']} ({tokens:.2f}x fewer), step "
            f"{flat['seconds']:.1f} s -> {tree['seconds']:.1f} s ({seconds:.2f}x faster); time ratio / token "
            f"ratio = {seconds / tokens:.2f} (goal >= 0.7); rows {flat['rows']} -> {tree['rows']}",
            flush=True,
        )


if __name__ == "__main__":
    main()
