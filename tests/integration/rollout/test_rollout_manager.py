"""The fully-async rollout manager on a real embedded engine: the test plays the trainer (take a
batch, "train", push weights through the update gate in the middle of generation, raise the
version) over a long-tailed workload in which one group's environment is slow. The staleness
bound holds for every trained token; the slow group is dropped and counted, kept with its stale
tokens masked, or (the decoupled loss) trained whole; the throttle holds; no group is trained
twice; a checkpoint's data state draws the untrained groups again."""

import asyncio
import contextlib
import json
import textwrap

import pytest
from rollout_helpers import make_ctx

from slime_mt.config import DataConfig
from slime_mt.data import PromptDataset, load_rows
from slime_mt.engine.clients.update_gate import UpdateGate
from slime_mt.engine.embedded.server import LocalEngine
from slime_mt.rollout.finalize import finalize
from slime_mt.rollout.manager import RolloutManager
from slime_mt.rollout.staleness import mask_stale, oldest_version, staleness_metrics
from slime_mt.safetensors_files import load_hf_state

STOPS = list(range(3, 151643, 4)) + [151645]
DATA_CFG = DataConfig(input_key="prompt", apply_chat_template=True, metadata_key="metadata")
ENV = '''
import asyncio
from envs.base import BaseInteractionEnv


class SlowEnv(BaseInteractionEnv):
    """Three turns; each step sleeps the row's delay (group 0's is long: the tail)."""

    def __init__(self, delay):
        self.delay, self.steps = delay, 0

    async def step(self, response_text):
        await asyncio.sleep(self.delay)
        self.steps += 1
        return {"text": f"go on ({self.steps})"}, self.steps >= 3, {"reward": float(len(response_text) % 2)}


def build_env(sample=None, args=None, **kw):
    return SlowEnv(sample.metadata["delay"])
'''


@pytest.fixture(scope="module")
def engine(tiny_paths):
    with LocalEngine(tiny_paths["qwen2"], max_batch_size=16) as engine:
        yield engine


def workload(engine, tmp_path, delays, **rollout):
    """One prompt per entry of ``delays`` (the seconds each env step of its group takes), groups of
    two, on ``engine`` -> (a fully-async context with an update gate, the dataset)."""
    (tmp_path / "slow_env.py").write_text(textwrap.dedent(ENV))
    rows = tmp_path / "rows.jsonl"
    lines = [json.dumps({"prompt": f"Say something ({i}).", "metadata": {"delay": d}}) for i, d in enumerate(delays)]
    rows.write_text("".join(line + "\n" for line in lines))
    data = PromptDataset(load_rows(rows, DATA_CFG), 2)
    ctx = make_ctx(
        engine.url,
        engine.model_path,
        data=DATA_CFG,
        rollout_max_response_len=12,
        max_turns=3,
        rollout_stop_token_ids=STOPS,
        rollout_interaction_env_path=str(tmp_path / "slow_env.py"),
        n_samples_per_prompt=2,
        fully_async=True,
        **rollout,
    )
    ctx.client.gate = UpdateGate()
    return ctx, data


def run_steps(engine, tmp_path, steps, train_stale=False, **rollout):
    """Play at least ``steps`` training steps, and more until group 0 (the slow one) has left the
    manager -> (batches, manager, data, ctx)."""
    ctx, data = workload(engine, tmp_path, [2.5] + [0.02] * 39, rollout_batch_size=2, **rollout)
    version = int(engine.weight_version)
    weights = load_hf_state(engine.model_path)
    manager = RolloutManager(ctx, data, version=version, train_stale=train_stale)
    manager.start()
    batches, capacity_ok = [], []
    step = version
    while step < version + steps or ctx.run_sync(_holds_group_0(manager)):
        assert step < version + 60, "group 0 never left the manager"
        batch = ctx.run_sync(manager.take(step))
        capacity_ok.append(ctx.run_sync(_admitted_within(manager)))
        batches.append((step, batch))
        ctx.run_sync(ctx.client.gate.close(ctx.client))
        engine.update_weights_from_tensors(weights, weight_version=str(step + 1))
        ctx.run_sync(ctx.client.gate.open(ctx.client))
        ctx.run_sync(manager.set_version(step + 1))
        step += 1
    assert all(capacity_ok)
    return batches, manager, data, ctx


@contextlib.contextmanager
def requests_seen(engine):
    """Every request the engine's scheduler takes, as (input ids, priority) (the scheduler itself
    serves them as before)."""
    seen = []
    submit = engine.scheduler.submit

    def recording(request):
        seen.append((request.input_ids, request.priority))
        return submit(request)

    engine.scheduler.submit = recording
    try:
        yield seen
    finally:
        del engine.scheduler.submit


def priorities_by_group(seen, batches) -> list[tuple[int, set[int]]]:
    """Each request that continues a trained sample's context -> (its priority, the priorities the
    groups it may belong to should give it: minus their start versions)."""
    trained = [s for _, b in batches for g in b.groups for s in g]
    out = []
    for ids, priority in seen:
        owners = {-s.metadata["start_version"] for s in trained if s.tokens[: len(ids)] == ids}
        if owners:
            out.append((priority, owners))
    return out


async def _holds_group_0(manager):
    return any(g[0].group_index == 0 for g in manager.buffer + list(manager.running.values()))


async def _admitted_within(manager):
    return manager.admitted() <= manager.capacity()


@pytest.mark.parametrize("staleness", [0, 1])
def test_no_trained_token_is_staler_than_the_bound_and_the_slow_group_is_dropped(engine, tmp_path, staleness):
    with requests_seen(engine) as seen:
        batches, manager, data, ctx = run_steps(engine, tmp_path, 5, max_staleness=staleness)
    try:
        assert seen and all(priority is None for _, priority in seen)  # without --oldest-groups-first: none
        trained = [g[0].group_index for _, b in batches for g in b.groups]
        assert len(trained) == len(set(trained)) == 2 * len(batches)  # each step took two groups, none twice
        for step, batch in batches:
            samples, _ = finalize([s for g in batch.groups for s in g], "concat", merge=False)
            metrics = staleness_metrics(samples, step)
            assert metrics["rollout/token_version_gap_max"] <= staleness
            for group in batch.groups:
                assert step - oldest_version(group) <= staleness
        dropped = sum(b.dropped_groups for _, b in batches)
        if staleness == 1:  # group 0 started under version 0 and finished after later groups were trained
            assert 0 not in trained and dropped >= 1
        assert sum(len(b.filtered) for _, b in batches) == 0
        assert all(b.trainer_wait_seconds >= 0 and b.rollout_idle_seconds >= 0 for _, b in batches)
        # a checkpoint now: the groups drawn and not trained are drawn first by a resumed run
        pending = sorted(g[0].group_index for g in ctx.run_sync(manager.pending()))
        resumed = PromptDataset(data.rows, data.n)
        resumed.load_state_dict(ctx.run_sync(manager.data_state()))
        again = [g[0].group_index for g in resumed.get_samples(len(pending))]
        assert again == pending and not set(again) & set(trained)
        fresh = resumed.get_samples(1)[0][0]
        assert fresh.group_index == data.next_group and fresh.metadata["row"] == data._order[data.cursor]
    finally:
        ctx.run_sync(manager.stop())


def test_with_masking_the_slow_group_trains_without_its_stale_tokens(engine, tmp_path):
    batches, manager, _, ctx = run_steps(
        engine, tmp_path, 5, max_staleness=1, partial_rollout=True, mask_offpolicy_in_partial_rollout=True
    )
    try:
        stale = [(step, g) for step, b in batches for g in b.groups if step - oldest_version(g) > 1]
        assert stale and sum(b.stale_groups for _, b in batches) == len(stale)
        assert sum(b.dropped_groups for _, b in batches) == 0
        step, group = stale[0]
        samples, _ = finalize(group, "step_wise", merge=False)
        masked = mask_stale(samples, step, 1)
        assert masked > 0
        assert staleness_metrics(samples, step).get("rollout/token_version_gap_max", 0) <= 1
    finally:
        ctx.run_sync(manager.stop())


def test_with_the_decoupled_loss_the_slow_group_is_trained_whole(engine, tmp_path):
    """--use-decoupled-loss: the slow group, beyond the bound when it finishes, is trained with every
    token it generated (nothing dropped, nothing masked), each token keeping its own version; the
    throttle still bounds what starts, and the step's waste metrics say nothing was lost. With
    --oldest-groups-first each engine request carries its group's start version as its priority."""
    from slime_mt.rollout.staleness import waste_metrics

    with requests_seen(engine) as seen:
        batches, manager, _, ctx = run_steps(
            engine, tmp_path, 5, train_stale=True, max_staleness=1, partial_rollout=True, oldest_groups_first=True
        )
    try:
        # --oldest-groups-first: every turn of a group, resumed ones too, asks for its group's start version
        ranked = priorities_by_group(seen, batches)
        assert all(priority in owners for priority, owners in ranked)
        first = batches[0][0]  # the version the manager started from (the module's engine has moved on)
        assert {priority for priority, _ in ranked} >= {-first, -first - 1, -first - 2}
        trained = [g[0].group_index for _, b in batches for g in b.groups]
        assert 0 in trained and len(trained) == len(set(trained)) == 2 * len(batches)
        assert sum(b.dropped_groups for _, b in batches) == 0
        stale = [(step, g) for step, b in batches for g in b.groups if step - oldest_version(g) > 1]
        assert any(g[0].group_index == 0 for _, g in stale)
        assert sum(b.stale_groups for _, b in batches) == len(stale)
        step, group = next((step, g) for step, g in stale if g[0].group_index == 0)
        samples, _ = finalize(group, "concat", merge=False)
        gaps = staleness_metrics(samples, step)
        assert gaps["rollout/token_version_gap_max"] > 1  # trained as generated, by its own versions
        assert all(m == 1 for s in samples for v, m in zip(s.token_versions, s.loss_mask) if v >= 0)
        batch = next(b for k, b in batches if k == step)
        metrics = waste_metrics(batch.groups, batch.dropped, batch.filtered)
        assert metrics["async/trained_token_share"] == 1.0 and metrics["async/dropped_token_share"] == 0.0
        assert metrics["async/length_bias_tokens"] == 1.0 and metrics["async/length_distance_tokens"] == 0.0
    finally:
        ctx.run_sync(manager.stop())


@pytest.mark.parametrize("budget", [None, 1])
def test_the_token_throttle_holds_back_new_groups_while_the_running_ones_hold_the_budget(engine, tmp_path, budget):
    """--max-tokens-in-flight 1: any trajectory in flight holds more than one token, so a group starts
    only when none runs; without it the group throttle alone lets several run at once (the test could
    fail). Steps still take their groups."""
    ctx, data = workload(engine, tmp_path, [0.05] * 12, rollout_batch_size=2, max_tokens_in_flight=budget)
    manager = RolloutManager(ctx, data, version=int(engine.weight_version))
    most = []

    async def watch():
        while True:
            most.append(len(manager.running))
            await asyncio.sleep(0.002)

    watcher = ctx.run_sync(_spawn(watch()))
    manager.start()
    try:
        for _ in range(2):
            assert len(ctx.run_sync(manager.take(manager.version)).groups) == 2
        assert max(most) == 1 if budget == 1 else max(most) > 1
    finally:
        watcher.cancel()
        ctx.run_sync(manager.stop())


async def _spawn(coro):
    return asyncio.get_running_loop().create_task(coro)


def test_dynamic_sampling_keeps_working_in_fully_async_mode(engine, tmp_path):
    """A filter that keeps even groups only: every trained group is even, the rejected ones are counted
    and do not count against the throttle (over-sampling widens it), the bound still holds."""
    (tmp_path / "even.py").write_text("def keep(args, samples):\n    return samples[0].group_index % 2 == 0\n")
    batches, manager, _, ctx = run_steps(
        engine,
        tmp_path,
        4,
        max_staleness=1,
        dynamic_sampling_filter_path=f"{tmp_path / 'even.py'}:keep",
        over_sampling_batch_size=4,
    )
    try:
        trained = [g[0].group_index for _, b in batches for g in b.groups]
        assert trained and all(k % 2 == 0 for k in trained) and len(trained) == len(set(trained))
        assert sum(len(b.filtered) for _, b in batches) >= len(trained) - 2
        assert manager.extra == 2
        for step, batch in batches:
            assert all(step - oldest_version(g) <= 1 for g in batch.groups)
    finally:
        ctx.run_sync(manager.stop())


HELD = """
import asyncio
import collections

from rollouts.multi_turn import generate as multi_turn_generate

released = {}  # group index -> asyncio.Event: the group's samples return once it is set
generated = collections.Counter()  # group index -> samples that finished generating


async def generate(args, sample, sampling_params):
    done = await multi_turn_generate(args, sample, sampling_params)
    generated[sample.group_index] += 1
    await released.setdefault(sample.group_index, asyncio.Event()).wait()
    return done
"""


def test_a_dropped_groups_slot_is_filled_at_once_and_the_drop_is_measured(engine, tmp_path):
    """B=1, S=1. Group 0 generates under version 0 and is held back until version 2; group 3 is held
    too, so when the step at version 2 drops group 0 nothing else can wake the generation task: the
    freed slot must start group 4 at once, while the step still waits. The step's metrics then say
    what the drop removed (group 0's turns and generated tokens against the trained ones)."""
    from slime_mt.plugins import load_module
    from slime_mt.rollout.staleness import waste_metrics

    (tmp_path / "held.py").write_text(HELD)
    held = load_module(str(tmp_path / "held.py"))
    ctx, data = workload(
        engine,
        tmp_path,
        [0.01] * 8,
        custom_generate_function_path=f"{tmp_path / 'held.py'}:generate",
        rollout_batch_size=1,
        max_staleness=1,
    )
    weights = load_hf_state(engine.model_path)
    start = int(engine.weight_version)
    manager = RolloutManager(ctx, data, version=start)

    async def release(k):
        held.released.setdefault(k, asyncio.Event()).set()

    async def wait_for(predicate, what, seconds=20.0):
        deadline = asyncio.get_running_loop().time() + seconds
        while not predicate():
            assert asyncio.get_running_loop().time() < deadline, what
            await asyncio.sleep(0.01)

    def new_version(version):
        ctx.run_sync(ctx.client.gate.close(ctx.client))
        engine.update_weights_from_tensors(weights, weight_version=str(version))
        ctx.run_sync(ctx.client.gate.open(ctx.client))
        ctx.run_sync(manager.set_version(version))

    manager.start()
    try:
        ctx.run_sync(wait_for(lambda: held.generated[0] == 2, "group 0 never finished generating"))
        ctx.run_sync(release(1))
        assert [g[0].group_index for g in ctx.run_sync(manager.take(start)).groups] == [1]
        new_version(start + 1)
        ctx.run_sync(release(2))
        assert [g[0].group_index for g in ctx.run_sync(manager.take(start + 1)).groups] == [2]
        new_version(start + 2)
        ctx.run_sync(wait_for(lambda: 3 in manager.running, "group 3 never started"))
        ctx.run_sync(release(0))  # generated under the first version: two behind the next step

        async def step_at_version_2():
            take = asyncio.ensure_future(manager.take(start + 2))
            await wait_for(lambda: 4 in manager.running or take.done(), "the freed slot stayed empty", 5.0)
            assert not take.done() and 3 in manager.running  # only the drop could have started group 4
            await release(3)  # group 4 stays held: the step takes the first group that finishes
            return await take

        batch = ctx.run_sync(step_at_version_2())
        assert [g[0].group_index for g in batch.groups] == [3] and batch.dropped_groups == 1
        (lost,) = batch.dropped
        assert lost[0].group_index == 0 and all(s.metadata["dropped_stale"] for s in lost)
        metrics = waste_metrics(batch.groups, batch.dropped)
        lost_tokens = sum(sum(s.loss_mask) for s in lost)
        kept_tokens = sum(sum(s.loss_mask) for g in batch.groups for s in g)
        assert metrics["async/dropped_token_share"] == lost_tokens / (lost_tokens + kept_tokens)
        assert metrics["async/dropped_turns_mean"] == sum(len(s.turns) for s in lost) / 2
        assert metrics["async/dropped_generated_tokens_mean"] == lost_tokens / 2
        assert metrics["async/trained_generated_tokens_mean"] == kept_tokens / 2
        assert metrics["async/trained_token_share"] == kept_tokens / (lost_tokens + kept_tokens)
        assert metrics["async/generated_tokens"] == lost_tokens + kept_tokens
        assert metrics["async/generated_generated_tokens_mean"] == (lost_tokens + kept_tokens) / 4
        assert metrics["async/length_bias_tokens"] == pytest.approx(2 * kept_tokens / (lost_tokens + kept_tokens))
        assert manager.admitted() <= manager.capacity()
    finally:
        ctx.run_sync(manager.stop())
