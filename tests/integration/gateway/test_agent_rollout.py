"""rollouts.agent.generate on its own: what an agent returns, raises or overruns becomes the sample's
reward, metrics or failure, and nothing it started outlives it."""

import sys
import time
from pathlib import Path

import pytest
from gateway_helpers import Harness

from rollouts.agent import generate
from slime_mt.types import Sample, Status

AGENTS = """
import asyncio
import openai


async def one_call(base_url, sample, args):
    client = openai.AsyncOpenAI(base_url=base_url, api_key=args.gateway_api_key, max_retries=0)
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    return {"reward": 0.75, "calls": 1, "note": "text is not a metric"}


def blocking(base_url, sample, args):
    client = openai.OpenAI(base_url=base_url, api_key=args.gateway_api_key, max_retries=0)
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    return 0.25


async def raises(base_url, sample, args):
    await one_call(base_url, sample, args)
    raise KeyError("the harness broke")


async def returns_nothing(base_url, sample, args):
    await one_call(base_url, sample, args)


async def no_call(base_url, sample, args):
    return 1.0


async def hangs(base_url, sample, args):
    await one_call(base_url, sample, args)
    await asyncio.sleep(3600)
"""


@pytest.fixture(scope="module")
def agents(tmp_path_factory):
    path = tmp_path_factory.mktemp("agents") / "agents.py"
    path.write_text(AGENTS)
    return path


@pytest.fixture(scope="module")
def agent_harness(scripted_path, scripted_engine):
    harness = Harness(scripted_path, scripted_engine.url, ["--agent-timeout", "2"])
    yield harness
    harness.stop()


def _run(harness, function: str | None = None, command: str | None = None) -> Sample:
    harness.ctx.gateway_config.agent_function_path = function
    harness.ctx.gateway_config.agent_command = command
    sample = Sample(index=0, group_index=0, prompt="What is 2 + 3?", label=5, metadata={"rollout_id": 0})
    done = harness.ctx.run_sync(generate(harness.ctx.args, sample, harness.ctx.sampling_params()))
    assert not harness.gateway.sessions  # every session closed
    return done


@pytest.mark.parametrize(
    "name, status, reward, cause",
    [
        ("one_call", Status.COMPLETED, 0.75, None),
        ("blocking", Status.COMPLETED, 0.25, None),
        ("raises", Status.FAILED, None, "agent raised KeyError"),
        ("returns_nothing", Status.FAILED, None, "agent raised AgentError"),
        ("no_call", Status.FAILED, None, "agent made no model call"),
    ],
)
def test_what_an_agent_returns_or_raises(agent_harness, agents, name, status, reward, cause):
    sample = _run(agent_harness, function=f"{agents}:{name}")
    assert sample.status == status, sample.metadata.get("error")
    assert sample.reward == reward
    assert sample.metadata.get("error_cause") == cause
    if name == "one_call":
        assert sample.metadata["agent_metrics"] == {"calls": 1.0}
        assert sample.metadata["gateway"]["calls"] == 1 and len(sample.turns) == 1
        sample.validate()
    if name == "raises":
        assert "the harness broke" in sample.metadata["error"] and len(sample.turns) == 1


def test_an_agent_past_its_timeout_fails_and_its_session_closes(agent_harness, agents):
    started = time.monotonic()
    sample = _run(agent_harness, function=f"{agents}:hangs")
    assert time.monotonic() - started < 30
    assert sample.status == Status.FAILED and sample.metadata["error_cause"] == "agent timed out"


def _state(status: Path) -> str:
    """The ``State:`` of a /proc status file (a process gone meanwhile reads as one that ended)."""
    try:
        return status.read_text().split("State:")[1].splitlines()[0]
    except (OSError, IndexError):
        return "\tZ (gone)"


@pytest.mark.parametrize(
    "program, status, cause",
    [
        ("import json, sys; json.load(sys.stdin); print('log line'); print('{\"reward\": 0.5}')", Status.FAILED,
         "agent made no model call"),
        ("import sys; sys.stderr.write('boom'); sys.exit(3)", Status.FAILED, "agent raised AgentError"),
        ("print('no json here')", Status.FAILED, "agent raised AgentError"),
        ("import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(3600)", Status.FAILED,
         "agent timed out"),
    ],
)  # fmt: skip
def test_an_agent_command_is_read_or_fails_the_sample(agent_harness, tmp_path, program, status, cause):
    script = tmp_path / "agent.py"
    script.write_text(program)
    started = time.monotonic()
    pid_file = tmp_path / "pid"
    sample = _run(agent_harness, command=f"{sys.executable} {script} {pid_file}")
    assert time.monotonic() - started < 30
    assert (sample.status, sample.metadata["error_cause"]) == (status, cause)
    if "exit" in program:
        assert "status 3" in sample.metadata["error"] and "boom" in sample.metadata["error"]
    assert pid_file.exists() == ("sleep" in program)
    if pid_file.exists():  # the program that overran was killed with its process group
        status = Path(f"/proc/{pid_file.read_text()}/status")
        deadline = time.monotonic() + 10  # SIGKILL is sent; on a loaded machine the exit may come a moment later
        while status.exists() and "\tZ" not in _state(status) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not status.exists() or "\tZ" in _state(status)
