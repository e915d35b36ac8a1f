"""The bookkeeping every pool of restartable Ray actors shares (slime_mt/cluster/pool.py): work goes to
the actor carrying the least, the next in turn among equals, never to an excluded one; each new
incarnation an actor answers with is one restart, counted once. Unit tier, milliseconds (no Ray: the
pools' start and close run in tests/e2e/test_env_workers.py and test_rollout_workers.py)."""

from slime_mt.cluster.pool import ActorPool


def _pool(n: int) -> ActorPool:
    where = [{"node_ip": "127.0.0.1", "node_id": f"{i:08x}abcdef", "incarnation": f"first-{i}"} for i in range(n)]
    return ActorPool(where)


def test_work_goes_to_the_least_loaded_actor_in_turn_and_never_to_an_excluded_one():
    pool = _pool(3)
    assert [pool.assign() for _ in range(3)] == [0, 1, 2]  # equals: in turn
    pool.unassign(1)
    assert pool.assign() == 1  # the one carrying the least
    assert pool.assign(amount=5) == 2  # all at 1 again: the next in turn after 1
    assert pool.load == [1, 1, 6]
    assert pool.assign(excluded={0}) == 1
    assert pool.assign(excluded={0, 1, 2}) is None
    assert pool.load == [1, 2, 6]  # a refused assignment changes nothing


def test_each_new_incarnation_is_one_restart_counted_once():
    pool = _pool(2)
    assert not pool.saw(0, "first-0")  # the incarnation it started as
    assert pool.saw(1, "second-1") and not pool.saw(1, "second-1")
    assert pool.saw(1, "third-1")
    assert pool.take_restarts() == 2 and pool.take_restarts() == 0
    assert pool.total_restarts == 2
    assert pool.describe("env worker") == [
        "env worker 0: node 127.0.0.1 (00000000)",
        "env worker 1: node 127.0.0.1 (00000001)",
    ]
