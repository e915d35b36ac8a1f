"""Turn control: actions the env rejects as invalid do not count toward --max-turns, stay in the
trajectory as the model wrote them (their feedback masked), and past the budget end the sample."""

import asyncio

import pytest
from rollout_helpers import make_ctx

from envs.base import BaseInteractionEnv
from slime_mt.errors import InvalidActionError
from slime_mt.rollout.metrics import rollout_metrics
from slime_mt.rollout.multi_turn import run_episode
from slime_mt.types import Sample, Status

STOPS = list(range(3, 151643, 4)) + [151645]
SEEDED = {"temperature": 1.0, "sampling_seed": 7, "no_stop_trim": True, "stop_token_ids": STOPS}
PROMPT = [{"role": "user", "content": "Play along."}]


class Picky(BaseInteractionEnv):
    """Rejects the first ``rejections`` actions of every turn (by exception or by ``info``), then accepts."""

    def __init__(self, rejections: int, by_info: bool = False):
        self.rejections, self.by_info = rejections, by_info
        self.rejected_in_turn = 0
        self.accepted = 0

    def step(self, response_text):
        if self.rejected_in_turn < self.rejections:
            self.rejected_in_turn += 1
            feedback = f"invalid action {self.rejected_in_turn}: answer with a move"
            if self.by_info:
                return {"text": feedback}, False, {"invalid_action": True}
            raise InvalidActionError(feedback)
        self.rejected_in_turn = 0
        self.accepted += 1
        return {"text": f"accepted {self.accepted}"}, False, {}


@pytest.fixture(scope="module")
def target(farm, tiny_paths):
    return farm.target("q2term-direct", tiny_paths["qwen2"])


def episode(target, env, **rollout):
    ctx = make_ctx(target.url, target.model_path, max_turns=2, rollout_max_response_len=16, **rollout)
    sample = Sample(index=0, prompt=PROMPT)
    asyncio.run(run_episode(ctx, sample, dict(SEEDED, max_new_tokens=16), env=env))
    sample.validate()
    return sample, ctx


@pytest.mark.parametrize("by_info", [False, True])
def test_two_rejected_actions_per_turn_do_not_count_and_are_trained_as_generated(target, by_info):
    sample, ctx = episode(target, Picky(2, by_info), max_invalid_actions_per_turn=2)
    assert (sample.status, sample.metadata["termination"]) == (Status.COMPLETED, "max_turns")
    assert len(sample.turns) == 6  # 2 counted turns, each after 2 rejected ones
    assert sample.metadata["invalid_actions"] == 4
    tokenizer = ctx.tokenizer
    for k, turn in enumerate(sample.turns[:-1]):
        start = turn.output_start - sample.prompt_length
        assert sample.loss_mask[start : start + turn.output_tokens] == [1] * turn.output_tokens  # trained
        observation = sample.tokens[turn.output_end : turn.observation_end]
        assert sample.loss_mask[
            turn.output_end - sample.prompt_length : turn.observation_end - sample.prompt_length
        ] == [0] * len(observation)  # the feedback is masked
        text = tokenizer.decode(observation)
        expected = f"invalid action {k % 3 + 1}" if k % 3 < 2 else f"accepted {k // 3 + 1}"
        assert expected in text, (k, text)
    metrics = rollout_metrics([[sample]])
    assert metrics["rollout/invalid_actions_per_turn"] == pytest.approx(4 / 6)
    assert metrics["rollout/termination/max_turns"] == 1


def test_past_the_budget_the_sample_is_truncated_with_the_reason(target):
    sample, _ = episode(target, Picky(5), max_invalid_actions_per_turn=2)
    assert (sample.status, sample.metadata["termination"]) == (Status.TRUNCATED, "invalid_actions")
    assert len(sample.turns) == 3 and sample.metadata["invalid_actions"] == 3
    assert sample.turns[-1].observation_end == sample.turns[-1].output_end  # no feedback after the last


def test_a_zero_budget_ends_at_the_first_invalid_action(target):
    sample, _ = episode(target, Picky(1), max_invalid_actions_per_turn=0)
    assert (sample.status, sample.metadata["termination"], len(sample.turns)) == (
        Status.TRUNCATED,
        "invalid_actions",
        1,
    )
