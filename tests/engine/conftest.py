"""Engines shared by the engine tests: embedded engines on tiny models, alone and behind the router."""

import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from slime_mt.engine.client import EngineClient
from slime_mt.engine.launch import Router
from slime_mt.engine.server import LocalEngine


@dataclass
class Target:
    """Where a contract test sends requests: ``url`` for /generate, ``workers`` for control calls."""

    name: str
    url: str
    workers: list[str]
    model_path: Path

    def client(self, **kw) -> EngineClient:
        return EngineClient(self.url, worker_urls=self.workers, **kw)


class EngineFarm:
    """Starts engines and routers on demand, once per test session, and stops them at the end."""

    def __init__(self):
        self._targets: dict[str, Target] = {}
        self._stoppers = []
        self._log_dir = Path(tempfile.mkdtemp(prefix="slime-mt-router-"))

    def target(self, name: str, model_path: Path) -> Target:
        if name not in self._targets:
            kind, mode = name.split("-")
            if mode == "direct":
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


@pytest.fixture(params=["text-direct", "text-router"])
def text_target(request, farm, tiny_paths):
    return farm.target(request.param, tiny_paths["qwen2"])


@pytest.fixture(params=["vl-direct", "vl-router"])
def vl_target(request, farm, tiny_paths):
    return farm.target(request.param, tiny_paths["qwen2.5-vl"])
