"""The rollout role as the rank that hosts it sees it (slime_mt/roles/link.py), in a world of one rank, on
a train-only run's real rollout role (``ReplayRole``: saved dumps, a real metrics log): the step's share
is its batch as dumped, the step's log line holds the rollout's, the train step's and the driver's
figures, and a user's mistake in the rollout ends the step as itself.
Unit tier, milliseconds (no process group: one rank sends itself its share; the scatter to other
ranks runs in tests/integration/test_rank_shares.py, the whole driver in tests/e2e/test_launchers.py)."""

import functools

import pytest

from slime_mt.algo.batching import split_by_dp
from slime_mt.backends.megatron.parallel import ParallelInfo
from slime_mt.config import Config, DebugConfig, RolloutConfig, TrainConfig
from slime_mt.config.checkpoint import dump_path
from slime_mt.errors import DumpError
from slime_mt.inspection.dumps import save_dump, settings_of
from slime_mt.metrics import read_metrics
from slime_mt.roles.link import RolloutHost
from slime_mt.roles.replay import ReplayRole
from slime_mt.roles.steps import StepTimes
from slime_mt.rollout.finalize import finalize
from slime_mt.types import Sample, Status, TrainBatch

ONE_RANK = ParallelInfo(rank=0, world_size=1, tp_rank=0, tp_size=1, dp_rank=0, dp_size=1)


def _sample(index: int, group: int) -> Sample:
    s = Sample(index=index, group_index=group, prompt="p")
    s.set_prompt_tokens([1, 2, 3])
    s.append_turn([10, 11], [-0.1, -0.2], weight_version="0")
    s.append_observation([20, 21])
    s.append_turn([12], [-0.3], weight_version="0")
    s.status, s.reward = Status.COMPLETED, float(index % 2)
    return s


def _hosted(tmp_path, steps_dumped: int) -> RolloutHost:
    template = str(tmp_path / "dumps" / "rollout_{rollout_id}.pt")
    cfg = Config(
        train=TrainConfig(global_batch_size=4),  # 2 prompts of 2 samples a step
        rollout=RolloutConfig(n_samples_per_prompt=2),
        debug=DebugConfig(load_debug_rollout_data=template, debug_train_only=True),
    )
    for step in range(steps_dumped):
        groups = [[_sample(2 * g, g), _sample(2 * g + 1, g)] for g in range(2)]
        sequences, _ = finalize([s for g in groups for s in g], "concat", False)
        batch = TrainBatch(
            sequences, [0.5, -0.5, 0.25, -0.25], {}, {"rollout/reward_mean": 0.5}, 1.5, 100.0, {}, [0, 1], ""
        )
        save_dump(dump_path(template, step), step, groups, batch, settings_of(cfg))
    split = functools.partial(split_by_dp, dp_size=1, loss_reduction="token_mean")
    rollout = RolloutHost(ReplayRole(cfg, tmp_path), ONE_RANK, split)
    rollout.begin(0)
    return rollout


def test_the_host_sends_itself_the_dumped_batch_and_logs_every_part_of_the_step(tmp_path):
    rollout = _hosted(tmp_path, steps_dumped=1)
    share = rollout.next_share(0)
    assert share.trainable and share.indices == [0, 1, 2, 3]
    assert [list(s.tokens) for s in share.samples] == [[1, 2, 3, 10, 11, 20, 21, 12]] * 4
    assert share.advantages == [0.5, -0.5, 0.25, -0.25]
    assert rollout.drain() == 0.0 and rollout.stop_after(True) is True and rollout.data_state() == {}
    rollout.push_weights(iter([("w", 1.0), ("v", 2.0)]), 1)  # a train-only run's engines: none; drained
    times = StepTimes(0.0, {"train/seconds": 2.0, "train/loss": 0.125}, 10.0, 12.0, 0.5, 0.25, {"colocate/x": 3.0})
    rollout.log_step(0, times, trace=[])
    rollout.close()
    (row,) = read_metrics(tmp_path)
    assert row["step"] == 0 and row["trained_groups"] == [0, 1]
    assert row["rollout/reward_mean"] == 0.5 and row["train/loss"] == 0.125 and row["colocate/x"] == 3.0
    assert row["rollout/weight_version"] == 1.0 and row["time/train_seconds"] == 2.0
    assert row["time/sync_seconds"] == 0.5 and row["time/trainer_idle_seconds"] == 0.25
    assert row["time/rollout_seconds"] == 1.5 and row["time/train_started"] == 10.0
    assert "train/batch_bytes" not in row  # one rank: nothing sent to another


def test_a_users_mistake_in_the_rollout_reaches_every_rank_as_it_is(tmp_path):
    """A user's error (here the dump of step 1 missing: DumpError) ends the step as itself, one line
    naming the file (exit 2 at the CLI); any other exception becomes RolloutRoleFailed naming the role
    and the step (tests/e2e/test_ray_faults.py: a reward function's ValueError)."""
    rollout = _hosted(tmp_path, steps_dumped=1)
    rollout.next_share(0)
    with pytest.raises(DumpError, match=r"rollout_1\.pt"):
        rollout.next_share(1)  # no dump of step 1: the replayed rollout raises
    rollout.close()
