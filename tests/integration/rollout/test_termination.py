"""One test per termination path of the turn loop, against the embedded engine."""

import asyncio
import time

import pytest
from rollout_helpers import ScriptedEnv, make_ctx

from envs.base import BaseInteractionEnv
from slime_mt.engine.launch import free_port
from slime_mt.rollout.multi_turn import run_episode
from slime_mt.types import Sample, Status

STOPS = list(range(3, 151643, 4)) + [151645]  # a random tiny model ends a turn within a few tokens
# seeded sampling: reproducible, and unlike greedy it does not loop on one non-stop token
SEEDED = {"temperature": 1.0, "sampling_seed": 7, "no_stop_trim": True, "stop_token_ids": STOPS}
PROMPT = [{"role": "user", "content": "Play along."}]


@pytest.fixture(scope="module")
def target(farm, tiny_paths):
    return farm.target("q2term-direct", tiny_paths["qwen2"])


def episode(target, env, params=SEEDED, **rollout):
    rollout.setdefault("max_turns", 4)
    rollout.setdefault("rollout_max_response_len", 32)
    ctx = make_ctx(target.url, target.model_path, **rollout)
    sample = Sample(index=0, prompt=PROMPT)
    asyncio.run(run_episode(ctx, sample, dict(params, max_new_tokens=rollout["rollout_max_response_len"]), env=env))
    sample.validate()
    return sample, ctx


def test_env_done_completes(target):
    env = ScriptedEnv([{"text": "more"}], done_after=2)
    sample, _ = episode(target, env)
    assert (sample.status, sample.metadata["termination"], len(sample.turns)) == (Status.COMPLETED, "env_done", 2)
    assert env.closed


def test_max_turns_completes_without_dangling_observation(target):
    env = ScriptedEnv([{"text": "keep going"}])
    sample, ctx = episode(target, env, max_turns=2)
    assert (sample.status, sample.metadata["termination"]) == (Status.COMPLETED, "max_turns")
    assert len(sample.turns) == 2 and len(env.steps) == 2  # the env still judged the last turn
    last = sample.turns[-1]
    assert last.observation_end == last.output_end == len(sample.tokens)
    assert sample.tokens[-1] == ctx.client.calls[-1]["response"]["output_ids"][-1]
    assert sample.loss_mask[-last.output_tokens :] == [1] * last.output_tokens


def test_engine_length_truncates(target):
    params = {k: v for k, v in SEEDED.items() if k != "stop_token_ids"}
    sample, _ = episode(target, ScriptedEnv([{"text": "x"}]), params, rollout_max_response_len=3)
    assert (sample.status, sample.metadata["termination"]) == (Status.TRUNCATED, "engine_length")
    assert sample.turns[0].finish_reason == "length" and sample.turns[0].output_tokens == 3


def test_turn_budget_is_what_is_left_of_the_context(target):
    env = ScriptedEnv([{"text": "a much longer observation " * 4}])
    free, _ = episode(target, env, max_turns=2, rollout_max_context_len=4096)
    limit = free.turns[0].observation_end + 2  # room for only 2 tokens in turn 2
    sample, ctx = episode(
        target, ScriptedEnv([{"text": "a much longer observation " * 4}]), max_turns=2, rollout_max_context_len=limit
    )
    assert ctx.client.calls[1]["sampling_params"]["max_new_tokens"] == 2
    assert len(sample.tokens) <= limit


def test_observation_cut_at_context_limit(target):
    env = ScriptedEnv([{"text": "observation " * 40}])
    free, _ = episode(target, env, max_turns=2, rollout_max_context_len=4096)
    limit = free.turns[0].output_end + 7  # the observation needs far more than 7 tokens
    sample, _ = episode(
        target, ScriptedEnv([{"text": "observation " * 40}]), max_turns=2, rollout_max_context_len=limit
    )
    assert (sample.status, sample.metadata["termination"]) == (Status.TRUNCATED, "observation_cut")
    assert len(sample.tokens) == limit
    assert sample.loss_mask[-7:] == [0] * 7 and sample.turns[0].observation_tokens == 7


def test_context_exhausted_before_a_turn(target):
    env = ScriptedEnv([{"text": "fits exactly"}])
    free, _ = episode(target, env, max_turns=2, rollout_max_context_len=4096)
    limit = free.turns[0].observation_end  # the observation fills the context to the last token
    sample, ctx = episode(target, ScriptedEnv([{"text": "fits exactly"}]), max_turns=2, rollout_max_context_len=limit)
    assert (sample.status, sample.metadata["termination"]) == (Status.TRUNCATED, "context_exhausted")
    assert len(ctx.client.calls) == 1 and len(sample.tokens) == limit


def test_a_prompt_longer_than_the_context_fails_and_is_never_scored(target):
    """Issue 44 item 11: a prompt that leaves no room never reaches the model: the sample FAILS (out of its
    group and of reward_mean), it is not a 0-reward TRUNCATED sample."""
    sample, ctx = episode(target, ScriptedEnv([{"text": "x"}]), rollout_max_context_len=5)
    assert sample.status == Status.FAILED and ctx.client.calls == []
    assert sample.metadata["error_cause"] == "prompt longer than the context"
    assert "never reached the model" in sample.metadata["error"] and sample.reward is None


def test_prompts_past_the_limits_are_left_out_at_load_with_one_line(target, tmp_path, caplog):
    """Issue 44 item 11: --rollout-max-prompt-len (slime's flag), and always the prompts that leave no
    room in the context, are left out when the data is loaded, counted in one warning per dataset."""
    from slime_mt.config import DataConfig
    from slime_mt.data import PromptDataset, write_jsonl
    from slime_mt.errors import DatasetError
    from slime_mt.roles.rollout import drop_long_prompts

    path = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "word " * n} for n in (1, 40, 2, 400)])
    data_cfg = DataConfig(apply_chat_template=True)
    ctx = make_ctx(target.url, target.model_path, data_cfg, rollout_max_context_len=200)
    forty = len(ctx.encoder(None).encode_prompt("word " * 40, True).ids)  # the template's system prompt too
    assert forty < 199
    lines = {}
    for limit, kept in ((None, [0, 1, 2]), (forty - 1, [0, 2])):
        ctx = make_ctx(
            target.url, target.model_path, data_cfg, rollout_max_context_len=200, rollout_max_prompt_len=limit
        )
        dataset = PromptDataset.from_config(str(path), data_cfg, 2)
        caplog.clear()
        drop_long_prompts(dataset, ctx, str(path))
        assert [row.index for row in dataset.rows] == kept
        [lines[limit]] = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
        assert [g[0].metadata["row"] for g in dataset.get_samples(len(kept))] == kept  # draws see only these
    assert lines[None] == (
        f"{path}: 1 of 4 prompts are longer than 199 tokens (no room left in --rollout-max-context-len 200) "
        "and are left out (rows 3)"
    )
    assert lines[forty - 1] == (
        f"{path}: 2 of 4 prompts are longer than {forty - 1} tokens (--rollout-max-prompt-len {forty - 1}) and are "
        "left out (rows 1, 3)"
    )
    ctx = make_ctx(target.url, target.model_path, data_cfg, rollout_max_context_len=200, rollout_max_prompt_len=1)
    with pytest.raises(DatasetError, match="every one of its 4 prompts is longer than 1 tokens"):
        drop_long_prompts(PromptDataset.from_config(str(path), data_cfg, 2), ctx, str(path))


class Broken(BaseInteractionEnv):
    def __init__(self):
        self.closed = False

    def step(self, response_text):
        raise ValueError("grader crashed on input")

    def close(self):
        self.closed = True


def test_env_exception_fails_the_sample_and_closes_the_env(target):
    env = Broken()
    sample, _ = episode(target, env)
    assert sample.status == Status.FAILED
    assert "env step raised ValueError: grader crashed on input" in sample.metadata["error"]
    assert env.closed


def test_engine_that_does_not_answer_fails_the_sample(tiny_paths):
    ctx = make_ctx(f"http://127.0.0.1:{free_port()}", tiny_paths["qwen2"])
    ctx.client.max_retries, ctx.client.backoff = 1, 0.01
    sample = Sample(index=0, prompt=PROMPT)
    started = time.perf_counter()
    asyncio.run(run_episode(ctx, sample, dict(SEEDED, max_new_tokens=4), env=ScriptedEnv([{"text": "x"}])))
    assert sample.status == Status.FAILED and sample.metadata["error"].startswith("engine: engine http://127.0.0.1")
    assert time.perf_counter() - started < 10
