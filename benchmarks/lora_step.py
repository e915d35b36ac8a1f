"""LoRA against full training on SmolLM2-135M-Instruct, side by side in one run: the bytes of one weight
update, the trainer's optimizer state and parameters it trains, and the train step's time.

    .venv/bin/python benchmarks/lora_step.py [--steps 3] [--rank 16] [--bf16]

Both actors train the same batch (benchmarks/train_step.py's multi-turn length mix, 8 sequences) with the
same RL loss and Adam, at TP=1, fp32 by default; the LoRA one has adapters of ``--rank`` (alpha = 2 x rank)
on every projection (``--target-modules all-linear``). Their steps alternate one for one after a warm-up,
so the machine's load falls on both alike; the step time is the median. The update is what the engines
receive: full training's is every HF weight (``iter_hf_weights``), LoRA's the adapter alone
(``iter_adapter_weights``, the engines serving it on their base); bytes as the trainer sends them. The
optimizer state is every tensor Adam holds (moments, and fp32 main copies under --bf16).
"""

import argparse
import statistics
import time

import torch
from train_step import batch

from slime_mt.assets import smollm2_dir
from slime_mt.backends.megatron.actor import MegatronActor
from slime_mt.backends.megatron.parallel import init_parallel
from slime_mt.config import AlgoConfig, TrainConfig


def update_bytes(stream) -> int:
    return sum(t.numel() * t.element_size() for _, t in stream if t is not None)


def optimizer_bytes(actor) -> int:
    """Bytes of every tensor the policy's optimizer holds (its state and fp32 main copies)."""
    total, seen = 0, set()
    optimizers = getattr(actor.policy.optimizer, "chained_optimizers", [actor.policy.optimizer])
    for inner in optimizers:
        for state in inner.optimizer.state.values():
            for t in state.values():
                if torch.is_tensor(t) and t.dim() > 0 and id(t) not in seen:
                    seen.add(id(t))
                    total += t.numel() * t.element_size()
        if getattr(inner, "config", None) is not None and inner.config.bf16:
            for group in inner.optimizer.param_groups:
                total += sum(p.numel() * p.element_size() for p in group["params"])  # the fp32 main copies
    return total


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--bf16", action="store_true")
    args = parser.parse_args()
    info = init_parallel(1, seed=0)
    torch.set_num_threads(2)
    path = str(smollm2_dir())
    samples = batch(8)
    advantages = [1.0 if i % 2 else -1.0 for i in range(len(samples))]
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    base = dict(lr=1e-5, max_tokens_per_micro_batch=1024, bf16=args.bf16)
    lora = dict(lora_rank=args.rank, lora_alpha=2.0 * args.rank, target_modules="all-linear")
    actors = {
        "full": MegatronActor(path, TrainConfig(**base), AlgoConfig(), info),
        "lora": MegatronActor(path, TrainConfig(**base, **lora), AlgoConfig(), info),
    }
    sent = {
        "full": update_bytes(actors["full"].iter_hf_weights()),
        "lora": update_bytes(actors["lora"].iter_adapter_weights()),
    }
    trained = {k: sum(p.numel() for p in a.policy.module.parameters() if p.requires_grad) for k, a in actors.items()}
    seconds = {k: [] for k in actors}
    for step in range(args.steps + 1):  # the first is a warm-up (and makes Adam's state)
        for name, actor in actors.items():
            share = actor.share_of(samples, advantages, len(samples))
            start = time.perf_counter()
            actor.train(share)
            if step:
                seconds[name].append(time.perf_counter() - start)
    held = {k: optimizer_bytes(a) for k, a in actors.items()}
    time_of = {k: statistics.median(v) for k, v in seconds.items()}
    dtype = "bf16" if args.bf16 else "fp32"
    print(f"SmolLM2-135M ({dtype}), {len(samples)} sequences / {tokens} tokens, LoRA rank {args.rank} on all-linear:")
    for name in actors:
        print(
            f"  {name:>4}: trains {trained[name]:,} parameters; one weight update {sent[name] / 2**20:.2f} MiB; "
            f"optimizer state {held[name] / 2**20:.1f} MiB; train step {time_of[name]:.2f} s (median of {args.steps})"
        )
    print(
        f"LoRA / full: weight update {sent['lora'] / sent['full']:.2%}, optimizer state "
        f"{held['lora'] / held['full']:.2%}, trained parameters {trained['lora'] / trained['full']:.2%}, "
        f"step time {time_of['lora'] / time_of['full']:.2f}x"
    )


if __name__ == "__main__":
    main()
