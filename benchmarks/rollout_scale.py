"""The rollout side under a node's load: one rollout process against simulated engines, measured in one run.

    .venv/bin/python benchmarks/rollout_scale.py [--trajectories 256 1024 4096] [--engines 1 8]

Engines: N simulated SGLang-protocol engines, each in its own process (a small asyncio HTTP/1.1
server, no model), behind the real ``sglang-router`` when N > 1 (as ``start_engines`` puts them).
Each ``/generate`` answers ``--output-tokens`` ids (the last one the end-of-turn token, finish
"stop", each with a log-prob) after a latency drawn from a model of a continuous-batching engine:

    latency = (TTFT + prefill per uncached token x uncached tokens + decode steps x step time) x jitter
    step time = --step-ms x (1 + requests in flight on the engine / --batch-knee);  jitter ~ lognormal(0, 0.3)

The engine keeps each trajectory's last context (its prefix cache), so a turn prefills only its new
tokens.

Rollout: the real ``RolloutContext`` (on its own event loop thread, as in a run), ``EngineClient``
and ``run_episode``, the tiny Qwen2 tokenizer with its chat template, and a tool environment that
answers at once (a plain synchronous ``step``, as users write them). ``--trajectories`` episodes of
``--turns`` turns run concurrently; each one that ends is replaced by a new one, so the load stays.

Per size, after ``--warmup`` seconds, over ``--window`` seconds: turns per second (a turn = one
engine call and one env step), the rollout process's CPU time per turn (all its threads), its split
into client (the engine client's calls with their HTTP work and JSON, and the transport's socket
callbacks), tokenization (chat template rendering and tokenizing) and the rest (event loop, turn
loop, env and its thread pool, samples), measured with per-thread CPU clocks where each part runs
(see ``CpuSplit``), its memory per trajectory (RSS growth over the
process before the trajectories started, divided by their number), and the CPU the engines and the
router spent per turn.

Rollout processes (``--rollout-num-processes``), ``--processes 1 2 4``: the same engines, and groups
of ``--group-size`` trajectories run through ``group_rollout.run_group`` as a run's rollout side runs
them: in its own process (1), or in that many ``RolloutWorker`` Ray actors of a local Ray behind the
real ``RolloutWorkerPool``. The rollout side keeps ``--trajectories`` trajectories in flight (groups
replaced as they finish); the environment is the same tool environment with ``--env-cpu-ms`` of
pure-Python work per step (what a real environment's parsing and formatting costs, and what makes
one process the bottleneck). Reported per count: turns per second (engine calls of the finished
groups), the rollout side's own CPU per turn and all the rollout processes' together.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EOT = 151645  # <|im_end|>
VOCAB = 151643

# ---------------------------------------------------------------------------------------- engine


class SimulatedEngine(asyncio.Protocol):
    """One HTTP/1.1 connection of the simulated engine (keep-alive, Content-Length bodies)."""

    state: dict = {}

    def connection_made(self, transport):
        self.transport = transport
        self.buffer = bytearray()

    def connection_lost(self, exc):
        self.transport = None

    def data_received(self, data):
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = bytes(self.buffer[:end]).decode("latin-1").split("\r\n")
            method, path = lines[0].split(" ")[:2]
            length = 0
            for line in lines[1:]:
                key, _, value = line.partition(":")
                if key.strip().lower() == "content-length":
                    length = int(value)
            if len(self.buffer) < end + 4 + length:
                return
            body = bytes(self.buffer[end + 4 : end + 4 + length])
            del self.buffer[: end + 4 + length]
            self.handle(method, path, body)

    def send(self, payload: bytes, status: str = "200 OK"):
        if self.transport is not None and not self.transport.is_closing():
            head = f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(payload)}\r\n\r\n"
            self.transport.write(head.encode() + payload)

    def handle(self, method: str, path: str, body: bytes):
        import orjson

        s = self.state
        if path != "/generate":
            info = {"weight_version": "default", "model_path": "simulated"} if method == "GET" else {"success": True}
            self.send(orjson.dumps(info))
            return
        request = orjson.loads(body)
        ids = request["input_ids"]
        params = request.get("sampling_params") or {}
        n = max(1, min(s["output_tokens"], params.get("max_new_tokens", s["output_tokens"])))
        key = tuple(ids[: s["key_tokens"]])
        cached = s["cache"].pop(key, 0)
        cached = cached if cached <= len(ids) else 0
        s["cache"][key] = len(ids) + n
        if len(s["cache"]) > 100_000:
            s["cache"].pop(next(iter(s["cache"])))
        rng = s["rng"]
        out = [rng.randrange(VOCAB) for _ in range(n - 1)] + [EOT if n == s["output_tokens"] else rng.randrange(VOCAB)]
        finish = {"type": "stop", "matched": EOT} if out[-1] == EOT else {"type": "length", "length": n}
        step = s["step"] * (1 + s["in_flight"] / s["knee"])
        latency = (s["ttft"] + s["prefill"] * (len(ids) - cached) + n * step) * rng.lognormvariate(0, 0.3)
        response = {
            "text": " ".join("w" for _ in out),
            "output_ids": out,
            "meta_info": {
                "id": request.get("rid"),
                "finish_reason": finish,
                "prompt_tokens": len(ids),
                "completion_tokens": n,
                "cached_tokens": cached,
                "weight_version": "default",
                "output_token_logprobs": [[-rng.random(), t, None] for t in out],
                "e2e_latency": latency,
            },
        }
        s["in_flight"] += 1

        def answer():
            s["in_flight"] -= 1
            self.send(orjson.dumps(response))

        asyncio.get_running_loop().call_later(latency, answer)


def serve_engine(port: int, args) -> None:
    SimulatedEngine.state = {
        "output_tokens": args.output_tokens,
        "ttft": args.ttft_ms / 1e3,
        "prefill": args.prefill_us / 1e6,
        "step": args.step_ms / 1e3,
        "knee": args.batch_knee,
        "key_tokens": 64,
        "cache": collections.OrderedDict(),
        "in_flight": 0,
        "rng": random.Random(port),
    }

    async def main():
        server = await asyncio.get_running_loop().create_server(SimulatedEngine, "127.0.0.1", port, backlog=4096)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Engines:
    """N simulated engines in their own processes, behind the sglang-router when N > 1."""

    def __init__(self, n: int, args, log_dir: Path):
        import httpx

        self.procs = []
        self.router = None
        self.worker_urls = []
        engine_args = [f"--{k}={getattr(args, k.replace('-', '_'))}" for k in ENGINE_FLAGS]
        for _ in range(n):
            port = free_port()
            cmd = [sys.executable, __file__, "--serve", str(port), *engine_args]
            self.procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            self.worker_urls.append(f"http://127.0.0.1:{port}")
        for url in self.worker_urls:
            deadline = time.monotonic() + 30
            while True:
                try:
                    if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                        break
                except httpx.HTTPError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
        self.url = self.worker_urls[0]
        if n > 1:
            from slime_mt.engine.launch import Router

            self.router = Router(log_dir, policy=args.router_policy)
            for url in self.worker_urls:
                self.router.add_worker(url)
            self.url = self.router.url

    def pids(self) -> list[int]:
        pids = [p.pid for p in self.procs]
        if self.router is not None:
            pids.append(self.router._process.proc.pid)
        return pids

    def stop(self) -> None:
        if self.router is not None:
            self.router.stop()
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            p.wait(timeout=10)


ENGINE_FLAGS = ["output-tokens", "ttft-ms", "prefill-us", "step-ms", "batch-knee"]

# ---------------------------------------------------------------------------------------- CPU split


class CpuSplit:
    """CPU time of the rollout loop's thread by part, measured where it is spent (``thread_time``
    around each step of an engine call's coroutine, around the HTTP transport's socket callbacks and
    around the encoder's rendering and tokenizing); what is left of the process's CPU is the rest."""

    def __init__(self):
        self.seconds = collections.Counter()
        self.on = False
        self.inside = False  # a timed part is running: a part it calls is counted once, by it

    def function(self, owner, name: str, bucket: str) -> None:
        """Time a synchronous method of ``owner`` (a class or an instance) into ``bucket``."""
        inner = getattr(owner, name)
        split = self

        def timed(*args, **kwargs):
            if not split.on or split.inside:
                return inner(*args, **kwargs)
            started, split.inside = time.thread_time(), True
            try:
                return inner(*args, **kwargs)
            finally:
                split.inside = False
                split.seconds[bucket] += time.thread_time() - started

        setattr(owner, name, timed)

    def coroutine(self, owner, name: str, bucket: str) -> None:
        """Time every step of the coroutines an async method of ``owner`` returns into ``bucket``."""
        inner = getattr(owner, name)
        split = self

        async def timed(*args, **kwargs):
            coro = inner(*args, **kwargs)
            value, error = None, None
            while True:
                outer, started = not split.inside, time.thread_time()
                split.inside = True
                try:
                    yielded = coro.send(value) if error is None else coro.throw(error)
                except StopIteration as stop:
                    return stop.value
                finally:
                    if outer:
                        split.inside = False
                        if split.on:
                            split.seconds[bucket] += time.thread_time() - started
                try:
                    value, error = await _Yield(yielded), None
                except BaseException as e:  # noqa: BLE001 (passed into the timed coroutine)
                    value, error = None, e

        setattr(owner, name, timed)


class _Yield:
    """Hands one value a coroutine yielded to the event loop and returns what the loop sends back."""

    def __init__(self, value):
        self.value = value

    def __await__(self):
        return (yield self.value)


# ---------------------------------------------------------------------------------------- rollout

SYSTEM = (
    "You are an agent with a database tool. Call it with a query in <tool> tags; read its answer; "
    "answer the user's question in <answer> tags once you know it."
)


def prompt_of(i: int, k: int) -> list[dict]:
    """Trajectory ``i``'s ``k``-th question, as chat messages."""
    question = f"Question {i}.{k}: how many rows of table t{i % 97} have a value above {k * 13 % 1000}?"
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def tool_answer(step: int) -> tuple[dict, bool, dict]:
    """The tool environment's answer to its ``step``-th call (never done)."""
    return {"text": f"Tool result {step}: 42 rows matched; first row id={step * 7}."}, False, {}


def rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def measure(url: str, worker_urls: list[str], size: int, args, engine_pids: list[int]) -> dict:
    import psutil

    from envs.base import BaseInteractionEnv
    from slime_mt.assets import tiny_model_dir
    from slime_mt.config import DataConfig, RolloutConfig
    from slime_mt.engine.clients.sglang import EngineClient
    from slime_mt.processing import load_tokenizer_or_processor
    from slime_mt.rollout.context import RolloutContext
    from slime_mt.rollout.multi_turn import run_episode
    from slime_mt.tokenization import ObservationEncoder
    from slime_mt.types import Sample, Status

    turns = [0]

    class ToolEnv(BaseInteractionEnv):
        def __init__(self):
            self.steps = 0

        def step(self, response_text):
            self.steps += 1
            turns[0] += 1
            return tool_answer(self.steps)

    client = EngineClient(url, worker_urls, timeout=600.0)
    rollout = RolloutConfig(max_turns=args.turns, rollout_max_response_len=64, rollout_max_context_len=8192)
    ctx = RolloutContext(
        client,
        load_tokenizer_or_processor(tiny_model_dir("qwen2")),
        rollout,
        DataConfig(apply_chat_template=True),
        argparse.Namespace(),
    )
    params = {"temperature": 1.0, "top_p": 1.0, "no_stop_trim": True}
    failed = collections.Counter()
    split = CpuSplit()
    originals = [(ObservationEncoder, name, getattr(ObservationEncoder, name)) for name in ("render", "_tokenize")]
    split.function(ObservationEncoder, "render", "tokenization")
    split.function(ObservationEncoder, "_tokenize", "tokenization")
    split.coroutine(client, "generate", "client")  # the request's assembly, the gate, the answer's checks
    split.coroutine(client, "_post_with_retries", "client")  # sending and parsing (its own task, in wait_for)
    try:  # the transport's socket callbacks (this project's transport; httpx works inside the coroutine)
        from slime_mt.engine.http import _Connection

        originals.append((_Connection, "data_received", _Connection.data_received))
        split.function(_Connection, "data_received", "client")
    except ImportError:
        pass
    ctx.loop  # noqa: B018  (started before the baseline)
    base_rss = rss_mb()

    async def trajectory(i: int) -> None:
        k = 0
        while True:
            sample = Sample(index=i, prompt=prompt_of(i, k), metadata={"rollout_id": k})
            await run_episode(ctx, sample, params, env=ToolEnv())
            if sample.status not in (Status.COMPLETED,):
                failed[str(sample.metadata.get("error", sample.status))[:120]] += 1
            k += 1

    async def run():
        tasks = [asyncio.create_task(trajectory(i)) for i in range(size)]
        await asyncio.sleep(args.warmup)
        steady_rss = rss_mb()
        split.on = True
        children = [psutil.Process(p) for p in engine_pids]
        before = (time.perf_counter(), time.process_time(), turns[0], sum(sum(c.cpu_times()[:2]) for c in children))
        await asyncio.sleep(args.window)
        after = (time.perf_counter(), time.process_time(), turns[0], sum(sum(c.cpu_times()[:2]) for c in children))
        split.on = False
        for task in tasks:  # the episodes in flight are not measured: cancelled, not waited for
            task.cancel()
        _, stuck = await asyncio.wait(tasks, timeout=30)
        return before, after, steady_rss, len(stuck)

    try:
        before, after, steady_rss, stuck = ctx.run_sync(run())
    finally:
        ctx.close()
        for owner, name, original in originals:
            setattr(owner, name, original)
    wall, cpu, n = (after[i] - before[i] for i in range(3))
    per_turn = cpu / n * 1e3
    parts = {k: split.seconds[k] / n * 1e3 for k in ("client", "tokenization")}
    return {
        "turns_per_s": n / wall,
        "cpu_ms_per_turn": per_turn,
        "split": {**parts, "rest": per_turn - sum(parts.values())},
        "kb_per_trajectory": (steady_rss - base_rss) * 1024 / size,
        "engines_cpu_ms_per_turn": (after[3] - before[3]) / n * 1e3,
        "failed": dict(failed),
        "turns": n,
        "stuck": stuck,
    }


def in_fresh_process(engines: Engines, flags: list[str], what: str) -> dict:
    """This script run again with ``flags`` against ``engines`` -> the result it prints (nothing one
    measurement leaves behind weighs on the next)."""
    cmd = [sys.executable, *sys.argv, *flags, "--url", engines.url, "--worker-urls", *engines.worker_urls]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    line = next((x for x in reversed(done.stdout.splitlines()) if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{what} failed:\n{done.stderr[-3000:]}")
    return json.loads(line[len("RESULT ") :])


def measure_in_process(engines: Engines, size: int) -> dict:
    """``measure`` in a fresh rollout process."""
    flags = ["--measure", str(size), "--engine-pids", *map(str, engines.pids())]
    return in_fresh_process(engines, flags, f"the rollout process for {size} trajectories")


# ---------------------------------------------------------------------------------------- processes


class BusyToolEnv:
    """The tool environment of ``measure``, with ``ROLLOUT_SCALE_ENV_CPU_MS`` of pure-Python work per
    step (built by ``build_env`` in every rollout process: this file is the run's env module)."""

    def __init__(self, cpu_ms: float):
        self.steps = 0
        self.cpu_s = cpu_ms / 1e3

    def reset(self):
        return None

    def step(self, response_text):
        self.steps += 1
        started, x = time.thread_time(), 0
        while time.thread_time() - started < self.cpu_s:
            x += sum(range(200))
        return tool_answer(self.steps)

    def format_observation(self, observation):
        return [{"role": "user", "content": observation["text"]}]

    def close(self):
        return None


def build_env(sample=None, args=None, **kwargs):
    return BusyToolEnv(float(os.environ.get("ROLLOUT_SCALE_ENV_CPU_MS", "0")))


def measure_processes(url: str, worker_urls: list[str], processes: int, args) -> dict:
    """Groups through ``run_group`` with ``processes`` rollout processes (1: in this one)."""
    import dataclasses

    import psutil

    from slime_mt.assets import tiny_model_dir
    from slime_mt.config import Config
    from slime_mt.rollout.context import RolloutContext
    from slime_mt.rollout.group_rollout import load_plugins, run_group
    from slime_mt.types import Sample

    os.environ["ROLLOUT_SCALE_ENV_CPU_MS"] = str(args.env_cpu_ms)  # before Ray starts its workers
    cfg = Config()
    cfg.train.hf_checkpoint = str(tiny_model_dir("qwen2"))
    cfg.data.apply_chat_template = True
    cfg.rollout = dataclasses.replace(
        cfg.rollout,
        max_turns=args.turns,
        rollout_max_response_len=64,
        rollout_max_context_len=8192,
        rollout_interaction_env_path=str(Path(__file__).resolve()),
        rollout_concurrency=args.trajectories[0],
        rollout_num_processes=processes,
        rollout_process_num_cpus=0.01,
    )
    cfg.engine.engine_request_timeout = 600.0
    ctx = RolloutContext.create(cfg, cfg.train.hf_checkpoint, url, worker_urls)
    pids = []
    if processes > 1:
        from slime_mt.rollout.rollout_workers import RolloutWorkerPool

        ctx.rollout_workers = RolloutWorkerPool(cfg, url, worker_urls)
        pids = [w["pid"] for w in ctx.rollout_workers.where]
    generate, rm, _ = load_plugins(cfg.rollout)
    params = ctx.sampling_params()
    turns, groups = [0], [0]

    async def one_group_after_another(g: int, semaphore: asyncio.Semaphore) -> None:
        while True:
            k = groups[0]
            groups[0] += 1
            prompt = prompt_of(g, k)
            group = [
                Sample(index=k * args.group_size + i, group_index=k, prompt=prompt, metadata={"rollout_id": k})
                for i in range(args.group_size)
            ]
            done = await run_group(ctx, group, generate, rm, params, semaphore)
            turns[0] += sum(len(s.turns) for s in done)

    async def run():
        semaphore = asyncio.Semaphore(cfg.rollout.rollout_concurrency)
        n_groups = args.trajectories[0] // args.group_size
        tasks = [asyncio.create_task(one_group_after_another(g, semaphore)) for g in range(n_groups)]
        await asyncio.sleep(args.warmup)
        workers = [psutil.Process(p) for p in pids]
        before = (time.perf_counter(), time.process_time(), turns[0], sum(sum(w.cpu_times()[:2]) for w in workers))
        await asyncio.sleep(args.window)
        after = (time.perf_counter(), time.process_time(), turns[0], sum(sum(w.cpu_times()[:2]) for w in workers))
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks, timeout=30)
        return before, after

    try:
        before, after = ctx.run_sync(run())
    finally:
        ctx.close()
    wall, cpu, n, workers_cpu = (after[i] - before[i] for i in range(4))
    return {
        "turns_per_s": n / wall,
        "side_cpu_ms_per_turn": cpu / n * 1e3,
        "all_cpu_ms_per_turn": (cpu + workers_cpu) / n * 1e3,
        "turns": n,
    }


def processes_table(args) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as log_dir:
        engines = Engines(args.engines[-1], args, Path(log_dir))
        try:
            for processes in args.processes:
                flags = ["--measure-processes", str(processes)]
                r = in_fresh_process(engines, flags, f"the run with {processes} rollout processes")
                rows.append((processes, r))
                print(
                    f"processes={processes}: {r['turns_per_s']:.0f} turns/s, rollout side CPU "
                    f"{r['side_cpu_ms_per_turn']:.2f} ms/turn, all rollout processes {r['all_cpu_ms_per_turn']:.2f} "
                    f"ms/turn, {r['turns']} turns",
                    flush=True,
                )
        finally:
            engines.stop()
    base = rows[0][1]["turns_per_s"]
    print()
    print(
        f"engines={args.engines[-1]}, {args.trajectories[0]:,} trajectories in groups of {args.group_size}, "
        f"{args.env_cpu_ms} ms of environment CPU per step, {os.cpu_count()} CPUs"
    )
    print("| rollout processes | turns/s | vs 1 | rollout side CPU ms/turn | all rollout processes CPU ms/turn |")
    print("|---|---|---|---|---|")
    for processes, r in rows:
        print(
            f"| {processes} | {r['turns_per_s']:,.0f} | {r['turns_per_s'] / base:.2f}x "
            f"| {r['side_cpu_ms_per_turn']:.2f} | {r['all_cpu_ms_per_turn']:.2f} |"
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--engines", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds before the window")
    parser.add_argument("--window", type=float, default=15.0, help="seconds measured")
    parser.add_argument("--router-policy", default="cache_aware")
    parser.add_argument("--output-tokens", type=int, default=8)
    parser.add_argument("--ttft-ms", type=float, default=15.0)
    parser.add_argument("--prefill-us", type=float, default=20.0, help="per uncached prompt token")
    parser.add_argument("--step-ms", type=float, default=12.0, help="decode step at an empty batch")
    parser.add_argument("--batch-knee", type=float, default=256.0, help="in-flight requests that double a step")
    parser.add_argument("--processes", type=int, nargs="+", help="rollout processes to compare (e.g. 1 2 4)")
    parser.add_argument("--group-size", type=int, default=8, help="--processes: trajectories per group")
    parser.add_argument("--env-cpu-ms", type=float, default=1.0, help="--processes: env CPU per step")
    parser.add_argument("--measure-processes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--measure", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--worker-urls", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--engine-pids", type=int, nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve_engine(args.serve, args)
        return
    sys.path.insert(0, str(REPO))
    if args.measure:
        result = measure(args.url, args.worker_urls, args.measure, args, args.engine_pids)
        print("RESULT " + json.dumps(result), flush=True)
        os._exit(0)  # episodes in flight were cancelled; nothing else to wait for
    if args.measure_processes:
        result = measure_processes(args.url, args.worker_urls, args.measure_processes, args)
        print("RESULT " + json.dumps(result), flush=True)
        os._exit(0)
    if args.processes:
        processes_table(args)
        return
    rows = []
    with tempfile.TemporaryDirectory() as log_dir:
        for n_engines in args.engines:
            engines = Engines(n_engines, args, Path(log_dir))
            try:
                for size in args.trajectories:
                    result = measure_in_process(engines, size)
                    rows.append((n_engines, size, result))
                    split = ", ".join(f"{k} {v:.2f}" for k, v in result["split"].items())
                    print(
                        f"engines={n_engines} trajectories={size}: {result['turns_per_s']:.0f} turns/s, "
                        f"rollout CPU {result['cpu_ms_per_turn']:.2f} ms/turn ({split}), "
                        f"{result['kb_per_trajectory']:.0f} KB/trajectory, engines+router CPU "
                        f"{result['engines_cpu_ms_per_turn']:.2f} ms/turn, {result['turns']} turns"
                        + (f", FAILED {result['failed']}" if result["failed"] else "")
                        + (f", {result['stuck']} episodes did not end when cancelled" if result["stuck"] else ""),
                        flush=True,
                    )
            finally:
                engines.stop()
    print()
    print(
        "| engines | trajectories | turns/s | rollout CPU ms/turn | client | tokenization | rest "
        "| KB/trajectory | engines+router CPU ms/turn |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for n_engines, size, r in rows:
        s = r["split"]
        print(
            f"| {n_engines} | {size:,} | {r['turns_per_s']:,.0f} | {r['cpu_ms_per_turn']:.2f} | {s['client']:.2f} "
            f"| {s['tokenization']:.2f} | {s['rest']:.2f} | {r['kb_per_trajectory']:.0f} "
            f"| {r['engines_cpu_ms_per_turn']:.2f} |"
        )
    for n_engines in args.engines:
        costs = {size: r["cpu_ms_per_turn"] for e, size, r in rows if e == n_engines}
        if len(costs) > 1:
            small, large = min(costs), max(costs)
            print(f"engines={n_engines}: CPU per turn at {large:,} / at {small:,}: {costs[large] / costs[small]:.2f}x")


if __name__ == "__main__":
    main()
