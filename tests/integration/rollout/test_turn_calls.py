"""One turn, several engine calls: how a turn is put together when an engine aborts it.

A chain model (the tiny Qwen3 made to emit a fixed sentence token by token, round and round,
``chain_model``) gives every call a known output, whichever token the abort lands on. An abort that no weight update
caused (an operator's ``/abort_request``) is made again within the engine retry budget, resumed
from the turn's tokens with ``--partial-rollout``, and fails the sample past the budget; a turn of
several calls ends at the first stop string of its joined output and its text is the decode of all
its ids. The engine reports SGLang's ``"default"`` version (launched without ``--weight-version``),
which a run reads as its starting version."""

import asyncio

import pytest
from rollout_helpers import chain_model, make_ctx
from transformers import AutoTokenizer

from slime_mt.algo.advantages import compute_advantages
from slime_mt.assets import qwen3_reference_tokenizer_dir
from slime_mt.engine.clients.sglang import EngineClient
from slime_mt.engine.embedded.server import LocalEngine
from slime_mt.rollout.finalize import finalize
from slime_mt.rollout.multi_turn import generate_turn, run_episode
from slime_mt.rollout.staleness import staleness_metrics
from slime_mt.types import Sample, Status

SENTENCE = (
    "Quick brown foxes jump over lazy dogs while seven wizards quietly mix potent elixirs; the answer "
    "sits boxed near ancient marble columns beneath golden autumn leaves, far beyond every mountain "
    "river valley town, where old sailors sing of distant harbors and crimson sunsets over quiet bays"
)
START_VERSION = 3  # the run's starting version: what an engine's "default" means
BUDGET = 400  # tokens of a turn: a call runs long after an abort lands in it


@pytest.fixture(scope="module")
def reference():
    return AutoTokenizer.from_pretrained(str(qwen3_reference_tokenizer_dir()))


@pytest.fixture(scope="module")
def chain(reference):
    """The sentence's token ids, each once (the chain model emits them in order, then from the start)."""
    ids = list(dict.fromkeys(reference.encode(SENTENCE, add_special_tokens=False)))
    assert 50 <= len(ids) <= 63, len(ids)
    return ids


@pytest.fixture(scope="module")
def engine(tiny_paths, tmp_path_factory, chain):
    transitions = {a: [b] for a, b in zip(chain, chain[1:] + chain[:1])}
    path = chain_model(
        tiny_paths["qwen3"], tmp_path_factory.mktemp("chain"), qwen3_reference_tokenizer_dir(), transitions
    )
    with LocalEngine(path, max_batch_size=8, weight_version="default") as engine:
        yield engine


def running(engine):
    """The request the engine decodes now (these tests run one at a time), or None."""
    seqs = engine.scheduler._batch.seqs
    return seqs[0] if seqs else None


async def operator_aborts(engine, times: int, after: int = 6, seconds: float = 60.0):
    """An operator's ``/abort_request`` (abort-all), ``times`` times, each once a new request runs
    with ``after`` tokens (the requests are 400 tokens long: the abort lands long before their end)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    aborted = []
    async with EngineClient(engine.url) as client:
        while len(aborted) < times:
            assert loop.time() < deadline, f"{len(aborted)} of {times} aborts landed"
            seq = running(engine)
            if seq is not None and all(seq is not a for a in aborted) and len(seq.output_ids) >= after:
                await client.abort(abort_all=True)
                aborted.append(seq)
            await asyncio.sleep(0.001)


def turn(engine, chain, aborts, stop=None, **rollout):
    """One turn from the chain's first token, ``aborts`` operator aborts landing in it -> (ctx,
    sample, (ids, log-probs, versions, text, meta)) or the exception it raised."""
    ctx = make_ctx(engine.url, engine.model_path, **rollout)
    ctx.start_version = START_VERSION
    sample = Sample(index=0, group_index=0)
    params = {"temperature": 0.0, "max_new_tokens": BUDGET, "no_stop_trim": True, **({"stop": [stop]} if stop else {})}

    async def go():
        call = asyncio.ensure_future(generate_turn(ctx, sample, chain[:1], params, None))
        await operator_aborts(engine, aborts)
        try:
            return await call
        except Exception as e:
            return e

    return ctx, sample, asyncio.run(go())


# ---------------------------------------------------------------- joined output, exact tokens


# ---------------------------------------------------------------- aborts no weight update caused


def output(chain, n=BUDGET):
    """What the chain model generates from the chain's first token."""
    return [chain[(i + 1) % len(chain)] for i in range(n)]


def test_an_abort_without_partial_rollout_generates_the_turn_again(engine, chain):
    ctx, sample, (ids, logprobs, versions, _, meta) = turn(engine, chain, aborts=1)
    first, second = ctx.client.calls
    assert first["response"]["meta_info"]["finish_reason"]["type"] == "abort" and first["response"]["output_ids"]
    assert second["input_ids"] == first["input_ids"] == chain[:1]  # from the turn's context, nothing kept
    assert ids == output(chain) and meta["finish_reason"] == {"type": "length", "length": BUDGET}
    assert sample.metadata["engine_aborts"] == 1 and "regenerated_turns" not in sample.metadata
    assert versions == [START_VERSION] * len(ids) and len(logprobs) == len(ids)


def test_an_abort_with_partial_rollout_continues_from_the_turns_tokens(engine, chain):
    ctx, sample, (ids, logprobs, versions, text, meta) = turn(
        engine, chain, aborts=1, fully_async=True, partial_rollout=True
    )
    first, second = ctx.client.calls
    kept = first["response"]["output_ids"]
    assert 6 <= len(kept) < BUDGET
    assert second["input_ids"] == chain[:1] + kept and second["sampling_params"]["max_new_tokens"] == BUDGET - len(kept)
    assert ids == kept + second["response"]["output_ids"] == output(chain)
    engine_logprobs = [lp for c in (first, second) for lp, *_ in c["response"]["meta_info"]["output_token_logprobs"]]
    assert logprobs == engine_logprobs
    assert text == ctx.tokenizer.decode(ids) and meta["finish_reason"] == {"type": "length", "length": BUDGET}
    assert sample.metadata["engine_aborts"] == 1 and "partial_resumes" not in sample.metadata


def test_a_stop_string_across_the_resume_point_ends_the_turn_there(engine, chain, reference):
    """The stop string spans tokens 4..44 of the output: neither call's engine can see that one
    whole (the abort lands after token 6): the second call stops at its next turn of the chain,
    the joined output at the first."""
    stop = reference.decode(chain[4:45])
    ctx, sample, (ids, _, _, text, meta) = turn(
        engine, chain, aborts=1, stop=stop, fully_async=True, partial_rollout=True
    )
    first, second = ctx.client.calls
    kept = len(first["response"]["output_ids"])
    assert 6 <= kept < 44
    assert second["response"]["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert kept + len(second["response"]["output_ids"]) == len(chain) + 44  # the stop's second occurrence
    assert ids == chain[1:45]  # the first prefix of the output that holds the stop string
    assert meta["finish_reason"] == {"type": "stop", "matched": stop}
    assert text == reference.decode(chain[1:45]) and text.endswith(stop)


def test_aborts_beyond_the_retry_budget_fail_the_sample_and_it_is_never_trained(engine, chain):
    ctx = make_ctx(engine.url, engine.model_path, max_turns=1, rollout_max_response_len=BUDGET)
    ctx.start_version = START_VERSION
    samples = [Sample(index=k, group_index=0, prompt="Go on.", metadata={"rollout_id": 0}) for k in range(3)]
    retries = ctx.client.max_retries

    async def go():
        aborted = asyncio.ensure_future(run_episode(ctx, samples[0], {"temperature": 0.0}))
        await operator_aborts(engine, retries + 1, after=2)
        await aborted
        await asyncio.gather(*(run_episode(ctx, s, {"temperature": 1.0}) for s in samples[1:]))

    asyncio.run(go())
    failed, *fine = samples
    assert failed.status == Status.FAILED and failed.metadata["engine_aborts"] == retries + 1
    assert "aborted turn 0 4 times, no weight update among them" in failed.metadata["error"]
    assert all(s.status != Status.FAILED for s in fine)
    for s, reward in zip(samples, (0.0, 1.0, 0.0)):
        s.reward = reward
    train, _ = finalize(samples, "concat", merge=False)
    assert sum(train[0].loss_mask) == 0 and all(sum(t.loss_mask) > 0 for t in train[1:])
    advantages = compute_advantages(train, "grpo")
    assert advantages[0] == 0.0 and advantages[1] == -advantages[2] != 0.0  # the group of the other two


# ---------------------------------------------------------------- SGLang's "default" version


def test_an_engines_default_version_is_the_runs_starting_version(engine):
    ctx = make_ctx(engine.url, engine.model_path, max_turns=1, rollout_max_response_len=30)
    ctx.start_version = START_VERSION
    sample = Sample(index=0, group_index=0, prompt="Go on.")
    asyncio.run(run_episode(ctx, sample, {"temperature": 1.0}))
    assert ctx.client.calls[0]["response"]["meta_info"]["weight_version"] == "default"
    assert sample.token_versions == [START_VERSION] * sample.response_length
    assert sample.turns[0].weight_version == str(START_VERSION) and sample.weight_versions == ["3"]
    (train,), _ = finalize([sample], "concat", merge=False)
    metrics = staleness_metrics([train], START_VERSION + 1)
    assert metrics["rollout/token_version_gap_max"] == 1.0 and metrics["rollout/version_gap_tokens/1"] == 1.0
