"""Peak memory and speed of one train step at 4k / 8k / 16k tokens per micro-batch, per attention path.

    .venv/bin/python benchmarks/micro_batch_memory.py                  # CPU: SmolLM2-135M, fp32, peak RSS
    python benchmarks/micro_batch_memory.py --model qwen3-0.6b --bf16 --steps 3   # GPU: peak CUDA memory

The batch at T tokens per micro-batch: T / 1,024 sequences of 1,024 tokens, in GRPO groups of up to
8 responses of 512 tokens to one 512-token prompt; ``--max-tokens-per-micro-batch T`` puts them in one
micro-batch, and one optimizer step follows. Variants:

  megatron      Megatron, its DotProductAttention (``[L, L]`` scores and mask for the packed row)
  fused         Megatron, FusedCoreAttention (one fused kernel per packed sequence; no ``[L, L]``)
  tree          fused, with --shared-prefix-training (each group's prompt forwarded once)
  transformers  the transformers model on the same sequences as a ``[T / 1024, 1024]`` batch (SDPA)

Each (variant, T) runs in a fresh process. On CPU its peak RSS is read from ``ru_maxrss`` and its
address space is capped at ``--cap-gb`` (a step that needs more is reported as over the cap); on CUDA
the peak is ``torch.cuda.max_memory_allocated``. Time: the median of ``--steps`` steps after one
warm-up step, or with ``--steps 0`` the one step alone (CPU default: one step takes minutes at 16k).
Models: ``smollm2`` (real SmolLM2-135M-Instruct weights), ``qwen3-0.6b`` / ``qwen2.5-1.5b``
(random weights, the published configurations), ``tiny-llama``.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

VARIANTS = ("megatron", "fused", "tree", "transformers")
SEQUENCE, PROMPT, GROUP = 1024, 512, 8


def model_path(name: str):
    from slime_mt.assets import sized_model_dir, smollm2_dir, tiny_model_dir

    if name == "smollm2":
        return smollm2_dir()
    if name == "tiny-llama":
        return tiny_model_dir("llama")
    return sized_model_dir(name)


def grpo_batch(tokens: int, vocab: int):
    from slime_mt.types import TrainingSample

    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(100, vocab - 100, (n,), generator=g).tolist()  # noqa: E731
    samples, n = [], tokens // SEQUENCE
    for group in range(-(-n // GROUP)):
        prompt = ids(PROMPT)
        for i in range(min(GROUP, n - group * GROUP)):
            r = SEQUENCE - PROMPT
            samples.append(
                TrainingSample(prompt, ids(r), [1] * r, [-10.0] * r, float(i % 2), f"{group}/{i}", group, True)
            )
    return samples


def hf_step(model, optimizer, samples, advantages, device):
    """The same RL surrogate (PPO clip, token mean) on a [n, 1024] batch, one Adam step."""
    optimizer.zero_grad()
    ids = torch.tensor([s.prompt_ids + s.response_ids for s in samples], device=device)
    logits = model(ids).logits[:, PROMPT - 1 : -1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, ids[:, PROMPT:, None])[..., 0]
    adv = torch.tensor(advantages, device=device, dtype=torch.float32)[:, None]
    ratio = torch.exp(lp - lp.detach())
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)).mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def child(args) -> dict:
    """One (variant, tokens) measurement in this process."""
    from slime_mt.backends.megatron.parallel import current_device, init_parallel

    cuda = torch.cuda.is_available()
    if not cuda:
        cap = int(args.cap_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
        torch.set_num_threads(int(os.environ.get("SLIME_MT_THREADS", "2")))
    info = init_parallel(1, seed=0)
    device = current_device()
    path = model_path(args.model)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    samples = grpo_batch(args.tokens, vocab)
    advantages = [1.0 if i % 2 else -1.0 for i in range(len(samples))]
    if args.variant == "transformers":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=torch.bfloat16 if args.bf16 else torch.float32, attn_implementation="sdpa"
        ).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.98), weight_decay=0.0)
        step = lambda: hf_step(model, optimizer, samples, advantages, device)  # noqa: E731
        forwarded = args.tokens
    else:
        from slime_mt.backends.megatron import scoring
        from slime_mt.backends.megatron.actor import MegatronActor
        from slime_mt.config import AlgoConfig, TrainConfig

        train = TrainConfig(
            lr=1e-6,
            bf16=args.bf16,
            max_tokens_per_micro_batch=args.tokens,
            local_attention="megatron" if args.variant == "megatron" else "fused",
            shared_prefix_training=args.variant == "tree",
        )
        actor = MegatronActor(str(path), train, AlgoConfig(), info)
        everything = list(range(len(samples)))
        rows = scoring.micro_batches(actor.policy, samples, everything)
        if len(rows) != 1:
            raise RuntimeError(f"{args.tokens} tokens packed into {len(rows)} micro-batches, expected one")
        forwarded = scoring.pack(actor.policy, samples, rows[0]).num_real_tokens
        groups = len({s.group_id for s in samples})
        step = lambda: actor.train(actor.share_of(samples, advantages, groups))  # noqa: E731
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(1 + args.steps):
        started = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    seconds = statistics.median(times[1:]) if args.steps else times[0]
    peak = (
        torch.cuda.max_memory_allocated() / 2**30
        if cuda
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    )
    return {"seconds": seconds, "tokens_per_s": args.tokens / seconds, "forwarded": forwarded, "peak_gib": peak}


def run_child(args, variant: str, tokens: int) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        "--variant",
        variant,
        "--tokens",
        str(tokens),
        "--model",
        args.model,
        "--steps",
        str(args.steps),
        "--cap-gb",
        str(args.cap_gb),
    ] + (["--bf16"] if args.bf16 else [])
    proc = subprocess.run(cmd, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    tail = (proc.stderr or proc.stdout).strip().splitlines()
    out_of_memory = any(
        s in proc.stderr for s in ("OutOfMemoryError", "MemoryError", "DefaultCPUAllocator", "std::bad_alloc")
    ) or proc.returncode in (-9, 137)
    if out_of_memory:
        where = "GPU" if torch.cuda.is_available() else f"the {args.cap_gb:g} GB address-space cap"
        return {"failed": f"out of memory (over {where})"}
    return {"failed": tail[-1] if tail else f"exit {proc.returncode}"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", choices=["smollm2", "tiny-llama", "qwen3-0.6b", "qwen2.5-1.5b"])
    parser.add_argument("--tokens", default="4096,8192,16384", help="tokens per micro-batch, comma-separated")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument(
        "--steps", type=int, default=None, help="timed steps after a warm-up (default: 0 on CPU, 3 on CUDA)"
    )
    parser.add_argument("--cap-gb", type=float, default=16.0, help="CPU: address-space cap per measurement")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps is None:
        args.steps = 3 if torch.cuda.is_available() else 0
    if args.child:
        args.tokens = int(args.tokens)
        print("RESULT " + json.dumps(child(args)), flush=True)
        return
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {VARIANTS}")
    model_path(args.model)  # build the asset once, before the measurements
    where = (
        f"CUDA ({torch.cuda.get_device_name()}), peak allocated"
        if torch.cuda.is_available()
        else f"CPU, peak RSS (address space capped at {args.cap_gb:g} GB)"
    )
    print(
        f"{args.model}, {'bf16' if args.bf16 else 'fp32'}, {where}; one micro-batch per step, "
        f"{'one step timed' if args.steps == 0 else f'median of {args.steps} steps'}",
        flush=True,
    )
    results = {}
    for tokens in (int(t) for t in args.tokens.split(",")):
        for variant in variants:
            r = results[variant, tokens] = run_child(args, variant, tokens)
            if "failed" in r:
                print(f"  {tokens:>6} tokens  {variant:<12}  {r['failed']}", flush=True)
            else:
                print(
                    f"  {tokens:>6} tokens  {variant:<12}  peak {r['peak_gib']:6.2f} GiB"
                    f"  {r['tokens_per_s']:8.0f} tok/s"
                    f"  ({r['seconds']:.2f} s/step, {r['forwarded']} tokens forwarded)",
                    flush=True,
                )
        base = results.get(("transformers", tokens), {})
        for variant in ("megatron", "fused", "tree"):
            r = results.get((variant, tokens), {})
            if "tokens_per_s" in r and "tokens_per_s" in base:
                print(
                    f"  {tokens:>6} tokens  {variant} / transformers: {r['tokens_per_s'] / base['tokens_per_s']:.2f}x "
                    f"tok/s, {r['peak_gib'] / base['peak_gib']:.2f}x peak memory",
                    flush=True,
                )


if __name__ == "__main__":
    main()
