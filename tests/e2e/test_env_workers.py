"""Environment workers (``--env-num-workers``) on the session's Ray cluster of loopback nodes: an
episode's environment on a worker behaves as it does in-process (its answers, its faults and their
retries, its own formatting, sync or async), and a worker that dies is restarted, the episode rebuilt
and replayed, or failed when the replay shows another state than the model saw."""

import argparse
import asyncio
from pathlib import Path

import pytest
import ray

from slime_mt.config import RolloutConfig
from slime_mt.errors import EnvStepFailed
from slime_mt.rollout.env_steps import step_with_retries
from slime_mt.rollout.env_workers import EnvWorkerPool
from slime_mt.types import Sample

ENVS = '''
import asyncio
import uuid

from envs.base import BaseInteractionEnv, RetryableEnvError


class Counter(BaseInteractionEnv):
    """Counts the steps; "flaky" fails retryably every other call, "raise" raises ValueError, "random"
    answers with something new each time, "async" steps on the event loop."""

    def __init__(self, kind):
        self.kind, self.count, self.calls, self.closed = kind, 0, 0, False

    def reset(self):
        self.count = 0
        return {"text": "start"}  # the observation that opens the episode

    def step(self, text):
        self.calls += 1
        if self.kind == "flaky" and self.calls % 2:
            raise RetryableEnvError("busy")
        if self.kind == "raise":
            raise ValueError("bad move " + text)
        self.count += 1
        answer = uuid.uuid4().hex if self.kind == "random" else f"{text}:{self.count}"
        return {"text": answer}, text == "stop", {"reward": float(self.count)}

    def format_observation(self, observation):
        if observation["text"].startswith("unformattable"):
            raise KeyError("no template for it")
        return {"role": "tool", "content": "[" + observation["text"] + "]"}


class AsyncCounter(Counter):
    async def step(self, text):
        await asyncio.sleep(0)
        self.count += 1
        return {"text": f"{text}:{self.count}"}, False, {}


def build_env(sample=None, args=None, **kw):
    kind = sample.label
    return AsyncCounter(kind) if kind == "async" else Counter(kind)
'''


@pytest.fixture(scope="module")
def env_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("envs") / "counter_env.py"
    path.write_text(ENVS)
    return path


@pytest.fixture(scope="module")
def pool(env_path, three_nodes):
    workers = EnvWorkerPool(2, 1, str(env_path), argparse.Namespace(x=1), three_nodes.address, retries=2)
    try:
        yield workers
    finally:
        workers.close()


@pytest.fixture(scope="module")
def local_module(env_path):
    from slime_mt.plugins import load_module

    return load_module(str(env_path))


CTX = argparse.Namespace(rollout=RolloutConfig(max_env_retries_per_turn=2), env_executor=None, timeline=None)


async def _open(pool, module, where: str, kind: str):
    sample = Sample(prompt="p", label=kind)
    if where == "remote":
        return await pool.open_env(sample)
    return module.build_env(sample=sample, args=None)


async def _call(env, method: str, *args):
    result = getattr(env, method)(*args)
    return await result if asyncio.iscoroutine(result) else result


def test_the_workers_run_on_both_nodes(pool):
    assert len({w["node_id"] for w in pool.where}) == 2
    assert [line.split(":")[0] for line in pool.describe()] == ["env worker 0", "env worker 1"]


@pytest.mark.parametrize("where", ["in-process", "remote"])
def test_a_remote_environment_answers_and_fails_as_the_in_process_one(pool, local_module, where):
    """Answers, retryable faults (retried), other exceptions (the same message), the env's own
    formatting and its errors, async steps: the same on a worker as in the rollout's process."""

    async def episode():
        seen = {}
        env = await _open(pool, local_module, where, "plain")
        seen["opening"] = await _call(env, "reset")
        seen["opening_formatted"] = env.format_observation(seen["opening"])
        seen["steps"] = [await step_with_retries(CTX, env, text) for text in ("a", "b")]
        seen["formatted"] = env.format_observation(seen["steps"][-1][0])
        await _call(env, "close")
        flaky = await _open(pool, local_module, where, "flaky")
        seen["flaky"] = await step_with_retries(CTX, flaky, "x")
        await _call(flaky, "close")
        broken = await _open(pool, local_module, where, "raise")
        with pytest.raises(EnvStepFailed) as failed:
            await step_with_retries(CTX, broken, "x")
        seen["raised"] = (str(failed.value), failed.value.cause, type(failed.value.__cause__).__name__)
        await _call(broken, "close")
        unformattable = await _open(pool, local_module, where, "plain")
        observation, *_ = await step_with_retries(CTX, unformattable, "unformattable")
        with pytest.raises(KeyError, match="no template"):
            unformattable.format_observation(observation)
        await _call(unformattable, "close")
        asynchronous = await _open(pool, local_module, where, "async")
        seen["async"] = [await step_with_retries(CTX, asynchronous, t) for t in ("p", "q")]
        await _call(asynchronous, "close")
        return seen

    seen = asyncio.run(episode())
    assert seen["steps"] == [({"text": "a:1"}, False, {"reward": 1.0}, 0), ({"text": "b:2"}, False, {"reward": 2.0}, 0)]
    assert seen["formatted"] == {"role": "tool", "content": "[b:2]"}
    assert (seen["opening"], seen["opening_formatted"]) == ({"text": "start"}, {"role": "tool", "content": "[start]"})
    assert seen["flaky"] == ({"text": "x:1"}, False, {"reward": 1.0}, 1)
    assert seen["raised"] == ("env step raised ValueError: bad move x", "env step raised ValueError", "ValueError")
    assert seen["async"] == [({"text": "p:1"}, False, {}, 0), ({"text": "q:2"}, False, {}, 0)]
    if where == "remote":
        assert ray.get([w.held.remote() for w in pool.workers]) == [0, 0]  # every episode closed there
        assert pool.load == [0, 0]


def kill_and_wait_for_restart(pool, index: int) -> None:
    """Kill worker ``index``'s process (Ray restarts it) and wait until the new one answers: ``ray.kill``
    only asks for the kill."""
    before = ray.get(pool.workers[index].where.remote())["incarnation"]
    ray.kill(pool.workers[index], no_restart=False)
    while True:
        try:
            if ray.get(pool.workers[index].where.remote(), timeout=60)["incarnation"] != before:
                return
        except ray.exceptions.RayActorError:  # restarting
            pass


def test_a_restarted_worker_rebuilds_and_replays_the_episode(pool):
    """The worker holding an episode is killed between two steps: the next step fails retryably, the
    retry rebuilds the environment on the restarted worker, replays the two earlier steps and answers
    from the state the model saw (the third step); the restart is counted once."""

    async def episode():
        env = await pool.open_env(Sample(prompt="p", label="plain"))
        await env.reset()
        for text in ("a", "b"):
            await step_with_retries(CTX, env, text)
        before = pool.total_restarts
        kill_and_wait_for_restart(pool, env.index)  # not ray.kill alone: the step could reach the old process
        third = await step_with_retries(CTX, env, "c")
        await env.close()
        return third, pool.total_restarts - before

    third, restarts = asyncio.run(episode())
    assert third == ({"text": "c:3"}, False, {"reward": 3.0}, 1)
    assert restarts == 1


def test_a_replay_that_differs_from_what_the_model_saw_fails_the_sample(pool):
    async def episode():
        env = await pool.open_env(Sample(prompt="p", label="random"))
        await env.reset()
        await step_with_retries(CTX, env, "a")
        kill_and_wait_for_restart(pool, env.index)
        try:
            with pytest.raises(EnvStepFailed, match="replaying step 0 on the restarted environment worker"):
                await step_with_retries(CTX, env, "b")
        finally:
            await env.close()

    asyncio.run(episode())
    assert pool.load == [0, 0]
