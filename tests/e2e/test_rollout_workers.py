"""Rollout processes (``--rollout-num-processes``) on the session's Ray cluster of loopback nodes,
against a real embedded engine: the rollout side draws the groups and two ``RolloutWorker`` processes
run them. A group comes back whole and once, equal to the same group run in the rollout side's own
process; a process killed mid-group is restarted and its groups run again from their copies; a weight
update holds every process (their aborted turns are the update's and are generated again)."""

import dataclasses
import json
import time

import pytest
import ray

from slime_mt.config import Config
from slime_mt.data import PromptDataset, load_rows
from slime_mt.engine.clients.update_gate import DRAIN_SECONDS, UpdateGate
from slime_mt.engine.embedded.server import LocalEngine
from slime_mt.rollout.context import RolloutContext
from slime_mt.rollout.group_rollout import rollout_groups
from slime_mt.rollout.rollout_workers import RolloutWorkerPool
from slime_mt.types import Status

STOPS = list(range(3, 151643, 4)) + [151645]  # a turn ends within a few tokens: the episodes take turns
ENV = '''
import time

from envs.base import BaseInteractionEnv


class Echo(BaseInteractionEnv):
    """Three turns; each step takes the row's delay (a blocking environment, as users write them)."""

    def __init__(self, delay):
        self.delay, self.steps = delay, 0

    def step(self, response_text):
        time.sleep(self.delay)
        self.steps += 1
        return {"text": f"go on ({self.steps})"}, self.steps >= 3, {"reward": float(len(response_text) % 2)}


def build_env(sample=None, args=None, **kw):
    return Echo(sample.metadata["delay"])
'''


@pytest.fixture(scope="module")
def engine(tiny_paths):
    with LocalEngine(tiny_paths["qwen2"], max_batch_size=16) as engine:
        yield engine


def config(engine, tmp_path, three_nodes, processes: int, **rollout) -> Config:
    (tmp_path / "echo_env.py").write_text(ENV)
    cfg = Config()
    cfg.train.hf_checkpoint = str(engine.model_path)
    cfg.train.seed = 7
    cfg.data = dataclasses.replace(cfg.data, input_key="prompt", apply_chat_template=True, metadata_key="metadata")
    cfg.cluster.ray_address = three_nodes.address
    cfg.rollout = dataclasses.replace(
        cfg.rollout,
        rollout_max_response_len=16,
        rollout_stop_token_ids=STOPS,
        max_turns=3,
        n_samples_per_prompt=2,
        rollout_interaction_env_path=str(tmp_path / "echo_env.py"),
        rollout_num_processes=processes,
        rollout_process_num_cpus=0.5,
        **rollout,
    )
    return cfg


def dataset(tmp_path, cfg, delays) -> PromptDataset:
    rows = tmp_path / "rows.jsonl"
    lines = [json.dumps({"prompt": f"Say something ({i}).", "metadata": {"delay": d}}) for i, d in enumerate(delays)]
    rows.write_text("".join(line + "\n" for line in lines))
    return PromptDataset(load_rows(rows, cfg.data), cfg.rollout.n_samples_per_prompt)


def side_ctx(cfg, engine, drain_seconds: float = DRAIN_SECONDS) -> RolloutContext:
    """The rollout role's context as ``RolloutRole.start`` makes it: its gate (waiting at most
    ``drain_seconds`` for what the engines abort to come back), and the processes when
    ``--rollout-num-processes`` > 1 (their gates its followers)."""
    ctx = RolloutContext.create(cfg, cfg.train.hf_checkpoint, engine.url)
    ctx.client.gate = UpdateGate(drain_seconds)
    if cfg.rollout.rollout_num_processes > 1:
        ctx.rollout_workers = RolloutWorkerPool(cfg, engine.url, None)
        ctx.client.gate.followers = ctx.rollout_workers
    return ctx


def running(ctx, data, until, seconds: float = 60.0):
    """Start the rollout of ``data`` on the rollout side's loop and wait (at most ``seconds``) until
    ``until()`` holds while it runs -> its future."""
    future = ctx.submit(rollout_groups(ctx, data, rollout_id=0))
    deadline = time.monotonic() + seconds
    while not until():
        assert time.monotonic() < deadline and not future.done()
        time.sleep(0.02)
    return future


def tokens_of(groups) -> dict:
    return {s.index: (s.group_index, s.tokens, s.loss_mask, s.reward, s.weight_versions) for g in groups for s in g}


def log_probs_of(groups) -> dict:
    return {s.index: s.rollout_log_probs for g in groups for s in g}


def test_groups_run_in_two_processes_come_back_once_and_equal_the_in_process_run(engine, tmp_path, three_nodes):
    """Sampling is seeded per turn, so which process ran a group does not change it: the same tokens,
    masks, rewards and versions as the rollout side's own process, and the same log-probs (to the
    engine's batch noise: which requests share a decode step differs run to run, in one process as
    well); the processes are on both nodes; each group is drawn once and the data cursor is the
    rollout side's."""
    results, log_probs, cursors = {}, {}, {}
    for processes in (1, 2):
        cfg = config(engine, tmp_path, three_nodes, processes, rollout_batch_size=6, rollout_concurrency=4)
        data = dataset(tmp_path, cfg, [0.0] * 12)
        ctx = side_ctx(cfg, engine)
        try:
            if processes == 2:
                where = ctx.rollout_workers.where
                assert len({w["node_id"] for w in where}) == 2
            groups = ctx.run_sync(rollout_groups(ctx, data, rollout_id=0))
        finally:
            ctx.close()
        assert sorted(g[0].group_index for g in groups) == list(range(6))
        assert all(s.status != Status.FAILED for g in groups for s in g)
        assert sum(len(s.turns) == 3 for g in groups for s in g) >= 6  # multi-turn episodes, mostly
        results[processes], cursors[processes] = tokens_of(groups), data.state_dict()
        log_probs[processes] = log_probs_of(groups)
    assert results[2] == results[1]
    for index, expected in log_probs[1].items():
        assert log_probs[2][index] == pytest.approx(expected, abs=1e-5)
    assert cursors[2] == cursors[1]


def test_a_process_killed_mid_group_is_restarted_and_its_groups_run_again(engine, tmp_path, three_nodes):
    cfg = config(engine, tmp_path, three_nodes, 2, rollout_batch_size=4, rollout_concurrency=8)
    data = dataset(tmp_path, cfg, [0.3] * 8)
    ctx = side_ctx(cfg, engine)
    try:
        pool = ctx.rollout_workers
        future = running(ctx, data, lambda: pool.load[0] > 0)  # a group is running in process 0
        time.sleep(0.5)  # mid-group: its environments are stepping
        victim = pool.where[0]["pid"]
        ray.kill(pool.workers[0], no_restart=False)
        groups = future.result(timeout=300)
        deadline = time.monotonic() + 120
        while pool.down:  # Ray starts it again; the pool gives it groups once it answers
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert ray.get(pool.workers[0].where.remote(), timeout=60)["pid"] != victim
        assert pool.take_restarts() == 1  # counted once, however many of its groups failed
    finally:
        ctx.close()
    assert sorted(g[0].group_index for g in groups) == [0, 1, 2, 3]  # each once, none lost
    assert all(s.status != Status.FAILED and s.turns for g in groups for s in g)


def test_a_weight_update_holds_every_process_and_their_aborted_turns_are_the_updates(engine, tmp_path, three_nodes):
    """The rollout side's gate closes in the middle of the processes' generation: each process's gate
    is held, the engine pauses and aborts what runs, nothing is sent until it opens; a request that was
    on its way when the engine paused waits at its admission (as SGLang's does) and generates nothing;
    the turns the update aborted are generated again (counted as the update's, not as engine aborts)
    and no sample fails."""
    cfg = config(engine, tmp_path, three_nodes, 2, rollout_batch_size=6, rollout_concurrency=12)
    # turns long enough to be running when the gate closes, however loaded the machine (at 48 tokens a
    # CI run once saw every request finish between the check and the pause: nothing for the update to abort)
    cfg.rollout = dataclasses.replace(cfg.rollout, rollout_max_response_len=192, rollout_stop_token_ids=None)
    data = dataset(tmp_path, cfg, [0.0] * 6)
    ctx = side_ctx(cfg, engine)
    try:
        pool = ctx.rollout_workers
        out = lambda: ctx.client.gate.out + ctx.run_sync(pool.out())  # requests sent and not back
        future = running(ctx, data, lambda: engine.scheduler.load()["#running_req"] >= 4)
        ctx.run_sync(ctx.client.gate.close(ctx.client))
        # the gate's drain (1 s, a run's guard against a stuck engine) may end before the aborted answers
        # cross the processes on a loaded machine: wait for them; what stays out is held at admission
        deadline = time.monotonic() + 60
        while out() != engine.held_at_admission:
            assert time.monotonic() < deadline, (out(), engine.held_at_admission)
            time.sleep(0.05)
        held = engine.scheduler.load()
        assert held["#running_req"] == held["#queue_req"] == 0  # every admitted request was aborted
        waiting = engine.held_at_admission
        time.sleep(0.5)
        assert out() == engine.held_at_admission == waiting  # none left a process while the gate was closed
        now = engine.scheduler.load()
        assert now["#running_req"] == now["#queue_req"] == 0
        assert now["generated_tokens"] == held["generated_tokens"]
        ctx.run_sync(ctx.client.gate.open(ctx.client))
        groups = future.result(timeout=300)
        assert engine.held_at_admission == 0
    finally:
        ctx.close()
    samples = [s for g in groups for s in g]
    assert all(s.status != Status.FAILED for s in samples)
    assert sum(s.metadata.get("regenerated_turns", 0) for s in samples) >= 1
    assert sum(s.metadata.get("engine_aborts", 0) for s in samples) == 0
