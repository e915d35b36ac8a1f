"""The gateway in front of every engine kind: several embedded engines behind sglang-router (a
session's calls stay on one worker) and a real vLLM server."""

import tempfile
from pathlib import Path

import pytest
from gateway_helpers import Harness, openai

from slime_mt.rollout.finalize import finalize


def _conversation(harness, calls: int = 4, index: int = 0, max_tokens: int = 8):
    session, base_url = harness.open(index=index)
    client = openai.OpenAI(base_url=base_url, api_key="EMPTY", max_retries=0)
    messages = [{"role": "user", "content": "Count with me."}]
    answers = []
    for k in range(calls):
        answer = client.chat.completions.create(
            model="m", messages=messages, max_tokens=max_tokens, extra_body={"return_token_ids": True}
        )
        answers.append(answer)
        messages += [answer.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": f"{k}"}]
    harness.close(session)
    return session, answers


@pytest.fixture(scope="module")
def routed(tiny_paths):
    from slime_mt.engine.embedded.server import LocalEngine
    from slime_mt.engine.launch import Router

    engines = [LocalEngine(tiny_paths["qwen2"], max_batch_size=8, seed=i).start() for i in range(2)]
    router = Router(Path(tempfile.mkdtemp(prefix="slime-mt-router-")), policy="manual")
    for engine in engines:
        router.add_worker(engine.url)
    harness = Harness(tiny_paths["qwen2"], router.url, [], [e.url for e in engines])
    yield harness, engines
    harness.stop()
    router.stop()
    for engine in engines:
        engine.stop()


def test_behind_sglang_router_a_sessions_calls_stay_on_one_worker(routed):
    harness, engines = routed
    for index in range(4):
        before = [e.scheduler.finished_requests for e in engines]
        session, answers = _conversation(harness, index=index)
        served = [e.scheduler.finished_requests - b for e, b in zip(engines, before)]
        assert sorted(served) == [0, 4], served
        sample = session.sample
        sample.validate()
        assert [t.context_ids for t in sample.turns] == [None] * 4
        assert answers[-1].prompt_token_ids == sample.tokens[: sample.turns[-1].output_start]


def test_in_front_of_vllm(vllm_target, monkeypatch):
    harness = Harness(vllm_target.model_path, vllm_target.url, ["--engine", "vllm"])
    try:
        session, answers = _conversation(harness, calls=3)
    finally:
        harness.stop()
    sample = session.sample
    sample.validate()
    assert [t.context_ids for t in sample.turns] == [None] * 3  # exact ids through vLLM's token endpoint
    for answer, turn in zip(answers, sample.turns):
        assert answer.prompt_token_ids == sample.tokens[: turn.output_start]
        assert answer.choices[0].token_ids == sample.tokens[turn.output_start : turn.output_end]
    sample.reward = 1.0
    merged, _ = finalize([sample], "step_wise", merge=True)
    assert len(merged) == 1 and merged[0].prompt_ids + merged[0].response_ids == sample.tokens
