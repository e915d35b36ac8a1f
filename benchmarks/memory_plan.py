"""Peak memory per train rank against the memory plan (``--dry-run``'s), at CP=1/2, recompute off/on,
4k / 8k / 16k tokens per micro-batch (and TP, sequence parallelism, DP and the distributed optimizer).

    .venv/bin/python benchmarks/memory_plan.py                         # CPU: peak RSS, a small Llama
    .venv/bin/python benchmarks/memory_plan.py --tokens 4096 --cp 1    # one point
    .venv/bin/python benchmarks/memory_plan.py --tokens 4096 --cp 1 --recompute full --dp 2 \
        --optimizer replicated,distributed                             # the distributed optimizer
    .venv/bin/python benchmarks/memory_plan.py --tokens 8192 --cp 1 --recompute off --tp 2 \
        --sp off,on                                                    # sequence parallelism
    .venv/bin/python benchmarks/memory_plan.py --tokens 4096 --cp 2 --recompute full \
        --response 512,16                                              # long prompts, few scored tokens

The model: a Llama of 8 layers, hidden 256, 4 query and 2 key-value heads of 64, MLP 768, a tied
32,768-token vocabulary (random weights, built in code), fp32. The batch: sequences of 1,024 tokens
(``--response`` of them scored, 512 by default, the rest the prompt) packed into one micro-batch of T
tokens on each DP rank; the plan is given the scored tokens, as it counts the log-probs' rows. Each point runs in
fresh processes (TP x CP x DP > 1 under ``torch.distributed.run``): two train steps (the first makes Adam's
state, the second is the steady state; ``--use-distributed-optimizer`` shards that state over the DP
ranks), each rank reading its RSS after the actor's imports and process group (the baseline: Python,
torch and Megatron's code) and its peak RSS (``ru_maxrss``) at the end. Measured = peak - baseline, the
most of any rank; on CUDA the peak is ``torch.cuda.max_memory_allocated``. The plan comes from
``slime_mt.backends.megatron.memory_plan.plan_rank`` on the same flags; the goal is within 15%.
"""

import argparse
import itertools
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

SEQUENCE = 1024
RECOMPUTE = {"off": {}, "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)}
# the model's HF config (LlamaConfig); the unit tests plan it from these keys alone
LLAMA = dict(
    hidden_size=256,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=768,
    vocab_size=32768,
    max_position_embeddings=32768,
    tie_word_embeddings=True,
)


def model_dir() -> Path:
    from slime_mt.assets import random_model_dir

    return random_model_dir("bench-llama-8x256", "LlamaConfig", **LLAMA)


def train_config(cp: int, recompute: str, tokens: int, distributed: bool = False, tp: int = 1, sp: bool = False):
    from slime_mt.config import TrainConfig

    return TrainConfig(
        lr=1e-6,
        max_tokens_per_micro_batch=tokens,
        tensor_model_parallel_size=tp,
        sequence_parallel=sp,
        context_parallel_size=cp,
        use_distributed_optimizer=distributed,
        **RECOMPUTE[recompute],
    )


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(args) -> None:
    """One (tp, sp, cp, recompute, tokens, dp, optimizer) point on this rank -> a JSON line in ``args.out``."""
    import torch

    from slime_mt.backends.megatron.actor import MegatronActor
    from slime_mt.backends.megatron.parallel import init_parallel
    from slime_mt.config import AlgoConfig
    from slime_mt.types import TrainingSample

    info = init_parallel(args.tp, seed=0, cp_size=args.cp)
    cuda = torch.cuda.is_available()
    baseline = rss_bytes()
    train = train_config(
        args.cp, args.recompute, args.tokens, args.optimizer == "distributed", args.tp, args.sp == "on"
    )
    actor = MegatronActor(str(model_dir()), train, AlgoConfig(), info)
    g = torch.Generator().manual_seed(0)
    vocab = actor.spec.vocab_size
    samples = []
    r = args.response
    for i in range(args.tokens * info.dp_size // SEQUENCE):  # a micro-batch of ``tokens`` on each DP rank
        ids = torch.randint(100, vocab - 100, (SEQUENCE,), generator=g).tolist()
        samples.append(TrainingSample(ids[:-r], ids[-r:], [1] * r, [-10.0] * r, float(i % 2), f"{i}/0", i, True))
    advantages = [1.0 if i % 2 else -1.0 for i in range(len(samples))]
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for _ in range(2):
        actor.train(actor.share_of(samples, advantages, len(samples)))
    peak = (
        torch.cuda.max_memory_allocated()
        if cuda
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline
    )
    with open(f"{args.out}.{info.rank}", "w") as fh:
        json.dump({"rank": info.rank, "peak": peak, "baseline": 0 if cuda else baseline}, fh)


def measure(
    cp: int,
    recompute: str,
    tokens: int,
    dp: int = 1,
    optimizer: str = "replicated",
    tp: int = 1,
    sp: bool = False,
    response: int = 512,
) -> dict:
    ranks = tp * cp * dp
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/result"
        launch = [sys.executable]
        if ranks > 1:
            launch += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
        cmd = [*launch, __file__, "--child", "--cp", str(cp), "--recompute", recompute, "--tokens", str(tokens)]
        cmd += ["--optimizer", optimizer, "--tp", str(tp), "--sp", "on" if sp else "off", "--response", str(response)]
        # glibc's malloc keeps freed heap memory (its mmap threshold grows to 32 MiB as big blocks are
        # freed); fixed at 64 KiB, every tensor past it is a mapping of its own and RSS follows the live
        # tensors, as the CUDA peak does
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
        proc = subprocess.run([*cmd, "--out", out], capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            tail = proc.stderr.strip().splitlines()
            return {"failed": tail[-1] if tail else f"exit {proc.returncode}"}
        results = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(ranks)]
    return max(results, key=lambda r: r["peak"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="4096,8192,16384", help="tokens per micro-batch, comma-separated")
    parser.add_argument("--cp", default="1,2", help="context-parallel sizes, comma-separated")
    parser.add_argument("--recompute", default="off,full", help="off, full (uniform, one layer per chunk)")
    parser.add_argument("--dp", default="1", help="data-parallel sizes, comma-separated")
    parser.add_argument("--optimizer", default="replicated", help="replicated, distributed (comma-separated)")
    parser.add_argument("--tp", default="1", help="tensor-parallel sizes, comma-separated")
    parser.add_argument("--sp", default="off", help="sequence parallelism under TP > 1: off, on (comma-separated)")
    parser.add_argument("--response", default="512", help="scored tokens per 1,024-token sequence (comma-separated)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.cp, args.tokens, args.tp, args.response = int(args.cp), int(args.tokens), int(args.tp), int(args.response)
        child(args)
        return
    from slime_mt.backends.megatron.families import decoder_spec, read_hf_config
    from slime_mt.backends.megatron.memory_plan import GIB, plan_rank

    spec = decoder_spec(read_hf_config(model_dir()))
    print("Llama 8 x 256, vocabulary 32,768, fp32; measured: peak RSS - the RSS before the model, most of any rank")
    print(
        "| tokens | scored | TP | SP | CP | recompute | DP | optimizer | measured per rank | plan | plan / measured |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    worst = 0.0
    points = itertools.product(
        [int(t) for t in args.tokens.split(",")],
        [int(t) for t in args.tp.split(",")],
        args.sp.split(","),
        [int(c) for c in args.cp.split(",")],
        args.recompute.split(","),
        [int(d) for d in args.dp.split(",")],
        args.optimizer.split(","),
        [int(r) for r in args.response.split(",")],
    )
    for tokens, tp, sp, cp, recompute, dp, optimizer, response in points:
        if sp == "on" and tp == 1:
            continue  # off at TP=1, as Megatron's
        train = train_config(cp, recompute, tokens, optimizer == "distributed", tp, sp == "on")
        scored = tokens // SEQUENCE * response
        plan = plan_rank(spec, train, tokens, data_parallel=dp, scored=scored).total
        got = measure(cp, recompute, tokens, dp, optimizer, tp, sp == "on", response)
        where = f"| {tokens:,} | {scored:,} | {tp} | {sp} | {cp} | {recompute} | {dp} | {optimizer} |"
        if "failed" in got:
            print(f"{where} {got['failed']} | {plan / GIB:.2f} GiB | |", flush=True)
            continue
        ratio = plan / got["peak"]
        worst = max(worst, abs(ratio - 1))
        print(f"{where} {got['peak'] / GIB:.2f} GiB | {plan / GIB:.2f} GiB | {ratio:.2f} |", flush=True)
    print(f"largest gap: {worst:.1%} (goal: within 15%)")


if __name__ == "__main__":
    main()
