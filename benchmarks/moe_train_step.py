"""A mixture-of-experts train step against the dense model of equal active parameters, and what rollout
routing replay's routes cost in memory.

    .venv/bin/python benchmarks/moe_train_step.py [--steps 5]

Both models are Qwen3-shaped (hidden 512, 4 layers, 8 heads, head size 64, an 8k vocabulary, fp32,
random weights): the MoE one has 16 experts of intermediate size 256 with 2 per token in every layer (a
token passes 2 x 256 = 512 intermediate units), the dense one an MLP of intermediate size 512: the same
active parameters per token, the MoE one 8x the MLP parameters. Each step is one Megatron forward/backward of
the RL loss and an Adam step on the same 8 sequences (TP=1, EP=1, sequential experts on CPU); their
steps alternate one for one so a shared machine's load falls on both alike. tokens/s counts the
step's tokens; the ratio is of the medians.

Routes (R3): the bytes a sample spends per token and MoE layer (uint8 for up to 254 experts) against
SGLang's int32 wire form, and the routes of a 32k-token trajectory of Qwen3-30B-A3B (48 MoE layers,
8 of 128 experts per token) in each form.
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from slime_mt.assets import qwen_tokenizer_dir
from slime_mt.backends.megatron.actor import MegatronActor
from slime_mt.backends.megatron.parallel import init_parallel
from slime_mt.config import AlgoConfig, TrainConfig
from slime_mt.routes import RouteLayout
from slime_mt.types import TrainingSample

SHAPE = dict(
    vocab_size=8192,  # small, so that the step is the decoder's and not the vocabulary projection's
    hidden_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=4096,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
)


def build(folder: Path, moe: bool) -> Path:
    import transformers

    torch.manual_seed(0)
    if moe:
        config = transformers.Qwen3MoeConfig(
            **SHAPE, intermediate_size=512, moe_intermediate_size=256, num_experts=16, num_experts_per_tok=2
        )
    else:
        config = transformers.Qwen3Config(**SHAPE, intermediate_size=512)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir("qwen3")))
    tokenizer.save_pretrained(folder)
    return folder


def batch() -> list[TrainingSample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(8):
        ids = torch.randint(100, 8000, (160 + 40 * i,), generator=g).tolist()
        r = 60 + 10 * i
        out.append(TrainingSample(ids[:-r], ids[-r:], [1] * r, [-2.0] * r, float(i % 2), f"{i // 2}/{i}", i // 2, True))
    return out


def step_seconds(actor, samples) -> float:
    share = actor.share_of(samples, [1.0, -1.0] * 4, 4)
    started = time.perf_counter()
    actor.train(share, on_policy=True)
    return time.perf_counter() - started


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    info = init_parallel(1, seed=1234)
    samples = batch()
    tokens = sum(len(s.tokens) for s in samples)
    with tempfile.TemporaryDirectory() as tmp:
        actors = {
            kind: MegatronActor(
                str(build(Path(tmp) / kind, kind == "moe")),
                TrainConfig(lr=1e-5, max_tokens_per_micro_batch=1024),
                AlgoConfig(),
                info,
            )
            for kind in ("dense", "moe")
        }
        params = {k: sum(p.numel() for p in a.policy.parameters()) for k, a in actors.items()}
        for actor in actors.values():
            step_seconds(actor, samples)  # warm-up
        seconds = {k: [] for k in actors}
        for _ in range(args.steps):
            for kind, actor in actors.items():
                seconds[kind].append(step_seconds(actor, samples))
    medians = {k: statistics.median(v) for k, v in seconds.items()}
    print(f"train step, {tokens} tokens, {args.steps} steps each, alternating (TP=1, fp32, CPU):")
    for kind in ("dense", "moe"):
        rate = tokens / medians[kind]
        print(f"  {kind:5s}  {params[kind] / 1e6:6.1f} M params  {medians[kind]:.3f} s  {rate:8.0f} tokens/s")
    print(f"  MoE / dense tokens/s: {medians['dense'] / medians['moe']:.2f}")

    a3b = RouteLayout(num_layers=48, moe_layers=tuple(range(48)), top_k=8, num_experts=128)
    wire = 4 * a3b.top_k  # int32 per token per layer
    sample = a3b.bytes_per_token_layer()
    per_1k = 1000 * len(a3b.moe_layers)
    print("routes (R3), Qwen3-30B-A3B (48 MoE layers, top 8 of 128):")
    print(f"  bytes per token per layer: sample {sample:.0f} ({a3b.dtype}), SGLang wire int32 {wire}")
    print(f"  per 1k tokens: sample {per_1k * sample / 1e3:.0f} KB, int32 {per_1k * wire / 1e3:.0f} KB")
    print(f"  32k-token trajectory: sample {32000 * 48 * sample / 1e6:.1f} MB, int32 {32000 * 48 * wire / 1e6:.1f} MB")
    measured = a3b.decode(a3b.encode(torch.randint(0, 128, (1000, 48, 8), dtype=torch.int32)))
    print(f"  measured: 1k decoded rows hold {measured.numel() * measured.element_size() / 1e3:.0f} KB")
    print(json.dumps({"moe_over_dense_tokens_per_s": medians["dense"] / medians["moe"]}))


if __name__ == "__main__":
    main()
