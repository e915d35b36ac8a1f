"""What the pools of restartable actors share (environment workers, rollout processes): where each
actor runs, the load each carries, and the restarts seen.

An actor answers ``where()`` with ``runtime.location()`` and an ``incarnation`` that is new after
every restart (Ray starts it again with the same arguments, so a restart shows only there). Work
goes to the actor carrying the least, the next in turn among equals; the pool counts each
incarnation it had not seen as one restart. Methods are thread-safe.
"""

from __future__ import annotations

import threading


class ActorPool:
    """The bookkeeping of a pool of actors whose first ``where()`` answers are ``where``; a pool that
    starts them sets ``workers``, ``owned`` and ``started_ray`` (``start``, ``close``)."""

    def __init__(self, where: list[dict]) -> None:
        self.where = where
        self.load = [0] * len(where)  # what each carries (episodes, samples)
        self.incarnations = [{w["incarnation"]} for w in where]
        self.restarts = 0  # seen since the last ``take_restarts``
        self.total_restarts = 0
        self._next = 0
        self._lock = threading.Lock()

    def start(self, actor, n: int, args: tuple, what: str) -> None:
        """Start ``n`` of ``actor`` (a Ray actor class with its options) from ``args`` and wait for their
        ``where()``; a failure closes the pool (``self.close()``) and raises one error naming ``what``.
        Every argument goes through the object store and is held here: Ray restarts an actor from its
        constructor's arguments, and one there (over 100 KB, e.g. a config with long
        ``--rollout-stop-token-ids``) must outlive the first start."""
        import ray

        self.args_refs = [ray.put(a) for a in args]
        self.workers = [actor.remote(*self.args_refs) for _ in range(n)]
        try:
            where = ray.get([w.where.remote() for w in self.workers], timeout=300)
        except Exception as e:
            self.close()
            raise RuntimeError(f"{what}: did not start: {e}") from e
        ActorPool.__init__(self, where)

    def close(self) -> None:
        """Stop the actors (unless another process owns them: ``owned``), and Ray when this pool
        started the connection (``started_ray``)."""
        import ray

        if self.owned:
            for worker in self.workers:
                ray.kill(worker, no_restart=True)
        self.workers = []
        if self.started_ray:
            ray.shutdown()
            self.started_ray = False

    def describe(self, role: str) -> list[str]:
        return [f"{role} {i}: node {w['node_ip']} ({w['node_id'][:8]})" for i, w in enumerate(self.where)]

    def assign(self, amount: int = 1, excluded: set[int] | frozenset = frozenset()) -> int | None:
        """The actor for ``amount`` more load: the one carrying the least, the next in turn among
        equals, never one of ``excluded`` (None when every one is)."""
        with self._lock:
            n = len(self.load)
            order = [(self._next + i) % n for i in range(n) if (self._next + i) % n not in excluded]
            if not order:
                return None
            index = min(order, key=lambda i: self.load[i])
            self._next = (index + 1) % n
            self.load[index] += amount
            return index

    def unassign(self, index: int, amount: int = 1) -> None:
        with self._lock:
            self.load[index] -= amount

    def saw(self, index: int, incarnation: str) -> bool:
        """Actor ``index`` answered as ``incarnation`` -> whether that is a restart not counted before."""
        with self._lock:
            if incarnation in self.incarnations[index]:
                return False
            self.incarnations[index].add(incarnation)
            self.restarts += 1
            self.total_restarts += 1
            return True

    def take_restarts(self) -> int:
        with self._lock:
            restarts, self.restarts = self.restarts, 0
            return restarts
