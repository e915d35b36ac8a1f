"""The LLM judge (envs/llm_judge.py): SmolLM2 on the embedded engine as the judge, score parsing over
well-formed, malformed and adversarial answers, timeouts and retries, the per-step cache and its
metrics, the reward function's failure paths, and a multi-turn episode whose observations are the
judge's critiques."""

import argparse
import asyncio
import time

import pytest
from rollout_helpers import make_ctx  # noqa: E402

from envs.llm_judge import Judge, JudgeError, JudgeFeedbackEnv, judge_reward  # noqa: E402
from slime_mt.engine.clients import client_for  # noqa: E402
from slime_mt.errors import EngineError  # noqa: E402
from slime_mt.processing import load_tokenizer_or_processor, tokenizer_of  # noqa: E402
from slime_mt.rollout.metrics import rollout_metrics  # noqa: E402
from slime_mt.rollout.multi_turn import run_episode  # noqa: E402
from slime_mt.types import Sample, Status  # noqa: E402


@pytest.fixture(scope="module")
def judge_engine(smollm2_path):
    from slime_mt.engine.embedded.server import LocalEngine

    engine = LocalEngine(smollm2_path, max_batch_size=16).start()
    yield engine
    engine.stop()


def make_judge(url, smollm2_path, **kw) -> Judge:
    tokenizer = tokenizer_of(load_tokenizer_or_processor(str(smollm2_path)))
    kw.setdefault("max_new_tokens", 8)
    kw.setdefault("timeout", 30.0)
    return Judge(client_for("local", url, max_retries=0), tokenizer, **kw)


def test_smollm2_judges_through_the_engine_with_retries_cache_and_metrics(judge_engine, smollm2_path):
    answers = []

    def parse(text):  # a user parser: SmolLM2's free text has no "Score:", so score its length
        answers.append(text)
        return float(min(len(text), 10)) if text else None

    async def scenario():
        judge = make_judge(judge_engine.url, smollm2_path, parse=parse)
        stats_a, stats_b = {}, {}
        first = await judge.grade(0, stats_a, prompt="2+2?", response="4", label="4")
        again = await judge.grade(0, stats_b, prompt="2+2?", response="4", label="4")  # the same step: cached
        other = await judge.grade(0, stats_b, prompt="2+2?", response="5", label="4")
        next_step = await judge.grade(1, stats_b, prompt="2+2?", response="4", label="4")
        return first, again, other, next_step, stats_a, stats_b

    first, again, other, next_step, stats_a, stats_b = asyncio.run(scenario())
    assert first.text and first.score == float(min(len(first.text), 10)) and not first.cached
    assert again.cached and again.text == first.text and len(answers) == 3  # 3 engine calls for 4 grades
    assert next_step.text == first.text and not next_step.cached  # greedy: the same verdict, called again
    assert stats_b["calls"] == 3 and stats_b["cache_hits"] == 1 and stats_b["failures"] == 0
    samples = [Sample(index=0, metadata={"judge": stats_a}), Sample(index=1, metadata={"judge": stats_b})]
    metrics = rollout_metrics([samples])
    assert metrics["judge/calls"] == 4 and metrics["judge/cache_hits"] == 1
    assert metrics["judge/cache_hit_rate"] == 0.25 and metrics["judge/seconds_per_call"] > 0


def test_an_unparseable_judge_is_retried_then_a_recorded_failure(judge_engine, smollm2_path):
    answers = []
    judge = make_judge(judge_engine.url, smollm2_path, retries=2, parse=lambda text: answers.append(text))
    stats = {}
    result = asyncio.run(judge.grade(0, stats, prompt="p", response="r", label="l"))
    assert result.score is None and result.attempts == 3 and "no score in the judge's answer" in result.error
    assert stats == {**stats, "calls": 1, "retries": 2, "failures": 1}
    assert len(set(answers)) == 3  # greedy first, then each retry sampled (seeded): not the same answer again
    again = []
    judge = make_judge(judge_engine.url, smollm2_path, retries=2, parse=lambda text: again.append(text))
    asyncio.run(judge.grade(0, {}, prompt="p", response="r", label="l"))
    assert again == answers  # the seeds make the retries reproducible


@pytest.fixture
def silent_server():
    """An HTTP endpoint that accepts connections and never answers."""
    import socket
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    held = []
    stop = threading.Event()

    def accept():
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    server.close()


def test_a_judge_that_never_answers_times_out_each_try(silent_server, smollm2_path):
    judge = make_judge(silent_server, smollm2_path, timeout=0.5, retries=1)
    started = time.perf_counter()
    result = asyncio.run(judge.grade(0, None, prompt="p", response="r", label="l"))
    assert result.score is None and result.attempts == 2
    assert "did not answer within 0.5s" in result.error and 1.0 <= time.perf_counter() - started < 5


def test_a_missing_template_field_is_named(judge_engine, smollm2_path):
    judge = make_judge(judge_engine.url, smollm2_path, template="Grade {response} against {rubric}")
    with pytest.raises(JudgeError, match="needs the field 'rubric'"):
        asyncio.run(judge.grade(0, None, prompt="p", response="r", label="l"))


def test_judge_reward_fails_the_sample_or_gives_the_failure_reward(judge_engine, smollm2_path):
    ctx = argparse.Namespace(judge=make_judge(judge_engine.url, smollm2_path, retries=0, parse=lambda t: None))
    args = argparse.Namespace(rollout_context=ctx, judge_failure_reward=None)
    sample = Sample(index=0, prompt="2+2?", response="4", label="4")
    with pytest.raises(JudgeError, match="no score"):
        asyncio.run(judge_reward(args, sample))
    args.judge_failure_reward = -0.5
    ctx.judge = make_judge(judge_engine.url, smollm2_path, retries=0, parse=lambda t: None)
    assert asyncio.run(judge_reward(args, sample)) == -0.5 and "no score" in sample.metadata["judge_failed"]
    ctx.judge = make_judge(judge_engine.url, smollm2_path, parse=lambda t: 7.0)
    assert asyncio.run(judge_reward(args, sample)) == 0.7


def test_a_multi_turn_episode_whose_observations_are_the_judges_critiques(farm, tiny_paths, judge_engine, smollm2_path):
    critiques = []

    def parse(text):
        critiques.append(text)
        return 3.0  # below the pass score: the episode goes on to --max-turns

    policy = farm.target("q2judge-direct", tiny_paths["qwen2"])
    ctx = make_ctx(policy.url, policy.model_path, max_turns=3, rollout_max_response_len=12)
    sample = Sample(index=0, prompt=[{"role": "user", "content": "Explain rain."}], label="water cycle")
    env = JudgeFeedbackEnv(make_judge(judge_engine.url, smollm2_path, parse=parse), sample, pass_score=9)
    stops = list(range(3, 151643, 4)) + [151645]
    params = {"temperature": 1.0, "sampling_seed": 3, "stop_token_ids": stops, "max_new_tokens": 12}
    asyncio.run(run_episode(ctx, sample, params, env=env))
    sample.validate()
    assert (sample.status, sample.metadata["termination"]) == (Status.COMPLETED, "max_turns")
    assert len(sample.turns) == 3 and len(critiques) >= 2
    for turn, critique in zip(sample.turns[:2], critiques):
        observation = ctx.tokenizer.decode(sample.tokens[turn.output_end : turn.observation_end])
        assert critique.strip() in observation  # the judge's own words, masked (loss mask 0)
        start = turn.output_end - sample.prompt_length
        assert set(sample.loss_mask[start : start + turn.observation_tokens]) == {0}
    assert [t.reward for t in sample.turns] == [0.3, 0.3, 0.3]
    assert sample.metadata["judge"]["calls"] == 3


def judge_args(**given):
    from slime_mt.config import JudgeConfig

    return {**vars(JudgeConfig()), **given}


def test_the_judge_flags_start_an_embedded_judge_or_use_the_policy(farm, tiny_paths, smollm2_path, tmp_path):
    from envs.llm_judge import build_env, judge_of

    policy = farm.target("q2judge-direct", tiny_paths["qwen2"])
    template = tmp_path / "rubric.txt"
    template.write_text("Rate {response} for {prompt}. Score: ")
    ctx = make_ctx(policy.url, policy.model_path)
    vars(ctx.args).update(
        judge_args(judge_model_path=str(smollm2_path), judge_template=str(template), judge_max_new_tokens=16)
    )

    async def embedded():
        judge = await judge_of(ctx)
        assert await judge_of(ctx) is judge and judge.template == template.read_text()
        return judge, await judge.grade(0, None, prompt="p", response="r", label="l")

    judge, result = ctx.run_sync(embedded())
    assert result.text and judge.tokenizer.name_or_path == str(smollm2_path)
    url = judge.client.url
    ctx.close()  # stops the judge's engine with the run
    with pytest.raises(EngineError):  # nothing listens there any more
        asyncio.run(client_for("local", url, max_retries=0).generate([1, 2], {"max_new_tokens": 1}, timeout=2))

    ctx = make_ctx(policy.url, policy.model_path)
    vars(ctx.args).update(judge_args(judge_use_policy=True))
    judge = ctx.run_sync(judge_of(ctx))
    assert judge.client is ctx.client and judge.on_close is None
    ctx.close()
    with pytest.raises(JudgeError, match="does not run on environment workers"):  # args without the context
        asyncio.run(build_env(Sample(index=0), argparse.Namespace(**judge_args())))
    ctx = make_ctx(policy.url, policy.model_path)
    vars(ctx.args).update(judge_args(judge_model_path=str(smollm2_path), judge_template=str(tmp_path / "none.txt")))
    with pytest.raises(JudgeError, match="--judge-template .*none.txt: no such file"):
        ctx.run_sync(judge_of(ctx))
    ctx.close()
