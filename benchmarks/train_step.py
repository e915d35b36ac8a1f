"""Megatron train-step throughput vs plain transformers, peak memory per rank, and packing figures.

    .venv/bin/python benchmarks/train_step.py [--steps 3]                       # TP=1, vs transformers
    .venv/bin/python -m torch.distributed.run --nproc-per-node 3 benchmarks/train_step.py   # TP=3

Both sides run the same RL loss (PPO surrogate on the response tokens, token_mean) and an Adam step
on SmolLM2-135M-Instruct (fp32, or --bf16), on 8 sequences of a multi-turn length mix (packed into
rows of --row-tokens); tokens/s counts forward+backward tokens. Megatron runs with each
``--local-attention`` in turn: ``fused`` (PyTorch's fused kernels per packed sequence) and
``megatron`` (DotProductAttention: [L, L] scores per packed row). At TP=1 the transformers steps
alternate with Megatron's, one for one, so a shared machine's load falls on both sides alike; the
ratio is of the medians. Every rank prints its peak RSS after building the actor, after a weight
export and after one train step (peak RSS only grows in a process, so the second attention's figures
include the first's, and at TP=1 all of them include the transformers model).
(SmolLM2-135M has 9 heads and 3 key/value heads: TP must divide both, so TP=3 is its smallest TP > 1.)

Packing: a mix of 256 trajectories packed first-fit into rows of --pack-tokens (a GPU-sized budget):
padding efficiency (real tokens / row capacity) and the useful-attention fraction (score entries
inside a sequence / the dense L x L block-diagonal mask's entries; THD packing computes only those).
"""

import argparse
import functools
import os
import random
import resource
import statistics
import time

import torch
import torch.distributed as dist

from slime_mt.algo.batching import micro_batches_by_tokens
from slime_mt.assets import smollm2_dir
from slime_mt.backends.megatron.actor import MegatronActor
from slime_mt.backends.megatron.packing import padding_efficiency, useful_attention_fraction
from slime_mt.backends.megatron.parallel import init_parallel
from slime_mt.config import AlgoConfig, TrainConfig
from slime_mt.types import TrainingSample


def length_mix(n: int, seed: int = 0, max_turns: int = 6) -> list[tuple[int, int]]:
    """(prompt, response) lengths of multi-turn trajectories: a 60-200 token prompt, then 1..max_turns
    turns of 20-120 generated + 10-80 observation tokens."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = rng.randint(60, 200)
        response = sum(rng.randint(20, 120) + rng.randint(10, 80) for _ in range(rng.randint(1, max_turns)))
        out.append((prompt, response))
    return out


def batch(n: int) -> list[TrainingSample]:
    g = torch.Generator().manual_seed(0)
    samples = []
    for i, (p, r) in enumerate(length_mix(n, seed=1, max_turns=3)):
        ids = torch.randint(10, 49000, (p + r,), generator=g).tolist()
        samples.append(
            TrainingSample(ids[:p], ids[p:], [1] * r, [-2.0] * r, float(i % 2), f"{i // 2}/{i}", i // 2, True)
        )
    return samples


def hf_step(model, optimizer, samples, advantages):
    optimizer.zero_grad()
    total = sum(len(s.response_ids) for s in samples)
    for s, a in zip(samples, advantages):
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        logits = model(ids).logits[0, len(s.prompt_ids) - 1 : -1]
        lp = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0]
        ratio = torch.exp(lp - lp.detach())
        loss = torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2)).sum() / total
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--row-tokens", type=int, default=1024)
    parser.add_argument("--pack-tokens", type=int, default=4096)
    parser.add_argument("--bf16", action="store_true")
    args = parser.parse_args()
    tp = int(os.environ.get("WORLD_SIZE", "1"))
    info = init_parallel(tp, seed=0)
    if "LOCAL_RANK" not in os.environ:  # plain python: both cores (torchrun sets one thread per rank)
        torch.set_num_threads(2)
    path = smollm2_dir()
    samples = batch(args.sequences)
    advantages = [1.0 if i % 2 else -1.0 for i in range(len(samples))]
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    hf = None
    if tp == 1:  # its steps alternate with Megatron's, so the machine's load falls on both alike
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16 if args.bf16 else torch.float32)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.98), weight_decay=0.0)
        hf = lambda: hf_step(model, optimizer, samples, advantages)  # noqa: E731
    throughput, ratio = {}, {}
    for attention in ("megatron", "fused"):
        actor = MegatronActor(
            str(path),
            TrainConfig(lr=1e-6, max_tokens_per_micro_batch=args.row_tokens, bf16=args.bf16, local_attention=attention),
            AlgoConfig(),
            info,
        )
        built = peak_rss_mb()
        for _ in actor.iter_hf_weights():  # what the trainer streams to the engines
            pass
        exported = peak_rss_mb()
        share = actor.share_of(samples, advantages, len(samples))
        steps = {"megatron": functools.partial(actor.train, share)}
        if hf is not None:
            steps["transformers"] = hf
        seconds = {name: [] for name in steps}
        for step in range(args.steps + 1):  # the first is a warm-up
            for name, run in steps.items():
                start = time.perf_counter()
                run()
                if step:
                    seconds[name].append(time.perf_counter() - start)
            if not step:
                trained = peak_rss_mb()
        for rank in range(info.world_size):
            if rank == info.rank:
                print(
                    f"rank {rank} ({attention} attention): peak RSS after build {built:.0f} MB, after a weight "
                    f"export {exported:.0f} MB (+{exported - built:.0f}), after a train step {trained:.0f} MB",
                    flush=True,
                )
            dist.barrier()
        throughput[attention] = tokens / statistics.median(seconds["megatron"])
        line = (
            f"train step on SmolLM2-135M ({'bf16' if args.bf16 else 'fp32'}), {len(samples)} sequences / "
            f"{tokens} tokens: Megatron TP={tp}, {attention} attention: {throughput[attention]:.0f} tok/s"
        )
        if hf is not None:
            h = tokens / statistics.median(seconds["transformers"])
            ratio[attention] = throughput[attention] / h
            line += f"; transformers in alternate steps {h:.0f} tok/s; Megatron / transformers {ratio[attention]:.2f}x"
        if info.rank == 0:
            print(line, flush=True)
        del actor
    if info.rank == 0:
        print(f"fused / megatron attention: {throughput['fused'] / throughput['megatron']:.2f}x")
        if ratio:
            print(
                f"Megatron / transformers: {ratio['fused']:.2f}x with the fused attention (goal >= 1.0), "
                f"{ratio['megatron']:.2f}x with Megatron's"
            )
    if info.rank == 0:
        mix = length_mix(256)
        lengths = [p + r for p, r in mix]
        rows = micro_batches_by_tokens(lengths, args.pack_tokens)
        print(
            f"packed rows of {args.pack_tokens} tokens for 256 multi-turn trajectories: {len(rows)} rows, "
            f"padding efficiency {padding_efficiency(lengths, rows, args.pack_tokens):.3f} (goal >= 0.95), "
            f"useful-attention fraction {useful_attention_fraction(lengths, rows):.3f} "
            "(score entries inside a sequence / entries of the dense block-diagonal mask)"
        )


if __name__ == "__main__":
    main()
