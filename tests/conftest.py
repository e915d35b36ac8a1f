"""Shared fixtures: offline model assets (built once into SLIME_MT_CACHE), tokenizers, the engines and
the vLLM server of the session, the browser. The tiers and the budget: tests/helpers/tiers.py."""

import os
import sys

# pytest keeps the assert-rewritten test modules in __pycache__ only where bytecode may be written: under
# PYTHONDONTWRITEBYTECODE (set on this machine and kept for the processes the tests start, which read the
# bytecode scripts/test.sh compiles) every collection rewrote the asserts of every test module again
# (pytest --collect-only -q: 13.6 s -> 9.7 s; each pytest-xdist worker collects as well)
sys.dont_write_bytecode = False
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# vLLM on CPU runs its worker in the engine-core process (not a third process that imports vLLM again):
# each vLLM server the tests start is ready about 10 s sooner (46.6 s -> 36.3 s on this machine).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# The Ray clusters the tests start (their nodes inherit this environment) start a worker process only
# for an actor or task that needs one, not idle ones ahead of time: a TP=2 run on three loopback nodes
# then starts 11 Python workers, not 13, and takes 62 CPU-s instead of 67-75 (39 s, not 41-46 s).
os.environ.setdefault("RAY_enable_worker_prestart", "0")
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
# Ray's log monitor (one per cluster) globs the session's log folder every 0.1 s until it holds 1000 files,
# then every 0.5 s: the session's cluster, up for the whole e2e tier, gains a few hundred worker logs and
# its monitor took 52 CPU-s of a whole run; from the start at the 0.5 s pace (1.4 CPU-s against 2.6 over
# the ray_tp2 run and the rollout-process tests). The lines still reach the driver, at most 0.5 s later.
os.environ.setdefault("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0")

import shutil  # noqa: E402
import tempfile  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import forkserver  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from inspection_helpers import CHROMIUM_ARGS  # noqa: E402
from vllm_helpers import VLLM_ARGS, vllm_python  # noqa: E402

torch.set_num_threads(1)
# the suite's `python -m slime_mt.cli` runs fork from a process that imported torch, transformers and
# megatron-core once (tests/helpers/forkserver.py; SLIME_MT_TEST_FORKSERVER=0: plain processes)
forkserver.install()

pytest_plugins = ["tiers"]


@pytest.fixture(scope="session")
def qwen_tokenizer():
    """The real Qwen tokenizer with the Qwen2.5 chat template."""
    from transformers import AutoTokenizer

    from slime_mt.assets import qwen_tokenizer_dir

    return AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir("qwen2.5")))


@pytest.fixture(scope="session")
def qwen3_tokenizer():
    from transformers import AutoTokenizer

    from slime_mt.assets import qwen_tokenizer_dir

    return AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir("qwen3")))


@pytest.fixture(scope="session")
def smollm2_path():
    from slime_mt.assets import smollm2_dir

    return smollm2_dir()


@pytest.fixture(scope="session")
def tiny_paths():
    """kind -> folder for every tiny random model (qwen2, qwen3, qwen2.5-vl, qwen3-vl)."""
    from slime_mt.assets import TINY_KINDS, tiny_model_dir

    return {kind: tiny_model_dir(kind) for kind in TINY_KINDS}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        item.module.__dict__["_slime_mt_failed"] = True
    return report


@pytest.fixture(scope="session", autouse=True)
def session_tmp(tmp_path_factory) -> Path:
    """The folder under which session-scoped fixtures write (``session_dir``): made before any module
    starts, so that the modules' clean-up below leaves it alone."""
    return tmp_path_factory.mktemp("session")


@pytest.fixture(scope="session")
def session_dir(session_tmp):
    """``session_dir(name)``: a new folder for a session-scoped fixture's files (a Megatron world's
    results, a run several modules read), kept until the session ends."""
    return lambda name: Path(tempfile.mkdtemp(prefix=f"{name}-", dir=session_tmp))


@pytest.fixture(scope="module", autouse=True)
def _module_tmp_cleanup(request, tmp_path_factory, session_tmp):
    """Removes the folders a module's fixtures made with ``tmp_path_factory`` once the module
    ends, unless one of its tests failed (pytest removes only a test's own ``tmp_path``); the
    session's folder stays until the session ends."""
    import shutil

    base = tmp_path_factory.getbasetemp()
    before = set(base.iterdir())
    yield
    if request.module.__dict__.get("_slime_mt_failed"):
        return
    for path in set(base.iterdir()) - before:
        shutil.rmtree(path, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    """GPU-marked tests run only where CUDA is available."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@dataclass
class Target:
    """Where a contract test sends requests: ``url`` for /generate, ``workers`` for control calls,
    ``engine`` the client it takes (local: SGLang's API; vllm)."""

    name: str
    url: str
    workers: list[str]
    model_path: Path
    engine: str = "local"

    def client(self, **kw):
        from slime_mt.engine.clients import client_for

        return client_for(self.engine, self.url, worker_urls=self.workers, **kw)


class EngineFarm:
    """Starts engines and routers on demand, once per test session, and stops them at the end."""

    def __init__(self):
        self._targets: dict[str, Target] = {}
        self._stoppers = []
        self._log_dir = Path(tempfile.mkdtemp(prefix="slime-mt-router-"))

    def target(self, name: str, model_path: Path) -> Target:
        """``{kind}-direct``: one embedded engine; ``{kind}-router``: two behind sglang-router;
        ``{kind}-vllm``: a vLLM server (``model_path`` must suit it: the tiny Qwen2 at head size 64)."""
        from slime_mt.engine.embedded.server import LocalEngine
        from slime_mt.engine.launch import Router, VLLMServer

        if name not in self._targets:
            kind, mode = name.split("-")
            if mode == "vllm":
                server = VLLMServer(model_path, self._log_dir / kind, extra_args=VLLM_ARGS, python=vllm_python())
                self._stoppers.append(server.stop)
                self._targets[name] = Target(name, server.url, [server.url], model_path, "vllm")
            elif mode == "direct":
                engine = LocalEngine(model_path, max_batch_size=16).start()
                self._stoppers.append(engine.stop)
                self._targets[name] = Target(name, engine.url, [engine.url], model_path)
            else:
                engines = [LocalEngine(model_path, max_batch_size=16, seed=i).start() for i in range(2)]
                self._stoppers.extend(e.stop for e in engines)
                router = Router(self._log_dir / kind)
                self._stoppers.append(router.stop)
                for e in engines:
                    router.add_worker(e.url)
                self._targets[name] = Target(name, router.url, [e.url for e in engines], model_path)
        return self._targets[name]

    def stop(self):
        for stop in reversed(self._stoppers):
            stop()


@pytest.fixture(scope="session")
def farm():
    f = EngineFarm()
    yield f
    f.stop()


@pytest.fixture(scope="session")
def vllm_target(farm):
    """One vLLM server for the session, on the tiny Qwen2 at head size 64 (tests that change its
    weights put the original ones and version "0" back)."""
    from slime_mt.assets import VLLM_TINY_KIND, tiny_model_dir

    return farm.target("text-vllm", tiny_model_dir(VLLM_TINY_KIND))


@pytest.fixture(scope="module")
def browser():
    """Chromium driven by Playwright, per module: its sync API keeps an event loop running in this
    thread while it is open, where ``asyncio.run`` of the tests that follow would fail."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        from tiers import skip_missing  # the plugin (pytest_plugins below): imported by pytest first

        skip_missing("Chromium, for the viewer's browser tests (scripts/test.sh installs the OS package as root)")
    playwright = pytest.importorskip("playwright.sync_api", reason="playwright is a test extra: pip install -e .[test]")
    with playwright.sync_playwright() as p:
        launched = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        yield launched
        launched.close()
