"""The embedded engine's decode with a LoRA adapter against its base, on SmolLM2-135M-Instruct, in one run.

    .venv/bin/python benchmarks/engine_lora.py [--repeats 3] [--rank 16]

One engine serves an adapter of ``--rank`` on every projection (peft's, B drawn at random) beside its base;
a batch of 16 prompts of 8 tokens decodes 32 tokens each, with the adapter on every row, on none, and on
half of them (two groups in one batch: the gather and scatter path), the three alternating, medians of
``--repeats``. The adapter is applied by forward hooks (``engine/embedded/lora.py``): ``(alpha / r) B A x``
beside each projection of the rows that use it.
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch

from slime_mt.assets import smollm2_dir
from slime_mt.engine.embedded.lora import LoraServing
from slime_mt.engine.embedded.server import LocalEngine


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    path = smollm2_dir()
    folder = Path(tempfile.mkdtemp()) / "adapter"
    config = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules="all-linear", init_lora_weights=False)
    get_peft_model(AutoModelForCausalLM.from_pretrained(path), config).save_pretrained(folder)
    engine = LocalEngine(path, max_batch_size=16, lora=LoraServing({"a": str(folder)})).start()
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8 + i] for i in range(16)]
    cases = {"base": [None] * 16, "adapter": ["a"] * 16, "half": ["a", None] * 8}
    seconds = {name: [] for name in cases}
    try:
        for _ in range(args.repeats):
            for name, loras in cases.items():
                body = {
                    "input_ids": prompts,
                    "sampling_params": {"max_new_tokens": 32, "ignore_eos": True, "temperature": 1.0},
                    "lora_path": loras,
                }
                start = time.perf_counter()
                response = httpx.post(engine.url + "/generate", json=body, timeout=600)
                seconds[name].append(time.perf_counter() - start)
                assert response.status_code == 200, response.text
    finally:
        engine.stop()
    median = {name: statistics.median(v) for name, v in seconds.items()}
    print(f"SmolLM2-135M, 16 prompts x 32 new tokens, LoRA rank {args.rank} on all-linear (medians of {args.repeats}):")
    for name, value in median.items():
        print(f"  {name:>7}: {value:.2f} s, {16 * 32 / value:.0f} tok/s, {value / median['base']:.2f}x the base")


if __name__ == "__main__":
    main()
