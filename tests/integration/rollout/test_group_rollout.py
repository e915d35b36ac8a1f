"""Group rollouts with plug-ins given by file path: envs, reward functions, filters, and faults."""

import json
import textwrap

import pytest
from rollout_helpers import make_ctx
from train_helpers import HELPERS, REPO

from slime_mt.config import DataConfig
from slime_mt.data import PromptDataset, load_rows
from slime_mt.rollout.group_rollout import generate_rollout
from slime_mt.rollout.metrics import rollout_metrics
from slime_mt.types import Status

STOPS = list(range(3, 151643, 4)) + [151645]
DATA_CFG = DataConfig(input_key="prompt", label_key="secret", apply_chat_template=True)


@pytest.fixture(scope="module")
def target(farm, tiny_paths):
    return farm.target("q2group-direct", tiny_paths["qwen2"])


def dataset(tmp_path, n_prompts, n_samples):
    path = tmp_path / "guess.jsonl"
    path.write_text(
        "".join(
            json.dumps({"prompt": f"Guess my number from 1 to 16 (game {i}).", "secret": 1 + i % 16}) + "\n"
            for i in range(n_prompts)
        )
    )
    return PromptDataset(load_rows(path, DATA_CFG), n_samples)


def context(target, **rollout):
    defaults = dict(
        rollout_max_response_len=24, rollout_temperature=1.0, rollout_stop_token_ids=STOPS, rollout_concurrency=16
    )
    ctx = make_ctx(target.url, target.model_path, data=DATA_CFG, **{**defaults, **rollout})
    return ctx


def test_example_env_by_file_path(target, tmp_path):
    ctx = context(
        target,
        rollout_interaction_env_path=str(REPO / "examples/custom_env/guess_env.py"),
        rollout_batch_size=3,
        n_samples_per_prompt=4,
        max_turns=3,
    )
    groups = generate_rollout(ctx.args, 0, dataset(tmp_path, 5, 4))
    assert len(groups) == 3 and all(len(g) == 4 for g in groups)
    assert [{s.group_index for s in g} for g in groups] == [{0}, {1}, {2}]
    for s in (s for g in groups for s in g):
        s.validate()
        assert s.status in (Status.COMPLETED, Status.TRUNCATED)
        assert isinstance(s.reward, float)
        assert 1 <= len(s.turns) <= 3
    metrics = rollout_metrics(groups)
    assert metrics["rollout/samples"] == 12
    assert sum(v for k, v in metrics.items() if k.startswith("rollout/status/")) == 12
    assert sum(v for k, v in metrics.items() if k.startswith("rollout/turns_hist/")) == 12
    assert metrics["rollout/generated_tokens"] > 0 and 0 < metrics["rollout/observation_share"] < 1


def test_custom_reward_dict_and_dynamic_filter_by_path(target, tmp_path):
    (tmp_path / "plugins.py").write_text(
        textwrap.dedent("""
        async def rm(args, sample):
            return {"score": float(len(sample.turns)), "length": sample.response_length}

        def keep_even(args, samples):
            return samples[0].group_index % 2 == 0
    """)
    )
    ctx = context(
        target,
        custom_rm_path=f"{tmp_path}/plugins.py:rm",
        reward_key="score",
        dynamic_sampling_filter_path=f"{tmp_path}/plugins.py:keep_even",
        over_sampling_batch_size=4,
        rollout_batch_size=3,
        n_samples_per_prompt=2,
        max_turns=1,
    )
    groups = generate_rollout(ctx.args, 0, dataset(tmp_path, 10, 2))
    assert [g[0].group_index for g in groups] == [0, 2, 4]
    for s in (s for g in groups for s in g):
        assert s.reward == float(len(s.turns)) and s.metadata["reward_dict"]["length"] == s.response_length


def test_flaky_env_over_64_trajectories(target, tmp_path):
    (tmp_path / "flaky_env.py").write_text(
        textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(HELPERS)!r})
        from rollout_helpers import FlakyEnv

        def build_env(sample=None, args=None, **kw):
            return FlakyEnv(seed=sample.index, p_retry=0.3, p_hang=0.05, turns=3)
    """)
    )
    ctx = context(
        target,
        rollout_interaction_env_path=str(tmp_path / "flaky_env.py"),
        rollout_batch_size=16,
        n_samples_per_prompt=4,
        max_turns=4,
        env_step_timeout=0.5,
        max_env_retries_per_turn=2,
        rollout_concurrency=64,
    )
    groups = generate_rollout(ctx.args, 0, dataset(tmp_path, 16, 4))
    samples = [s for g in groups for s in g]
    assert len(samples) == 64
    assert all(s.status in (Status.COMPLETED, Status.TRUNCATED, Status.FAILED) for s in samples)
    failed = [s for s in samples if s.status == Status.FAILED]
    assert failed, "with 35% faults per attempt and 2 retries some trajectories must fail"
    for s in failed:
        assert "env step failed 3 times (--max-env-retries-per-turn 2); last:" in s.metadata["error"]
        assert s.reward == 0.0
    metrics = rollout_metrics(groups)
    assert metrics["rollout/env_failures"] == len(failed)
    assert metrics["rollout/env_retries"] >= len(failed) * 2
    timeouts = [s for s in failed if "timed out after 0.5s" in s.metadata["error"]]
    retryables = [s for s in failed if "RetryableEnvError" in s.metadata["error"]]
    assert len(timeouts) + len(retryables) == len(failed)


CONTRACT_GENERATE = """
SEEN = []


async def generate(args, sample, sampling_params, evaluation=False):
    ctx = args.rollout_context
    SEEN.append((sample.index, list(sample.tokens), evaluation))
    for turn in range(2):
        response = await ctx.client.generate(sample.tokens, sampling_params)
        ctx.append_engine_turn(sample, response)
        if turn == 0:
            ctx.append_observation(sample, "Again, with one number.")
    sample.reward = float(sample.index)
    return sample
"""


@pytest.mark.parametrize("with_rm", [False, True])
def test_the_generate_contract_prompt_tokens_turns_reward_and_evaluation(target, tmp_path, with_rm):
    """Before the call: the prompt's tokens through the chat template; the turns it appends with the
    helpers train step-wise; the reward it set is kept unless a reward function is configured; a
    function that takes ``evaluation`` gets it; its samples end COMPLETED with no error counted."""
    from slime_mt.plugins import load_module
    from slime_mt.rollout.finalize import to_step_wise_samples

    (tmp_path / "gen.py").write_text(CONTRACT_GENERATE)
    (tmp_path / "rm.py").write_text("async def rm(args, sample):\n    return -1.0\n")
    ctx = context(
        target,
        custom_generate_function_path=f"{tmp_path}/gen.py:generate",
        custom_rm_path=f"{tmp_path}/rm.py:rm" if with_rm else None,
        rollout_batch_size=2,
        n_samples_per_prompt=2,
    )
    data = dataset(tmp_path, 2, 2)
    groups = generate_rollout(ctx.args, 0, data)
    seen = load_module(f"{tmp_path}/gen.py").SEEN
    samples = [s for g in groups for s in g]
    expected_prompt = ctx.encoder().encode_prompt(samples[0].prompt).ids
    assert [(i, e) for i, _, e in seen] == [(k, False) for k in range(4)]
    assert seen[0][1] == expected_prompt and samples[0].tokens[: len(expected_prompt)] == expected_prompt
    for s in samples:
        s.validate()
        assert s.status in (Status.COMPLETED, Status.TRUNCATED) and len(s.turns) == 2
        assert s.reward == (-1.0 if with_rm else float(s.index))
        assert s.turns[0].observation_end > s.turns[0].output_end  # the observation is on the turn's record
    steps = to_step_wise_samples(samples)
    assert len(steps) == 8 and steps[1].prompt_ids == samples[0].tokens[: samples[0].turns[1].output_start]
    metrics = rollout_metrics(groups)
    assert metrics["rollout/turns_mean"] == 2 and "rollout/termination/error" not in metrics
    assert metrics["rollout/generated_tokens"] == sum(s.loss_mask.count(1) for s in samples)
    generate_rollout(ctx.args, 1, dataset(tmp_path, 1, 1), evaluation=True)
    assert seen[-1][2] is True
