"""What the agent gateway adds to a model call (engine time excluded), against a direct ``/generate``.

    .venv/bin/python benchmarks/gateway_overhead.py [--calls 12] [--context 3800]

Sessions of the real ``openai`` client against a gateway in front of the embedded engine serving the
tiny Qwen2 (real Qwen tokenizer and chat template), the engine in a process of its own (``slime-mt
serve``) so that its compute does not share the gateway's interpreter. Each session starts from a user message of about
``--context`` tokens and appends every answer and a short user turn, as an agent does. Per call the
gateway's time is the handler's wall time (body, parse, render with kept ids, record, answer) minus the
time its engine calls took; the direct figure is ``/generate`` through the engine client for the same
ids. Medians at concurrency 1 and 16 (sessions in parallel), measured in one run; goal: at most 5 ms
of gateway time per call at a 4k-token context. At 16 sessions a handler's wall time includes waiting
for the others on the one event loop, so the loop's CPU time per call (gateway and engine client
together) is printed beside it.
"""

import argparse
import asyncio
import contextvars
import multiprocessing
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slime_mt.assets import tiny_model_dir  # noqa: E402
from slime_mt.config_parsing import parse_config  # noqa: E402
from slime_mt.engine.embedded.server import wait_healthy  # noqa: E402
from slime_mt.gateway.server import Gateway, open_gateway  # noqa: E402
from slime_mt.rollout.context import RolloutContext  # noqa: E402
from slime_mt.types import Sample  # noqa: E402

ENGINE_SECONDS: contextvars.ContextVar[list] = contextvars.ContextVar("engine_seconds")
WORDS = "the quick brown fox jumps over a lazy dog while seven tired agents count apples ".split()


def instrument(ctx: RolloutContext, handler_seconds: list[float]) -> None:
    """Time every chat-completions request in the gateway, less the engine calls it made."""
    generate = ctx.client.generate

    async def timed_generate(*args, **kwargs):
        started = time.perf_counter()
        try:
            return await generate(*args, **kwargs)
        finally:
            ENGINE_SECONDS.get([]).append(time.perf_counter() - started)

    ctx.client.generate = timed_generate
    handle = Gateway.chat_completions

    async def timed_handler(self, request):
        engine: list[float] = []
        ENGINE_SECONDS.set(engine)
        started = time.perf_counter()
        response = await handle(self, request)
        handler_seconds.append(time.perf_counter() - started - sum(engine))
        return response

    Gateway.chat_completions = timed_handler


async def session_calls(base_url: str, calls: int, context_tokens: int) -> None:
    """One agent: a long first message, then every answer and a short user turn appended."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="EMPTY", max_retries=0)
    text = " ".join(WORDS[k % len(WORDS)] for k in range(context_tokens))
    messages = [{"role": "user", "content": text}]
    async with client:
        for k in range(calls):
            answer = await client.chat.completions.create(model="m", messages=messages, max_tokens=4)
            messages += [
                answer.choices[0].message.model_dump(exclude_none=True),
                {"role": "user", "content": f"go {k}"},
            ]


def agents(base_urls: list[str], calls: int, context_tokens: int) -> None:
    """The harnesses, in a process of their own (their client work is not the gateway's time)."""

    async def everyone():
        await asyncio.gather(*(session_calls(url, calls, context_tokens) for url in base_urls))

    asyncio.run(everyone())


async def direct_calls(ctx, ids: list[int], calls: int) -> list[float]:
    spans = []
    for _ in range(calls):
        started = time.perf_counter()
        await ctx.client.generate(ids, dict(ctx.sampling_params(), max_new_tokens=4))
        spans.append(time.perf_counter() - started)
    return spans


def run(ctx, concurrency: int, calls: int, context_tokens: int, handler_seconds: list[float]):
    gateway = ctx.run_sync(open_gateway(ctx))

    async def opened():
        return [
            gateway.open(Sample(index=k, metadata={"rollout_id": 0}), ctx.sampling_params()) for k in range(concurrency)
        ]

    sessions = ctx.run_sync(opened())
    handler_seconds.clear()
    cpu_before = ctx.run_sync(loop_cpu())
    process = multiprocessing.get_context("spawn").Process(
        target=agents, args=([gateway.base_url(s) for s in sessions], calls, context_tokens)
    )
    process.start()
    process.join()
    if process.exitcode != 0:
        raise RuntimeError(f"the agents' process exited with {process.exitcode}")
    cpu = (ctx.run_sync(loop_cpu()) - cpu_before) / (concurrency * calls)
    for session in sessions:
        ctx.run_sync(gateway.close(session))
    measured = list(handler_seconds)
    ids = ctx.tokenizer(" ".join(WORDS * (context_tokens // len(WORDS) + 10)), add_special_tokens=False)["input_ids"]

    async def direct():
        return await asyncio.gather(
            *(direct_calls(ctx, ids[: context_tokens + 100], calls) for _ in range(concurrency))
        )

    return measured, cpu, [s for spans in ctx.run_sync(direct()) for s in spans]


async def loop_cpu() -> float:
    """CPU seconds of the rollout loop's thread so far (the gateway and the engine client live on it)."""
    return time.thread_time()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=12, help="calls per session")
    parser.add_argument("--context", type=int, default=3800, help="tokens of the first user message")
    args = parser.parse_args()
    path = tiny_model_dir("qwen2")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    engine = subprocess.Popen(
        [sys.executable, "-m", "slime_mt.cli", "serve", "--model-path", str(path), "--port", str(port),
         "--max-batch-size", "32", "--cache-tokens", "200000"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url)
    cfg = parse_config(
        ["--hf-checkpoint", str(path), "--rollout-max-context-len", "8192", "--rollout-max-response-len", "4"]
    )
    ctx = RolloutContext.create(cfg, str(path), url)
    handler_seconds: list[float] = []
    instrument(ctx, handler_seconds)
    try:
        print(f"context ~{args.context} tokens, {args.calls} calls per session, tiny Qwen2 on the embedded engine")
        print(
            f"{'sessions':>8} {'gateway ms/call':>16} {'loop CPU ms/call':>17} {'direct /generate ms':>20} "
            f"{'gateway/direct':>15}"
        )
        for concurrency in (1, 16):
            measured, cpu, direct = run(ctx, concurrency, args.calls, args.context, handler_seconds)
            gateway_ms, direct_ms = statistics.median(measured) * 1e3, statistics.median(direct) * 1e3
            print(
                f"{concurrency:>8} {gateway_ms:>16.2f} {cpu * 1e3:>17.2f} {direct_ms:>20.2f} "
                f"{gateway_ms / direct_ms:>15.3f}"
            )
    finally:
        ctx.close()
        engine.terminate()
        engine.wait()


if __name__ == "__main__":
    main()
