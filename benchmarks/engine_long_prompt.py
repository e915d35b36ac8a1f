"""The embedded engine against oversized requests: a 10 MB text and a 4,088-token prompt with input log-probs.

    .venv/bin/python benchmarks/engine_long_prompt.py [--tokens 4088] [--repeats 3]

On the tiny Qwen2 (vocabulary 151,936, context 4,096) in this process: the seconds to the 400 that
refuses a 10 MB text (checked against the context before it is tokenized); then, for the long prompt's
input log-probs, the median seconds to its answer and the engine's peak memory over idle, projected a
chunk of positions at a time between decode steps (as served) against all positions at once (one chunk:
the former ``[T, V]`` logits), and how many short requests other clients got answered meanwhile.
"""

import argparse
import statistics
import threading
import time

import httpx
import torch

from slime_mt.assets import tiny_model_dir
from slime_mt.engine.embedded.server import LocalEngine


def memory_mb(field: str) -> int:
    with open("/proc/self/status") as fh:
        return int(next(line for line in fh if line.startswith(field)).split()[1]) // 1024


def long_prompt(url: str, ids: list[int]) -> tuple[float, int, int]:
    """(seconds, peak MB over the RSS before it, short requests answered while it ran)."""
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    idle, answered, stop = memory_mb("VmRSS"), [], threading.Event()

    def others():
        body = {"input_ids": [9707, 1879, 11], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
        while not stop.is_set():
            httpx.post(url + "/generate", json=body, timeout=600)
            answered.append(time.perf_counter())

    beside = threading.Thread(target=others)
    beside.start()
    started = time.perf_counter()
    body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 1}}
    response = httpx.post(url + "/generate", json=body, timeout=600)
    finished = time.perf_counter()
    stop.set()
    beside.join()
    assert response.status_code == 200 and len(response.json()["meta_info"]["input_token_logprobs"]) == len(ids)
    return finished - started, memory_mb("VmHWM") - idle, sum(started < t < finished for t in answered)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4088)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with LocalEngine(tiny_model_dir("qwen2"), max_batch_size=8) as engine:
        started = time.perf_counter()
        huge = httpx.post(engine.url + "/generate", json={"text": "hello world " * (10 * 2**20 // 12)}, timeout=600)
        print(f"10 MB text: HTTP {huge.status_code} in {time.perf_counter() - started:.2f} s")
        ids = torch.randint(100, 150000, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
        runner = engine.scheduler.runner
        chunked = runner.logprob_chunk_rows
        figures = {}
        for name, rows in (("chunked", chunked), ("at once", args.tokens)):
            runner.logprob_chunk_rows = rows
            runs = [long_prompt(engine.url, ids) for _ in range(args.repeats)]
            figures[name] = [statistics.median(r[k] for r in runs) for k in range(3)]
            seconds, peak, served = figures[name]
            print(
                f"{args.tokens}-token prompt, input log-probs {name} ({rows} rows a chunk): {seconds:.2f} s, "
                f"peak {peak} MB over idle, {served:.0f} short requests answered meanwhile"
            )
        (a, pa, _), (b, pb, _) = figures["chunked"], figures["at once"]
        print(f"chunked / at once: {a / b:.2f}x the seconds, {pa / max(pb, 1):.2f}x the peak memory")


if __name__ == "__main__":
    main()
