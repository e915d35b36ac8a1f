"""envs/openenv.py against a real OpenEnv server (tests/openenv_guess_server.py, written on openenv-core
and run with .venv-openenv's python): a multi-turn episode through the wrapper on a real engine, the
server's first observation in the prompt, its rewards on the turns; the server killed mid-episode is a
recoverable fault (reset on the restarted server, the actions replayed, the episode goes on), and one
that stays down fails the sample past --max-env-resets; the action formats and bad settings."""

import argparse
import asyncio
import os
import random
import subprocess
import time

import httpx
import pytest
from rollout_helpers import make_ctx
from train_helpers import HELPERS, REPO

from envs.openenv import OpenEnvEnv, build_env, text_field
from slime_mt.engine.launch import free_port
from slime_mt.errors import InvalidActionError
from slime_mt.rollout.multi_turn import run_episode
from slime_mt.types import Sample, Status

STOPS = list(range(3, 151643, 4)) + [151645]
SEEDED = {"temperature": 1.0, "sampling_seed": 5, "no_stop_trim": True, "stop_token_ids": STOPS}
PROMPT = [{"role": "user", "content": "Let us play. Answer with a number."}]


def openenv_python() -> str:
    python = REPO / ".venv-openenv/bin/python"
    if not python.is_file():
        pytest.fail(f"no OpenEnv server here ({python}): bash -c 'source scripts/_venv.sh && ensure_openenv_venv'")
    return str(python)


def start_server(port: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [openenv_python(), str(HELPERS / "openenv_guess_server.py"), str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={k: v for k, v in os.environ.items() if not k.startswith("PYTHON")},
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the OpenEnv server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise TimeoutError("the OpenEnv server did not come up in 60 s")


def stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server():
    port = free_port()
    proc = start_server(port)
    yield f"http://127.0.0.1:{port}"
    stop(proc)


@pytest.fixture(scope="module")
def target(farm, tiny_paths):
    return farm.target("q2term-direct", tiny_paths["qwen2"])


def answer(target_number: int, text: str, k: int) -> str:
    """The game's reply to guess ``k`` (1-based), computed here from its rules (see the server)."""
    words = [w.strip(".,!") for w in text.split()]
    guess = next((int(w) for w in words if w.isdigit()), None)
    if guess is None:
        return f"That is not a number (guess {k} of 6)."
    if guess == target_number:
        return f"{guess} is correct!"
    return f"{guess}? Go {'higher' if guess < target_number else 'lower'}."


def episode(target, env, **rollout):
    rollout.setdefault("max_turns", 3)
    ctx = make_ctx(target.url, target.model_path, rollout_max_response_len=12, **rollout)
    sample = Sample(index=0, group_index=7, prompt=PROMPT, metadata={})
    asyncio.run(run_episode(ctx, sample, dict(SEEDED, max_new_tokens=12), env=env))
    sample.validate()
    return sample, ctx


def turn_texts(sample, tokenizer) -> tuple[list[str], list[str]]:
    outputs = [tokenizer.decode(sample.tokens[t.output_start : t.output_end]) for t in sample.turns]
    observations = [tokenizer.decode(sample.tokens[t.output_end : t.observation_end]) for t in sample.turns]
    return outputs, observations


def test_a_multi_turn_episode_through_the_wrapper(target, server):
    env = build_env(Sample(index=3, group_index=7, metadata={"openenv_url": server}), argparse.Namespace())
    sample, ctx = episode(target, env, max_turns=3)
    assert sample.status == Status.COMPLETED and len(sample.turns) == 3
    # the server's first observation follows the row's prompt, as part of the prompt (seed: the group)
    opening = [*PROMPT, {"role": "user", "content": "Game 7: guess my number between 1 and 100."}]
    assert sample.metadata["first_observation"] == opening[1]["content"]
    assert sample.tokens[: sample.prompt_length] == ctx.encoder().encode_prompt(opening, True).ids
    number = random.Random(7).randint(1, 100)
    outputs, observations = turn_texts(sample, ctx.tokenizer)
    replies = [answer(number, output.replace("<|im_end|>", ""), k) for k, output in enumerate(outputs, 1)]
    for reply, observation in zip(replies[:-1], observations[:-1]):
        assert reply in observation  # each turn's observation: the server's reply to the model's text
    rewards = [1.0 if reply.endswith("correct!") else 0.0 for reply in replies]
    assert [t.reward for t in sample.turns] == rewards  # the server's reward on each turn
    mask, start = sample.loss_mask, sample.prompt_length
    for turn in sample.turns:  # the model's outputs are trained, the server's replies never
        assert set(mask[turn.output_start - start : turn.output_end - start]) == {1}
        assert set(mask[turn.output_end - start : turn.observation_end - start]) <= {0}


class KilledAt(OpenEnvEnv):
    """Kills the server before the step ``at`` (1-based) and starts a new one on the same port."""

    def __init__(self, url, proc, at, restart=True):
        super().__init__(url, reset_args={"seed": 11})
        self.proc, self.at, self.restart, self.calls, self.resets = proc, at, restart, 0, 0

    async def reset(self):
        self.resets += 1
        return await super().reset()

    async def step(self, response_text):
        self.calls += 1
        if self.calls == self.at:
            stop(self.proc[0])
            if self.restart:
                self.proc[0] = start_server(int(self.url.rsplit(":", 1)[1]))
        return await super().step(response_text)


def test_the_server_killed_mid_episode_is_a_recoverable_fault(target):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = [start_server(port)]
    try:
        env = KilledAt(url, proc, at=2)
        sample, ctx = episode(target, env, max_turns=3)
        assert sample.status == Status.COMPLETED and len(sample.turns) == 3
        assert sample.metadata["env_resets"] == 1 and env.resets == 2
        assert sample.metadata["env_reset_causes"] == {"RecoverableEnvError": 1}
        assert "episode_restarts" not in sample.metadata  # same seed, same replies: the replay matched
        outputs, observations = turn_texts(sample, ctx.tokenizer)
        number = random.Random(11).randint(1, 100)
        # the new server answered turn 2 as the second guess of the game: turn 1 was replayed to it
        assert answer(number, outputs[1].replace("<|im_end|>", ""), 2) in observations[1]
        assert env.calls == 5  # turn 1, the lost turn 2, turn 1 replayed, turn 2 again, turn 3

        # a server that stays down: every reset fails, the sample is FAILED past the budget
        down = KilledAt(url, proc, at=1, restart=False)
        sample, _ = episode(target, down, max_turns=3, max_env_resets=1)
        assert sample.status == Status.FAILED
        assert sample.metadata["error_cause"] == "env faults past --max-env-resets (RecoverableEnvError)"
        assert "unreachable" in sample.metadata["error"]
    finally:
        if proc[0].poll() is None:
            stop(proc[0])


def test_action_formats_and_settings(server):
    async def play():
        env = OpenEnvEnv(server, action_format="json", reset_args={"seed": 3})
        assert (await env.reset())["text"] == "Game 3: guess my number between 1 and 100."
        observation, done, info = await env.step('```json\n{"message": "I say 50"}\n```')
        assert observation["text"] == answer(random.Random(3).randint(1, 100), "50", 1) and info == {"reward": 0.0}
        with pytest.raises(InvalidActionError, match="message: Field required; guess: Extra inputs"):
            await env.step('<action>{"guess": 3}</action>')  # the server's schema rejects it
        with pytest.raises(InvalidActionError, match="must be a JSON object"):
            await env.step("fifty")
        await env.close()
        env = OpenEnvEnv(server, reset_args={"seed": 3})  # text: the action's one string field, from /schema
        await env.reset()
        assert env.action_field == "message"
        assert (await env.step("I guess 50."))[0]["text"] == answer(random.Random(3).randint(1, 100), "50", 1)
        assert (await env.step("no idea"))[0]["text"] == "That is not a number (guess 2 of 6)."
        await env.close()

    asyncio.run(play())
    assert text_field({"properties": {"message": {"type": "string"}, "metadata": {"type": "object"}}}, "u") == "message"
    with pytest.raises(ValueError, match="2 string fields.*openenv_action_field"):
        text_field({"properties": {"a": {"type": "string"}, "b": {"type": "string"}}}, "u")
    with pytest.raises(ValueError, match="openenv_url 'localhost:1'"):
        OpenEnvEnv("localhost:1")
    with pytest.raises(ValueError, match="openenv_action_format 'xml'"):
        OpenEnvEnv(server, action_format="xml")
    with pytest.raises(ValueError, match="no server"):
        build_env(Sample(metadata={}), argparse.Namespace())
    env = build_env(
        Sample(group_index=2, metadata={}), argparse.Namespace(openenv_url=server, openenv_replayable=False)
    )
    assert (env.reset_args, env.replayable, env.ws_url) == ({"seed": 2}, False, server.replace("http", "ws") + "/ws")
