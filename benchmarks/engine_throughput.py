"""Engine throughput: generated tokens/s at each concurrency level and the batched/sequential ratio.

    .venv/bin/python benchmarks/engine_throughput.py [--requests 16] [--max-new-tokens 64]
    .venv/bin/python benchmarks/engine_throughput.py --engine vllm --vllm-python .venv-vllm/bin/python
    python benchmarks/engine_throughput.py --requests 64 --concurrency 1,16,64 --max-batch-size 64   # on a GPU

Runs SmolLM2-135M-Instruct (real weights) and the tiny Qwen2.5-VL (two images per request) on the
embedded engine in one process; with ``--engine vllm`` SmolLM2 also on a vLLM server, in the same
run (vLLM serves text models only here). Each level sends the same ``--requests`` prompts through
the run's client with at most ``c`` in flight. Sequential = concurrency 1. The embedded engine runs
on CUDA when a GPU is present; vLLM on what its build targets (float32 on CPUs).
"""

import argparse
import asyncio
import contextlib
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from slime_mt.assets import smollm2_dir, tiny_model_dir  # noqa: E402
from slime_mt.engine.clients import client_for  # noqa: E402
from slime_mt.engine.embedded.server import LocalEngine  # noqa: E402
from slime_mt.engine.images import encode_image  # noqa: E402
from slime_mt.engine.launch import VLLMServer  # noqa: E402
from slime_mt.engine.protocol import collapse_image_pads  # noqa: E402
from slime_mt.processing import load_tokenizer_or_processor  # noqa: E402


def text_requests(path, n):
    tokenizer = load_tokenizer_or_processor(path)
    questions = [
        "Explain why the sky is blue.",
        "Write a short poem about rivers.",
        "What is a prime number?",
        "Describe a cat.",
        "How do airplanes fly?",
        "Give three tips for studying.",
    ]
    out = []
    for i in range(n):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": questions[i % len(questions)]}], add_generation_prompt=True
        )
        out.append((list(ids["input_ids"] if hasattr(ids, "keys") else ids), None))
    return out


def vlm_requests(path, n):
    from PIL import Image, ImageDraw

    processor = load_tokenizer_or_processor(path)
    out = []
    for i in range(n):
        images = []
        for k in range(2):
            image = Image.new("RGB", (112, 112), (30 * i % 256, 60 * k % 256, 90))
            ImageDraw.Draw(image).line([(0, 0), (111, 20 + 5 * i)], fill=(255, 255, 255), width=3)
            images.append(image)
        text = processor.apply_chat_template(
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "image"},
                        {"type": "image"},
                        {"type": "text", "text": f"Question {i}: compare the lines."},
                    ],
                }
            ],
            add_generation_prompt=True,
        )
        expanded = processor(text=text, images=images)["input_ids"][0].tolist()
        ids, _ = collapse_image_pads(expanded, processor.image_token_id)
        out.append((ids, [encode_image(im) for im in images]))
    return out


async def run_level(url, requests, concurrency, max_new_tokens, engine="local"):
    sem = asyncio.Semaphore(concurrency)
    async with client_for(engine, url) as client:

        async def one(i, ids, images):
            async with sem:
                r = await client.generate(
                    ids,
                    {"max_new_tokens": max_new_tokens, "temperature": 1.0, "ignore_eos": True, "sampling_seed": i},
                    image_data=images,
                )
                return r["meta_info"]["completion_tokens"]

        started = time.perf_counter()
        tokens = await asyncio.gather(*(one(i, ids, imgs) for i, (ids, imgs) in enumerate(requests)))
        return sum(tokens) / (time.perf_counter() - started)


@contextlib.contextmanager
def serving(engine, path, args):
    """An engine serving ``path`` -> its URL: the embedded engine, or a vLLM server."""
    if engine == "vllm":
        server = VLLMServer(path, Path(tempfile.mkdtemp()), python=args.vllm_python, extra_args=args.vllm_extra_args)
        try:
            yield server.url
        finally:
            server.stop()
    else:
        with LocalEngine(path, max_batch_size=args.max_batch_size) as local:
            yield local.url


def bench(name, path, make, args, engine="local"):
    requests = make(path, args.requests)
    rates = {}
    with serving(engine, path, args) as url:
        asyncio.run(run_level(url, requests[:2], 2, 4, engine))  # warm-up
        for c in args.concurrency:
            runs = [asyncio.run(run_level(url, requests, c, args.max_new_tokens, engine)) for _ in range(args.repeats)]
            rates[c] = statistics.median(runs)
    print(
        f"{name} [{engine}]: "
        + ", ".join(f"c={c}: {r:.1f} tok/s" for c, r in rates.items())
        + " | batched/sequential: "
        + ", ".join(f"c={c}: {rates[c] / rates[1]:.2f}x" for c in rates if c != 1),
        flush=True,
    )
    return rates


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--concurrency",
        type=lambda v: [int(c) for c in v.split(",")],
        default=[1, 4, 16],
        help="comma-separated levels; the first must be 1 (the sequential reference)",
    )
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--engine", choices=["local", "vllm"], default="local", help="vllm: both engines, one run")
    parser.add_argument("--vllm-python", default=None, help="the Python of a venv with vLLM (.venv-vllm/bin/python)")
    parser.add_argument("--vllm-extra-args", default="--dtype float32 --max-model-len 2048")
    args = parser.parse_args()
    if args.concurrency[0] != 1:
        parser.error("--concurrency must start with 1, the sequential reference")
    torch.set_num_threads(int(os.environ.get("SLIME_MT_THREADS", "2")))
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(
        f"device={device}, torch threads={torch.get_num_threads()}, requests={args.requests}, "
        f"max_new_tokens={args.max_new_tokens}"
    )
    bench("SmolLM2-135M-Instruct", smollm2_dir(), text_requests, args)
    if args.engine == "vllm":
        bench("SmolLM2-135M-Instruct", smollm2_dir(), text_requests, args, "vllm")
    bench("tiny Qwen2.5-VL (2 images/request)", tiny_model_dir("qwen2.5-vl"), vlm_requests, args)


if __name__ == "__main__":
    main()
