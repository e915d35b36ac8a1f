"""Recoverable environment faults (reset, replay, restart, the reset budget), env-declared tools,
per-turn rewards and DAPO's over-long shaping, on a real engine and tokenizer."""

import asyncio
import itertools

import pytest
from rollout_helpers import TOOLS, make_ctx

from envs.base import BaseInteractionEnv
from slime_mt.algo.advantages import compute_advantages
from slime_mt.errors import RecoverableEnvError
from slime_mt.rollout.finalize import to_concat_samples
from slime_mt.rollout.group_rollout import _assign_reward
from slime_mt.rollout.metrics import rollout_metrics
from slime_mt.rollout.multi_turn import run_episode
from slime_mt.rollout.rewards import turn_rewards_sum
from slime_mt.types import Sample, Status

STOPS = list(range(3, 151643, 4)) + [151645]
SEEDED = {"temperature": 1.0, "sampling_seed": 11, "no_stop_trim": True, "stop_token_ids": STOPS}
PROMPT = [{"role": "user", "content": "Play along."}]


class Counter(BaseInteractionEnv):
    """Answers step k of an episode with ``state k``; its state lives in a "server" that can be lost.

    ``reset_failures``: how many resets raise before one works; ``lose_at``: the step calls (1-based,
    over the env's life) that lose the state and raise RecoverableEnvError; ``noisy``: a replay answers
    otherwise than the first time."""

    def __init__(self, reset_failures=0, lose_at=(), replayable=True, noisy=False, rewards=False):
        self.reset_failures, self.lose_at = reset_failures, set(lose_at)
        self.replayable, self.noisy, self.rewards = replayable, noisy, rewards
        self.calls, self.log = 0, []
        self.state = None
        self.epoch = itertools.count()

    def reset(self):
        self.log.append("reset")
        if self.reset_failures:
            self.reset_failures -= 1
            raise ConnectionError("sandbox not up yet")
        self.state = 0 if not self.noisy else 100 * next(self.epoch)

    def step(self, response_text):
        self.calls += 1
        self.log.append(response_text)
        if self.calls in self.lose_at:
            self.state = None
            raise RecoverableEnvError("the sandbox restarted")
        if self.state is None:
            raise RuntimeError("step on a lost state")
        self.state += 1
        info = {"reward": 0.25 * self.state} if self.rewards else {}
        return {"text": f"state {self.state}"}, False, info


@pytest.fixture(scope="module")
def target(farm, tiny_paths):
    return farm.target("q2term-direct", tiny_paths["qwen2"])


def episode(target, env, prompt=PROMPT, metadata=None, **rollout):
    rollout.setdefault("max_turns", 3)
    ctx = make_ctx(target.url, target.model_path, rollout_max_response_len=16, **rollout)
    sample = Sample(index=0, group_index=0, prompt=prompt, metadata=dict(metadata or {}))
    asyncio.run(run_episode(ctx, sample, dict(SEEDED, max_new_tokens=16), env=env))
    sample.validate()
    return sample, ctx


def observations(sample, tokenizer) -> list[str]:
    return [tokenizer.decode(sample.tokens[t.output_end : t.observation_end]) for t in sample.turns]


def test_a_reset_that_fails_twice_then_works_starts_the_episode(target):
    env = Counter(reset_failures=2)
    sample, ctx = episode(target, env, max_env_resets=2)
    assert (sample.status, sample.metadata["termination"]) == (Status.COMPLETED, "max_turns")
    assert env.log[:3] == ["reset"] * 3
    assert sample.metadata["env_resets"] == 2
    metrics = rollout_metrics([[sample]])
    assert metrics["rollout/env_resets"] == 2 and metrics["rollout/env_resets_by/ConnectionError"] == 2
    assert metrics["rollout/valid_turns_hist/3"] == 1


def test_a_reset_failing_past_the_budget_fails_the_sample_out_of_its_groups_statistics(target):
    sample, _ = episode(target, Counter(reset_failures=3), max_env_resets=2)
    assert sample.status == Status.FAILED and not sample.turns
    assert sample.metadata["error_cause"] == "env faults past --max-env-resets (ConnectionError)"
    assert "--max-env-resets 2" in sample.metadata["error"]
    good = []
    for k in (1, 2):
        done = Sample(index=k, group_index=0, status=Status.COMPLETED, reward=float(k))
        done.set_prompt_tokens([1])
        done.append_turn([2], [0.0])
        good.append(done)
    sample.reward = 0.0
    advantages = compute_advantages(to_concat_samples([*good, sample]), "grpo")
    assert advantages[:2] == pytest.approx([-0.7071, 0.7071], abs=1e-3)  # the group is the two live ones
    assert advantages[2] == 0.0  # the failed sample's 0 neither scored nor moved the mean


def test_a_fault_mid_episode_resets_replays_the_actions_and_the_episode_goes_on(target):
    env = Counter(lose_at={3})
    sample, ctx = episode(target, env, max_turns=4)
    assert (sample.status, sample.metadata["termination"]) == (Status.COMPLETED, "max_turns")
    first, second, third = env.log[1:4]
    assert env.log[:4] == ["reset", first, second, third]
    assert env.log[4:8] == ["reset", first, second, third]  # the two answered actions again, then the lost one
    assert len(env.log) == 9  # and the fourth turn's action
    seen = observations(sample, ctx.tokenizer)
    assert [f"state {k}" in o for k, o in zip((1, 2, 3), seen)] == [True] * 3  # the episode went on
    assert len(sample.turns) == 4 and sample.metadata["env_resets"] == 1
    assert sample.metadata["env_reset_causes"] == {"RecoverableEnvError": 1}
    assert "episode_restarts" not in sample.metadata


@pytest.mark.parametrize("how", ["not_replayable", "replay_diverges"])
def test_an_env_that_cannot_replay_restarts_the_episode_from_its_prompt(target, how):
    env = Counter(lose_at={2}, replayable=how == "replay_diverges", noisy=how == "replay_diverges")
    sample, ctx = episode(target, env, max_turns=3)
    assert (sample.status, sample.metadata["termination"]) == (Status.COMPLETED, "max_turns")
    assert sample.metadata["episode_restarts"] == 1 and sample.metadata["env_resets"] == 1
    assert len(sample.turns) == 3  # the turns before the restart are gone, never trained
    assert sample.prompt_length == len(ctx.encoder().encode_prompt(PROMPT, True).ids)
    # a replay answered "state 101" != "state 1": the env is reset once more and the episode restarts
    base = 200 if how == "replay_diverges" else 0
    assert [o.split("state ")[1].split("<")[0] for o in observations(sample, ctx.tokenizer)[:2]] == [
        str(base + 1),
        str(base + 2),
    ]
    assert rollout_metrics([[sample]])["rollout/episode_restarts"] == 1


def test_faults_past_the_reset_budget_fail_the_sample(target):
    sample, _ = episode(target, Counter(lose_at={2, 3, 4}), max_env_resets=2, max_turns=4)
    assert sample.status == Status.FAILED
    assert sample.metadata["error_cause"] == "env faults past --max-env-resets (RecoverableEnvError)"
    assert sample.metadata["env_resets"] == 3


class Opening(Counter):
    """Opens each episode with its board (``board <state>``): a reset's observation, in slime's form
    ``(observation, reset_info)``."""

    def reset(self):
        super().reset()
        return {"text": f"board {self.state}"}, {"seed": 0}


@pytest.mark.parametrize("noisy", [False, True], ids=["same_opening", "new_opening"])
def test_the_resets_observation_follows_the_prompt_and_a_new_one_restarts_the_episode(target, noisy):
    env = Opening(lose_at={2}, noisy=noisy)
    sample, ctx = episode(target, env, max_turns=3)
    assert (sample.status, len(sample.turns)) == (Status.COMPLETED, 3)
    board = "board 100" if noisy else "board 0"  # after the reset, the noisy env opens with another board
    opened = [*PROMPT, {"role": "user", "content": board}]
    assert sample.tokens[: sample.prompt_length] == ctx.encoder().encode_prompt(opened, True).ids
    assert sample.metadata["first_observation"] == board
    states = [o.split("state ")[1].split("<")[0] for o in observations(sample, ctx.tokenizer)[:2]]
    if noisy:  # the episode began again from the new board, never replayed onto it
        assert sample.metadata["episode_restarts"] == 1 and states == ["101", "102"]
    else:  # the same board: the first action replayed, the episode went on
        assert "episode_restarts" not in sample.metadata and states == ["1", "2"]
    assert sample.metadata["env_resets"] == 1


class Tooled(Counter):
    def __init__(self):
        super().__init__(rewards=True)
        self.tools = TOOLS


def test_env_tools_go_into_the_template_in_place_of_the_rows_and_turn_rewards_are_kept(target):
    row_tools = [{"type": "function", "function": {"name": "row_only_tool", "parameters": {"type": "object"}}}]
    sample, ctx = episode(target, Tooled(), metadata={"tools": row_tools})
    prompt = ctx.tokenizer.decode(sample.tokens[: sample.prompt_length])
    assert '"name": "calculator"' in prompt and "row_only_tool" not in prompt
    assert sample.tokens[: sample.prompt_length] == ctx.encoder(TOOLS).encode_prompt(PROMPT, True).ids
    assert sample.metadata["tools"] == TOOLS
    assert [t.reward for t in sample.turns] == [0.25, 0.5, 0.75]
    assert asyncio.run(turn_rewards_sum(ctx.args, sample)) == 1.5
    assert sample.metadata["env_reward"] == 0.75  # the trajectory's reward without a reward function: the last


def test_overlong_shaping_is_added_to_the_trajectory_reward_in_training_only(target):
    ctx = make_ctx(target.url, target.model_path, overlong_buffer_len=4, overlong_max_len=10)
    sample = Sample(index=0, status=Status.COMPLETED, reward=1.0)
    sample.set_prompt_tokens([1, 2])
    sample.append_turn([5] * 4, [0.0] * 4)
    sample.append_observation([9, 9])
    sample.append_turn([6] * 5, [0.0] * 5)  # 9 generated tokens (observations do not count): 9 - 6 = 3 over
    asyncio.run(_assign_reward(ctx, sample, None))
    assert sample.reward == pytest.approx(1.0 - 3 / 4) and sample.metadata["overlong_penalty"] == -0.75
    evaluated = Sample(index=1, status=Status.COMPLETED, reward=1.0, turns=sample.turns)
    asyncio.run(_assign_reward(ctx, evaluated, None, shape=False))
    assert evaluated.reward == 1.0
