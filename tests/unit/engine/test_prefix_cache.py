"""The embedded engine's prefix cache (``--engine-cache-tokens``): the cache's own rules on real
tensors, then a real SmolLM2 engine over HTTP: an 8-turn episode reuses the whole previous context
on every turn and generates exactly what the uncached engine does; an aborted turn resumes from the
tokens it generated; a weight update and ``/flush_cache`` invalidate it."""

import pytest
import torch

from slime_mt.engine.embedded.prefix_cache import PrefixCache, common_prefix


def kv(n: int, fill: float = 0.0):
    """Two layers of KV state for ``n`` tokens; token i's value is fill + i."""
    column = (torch.arange(n, dtype=torch.float32) + fill).view(1, 1, n, 1)
    return [(column.clone(), -column.clone()) for _ in range(2)]


def test_common_prefix_is_exact_and_bounded():
    assert common_prefix((1, 2, 3, 4), [1, 2, 9, 4], 10) == 2
    assert common_prefix((1, 2, 3), [1, 2, 3, 4], 10) == 3
    assert common_prefix((1, 2, 3), [1, 2, 3], 2) == 2
    assert common_prefix((5,), [1], 3) == 0
    for cut in range(0, 200, 7):  # the bisection against a plain scan
        a = tuple(range(200))
        b = list(range(cut)) + [-1] * (200 - cut)
        assert common_prefix(a, b, 500) == cut


def test_the_cache_serves_the_longest_prefix_and_evicts_by_tokens():
    cache = PrefixCache(max_tokens=10)
    cache.insert([1, 2, 3, 4], kv(4))
    cache.insert([1, 2, 7], kv(3, fill=100))
    n, state = cache.lookup([1, 2, 3, 4, 5], limit=4)
    assert (
        n == 4 and state[0][0].flatten().tolist() == [0, 1, 2, 3] and state[1][1].flatten().tolist() == [0, -1, -2, -3]
    )
    n, state = cache.lookup([1, 2, 7, 8], limit=3)
    assert n == 3 and state[0][0].flatten().tolist() == [100, 101, 102]
    n, _ = cache.lookup([1, 2, 3, 4, 5], limit=2)  # the caller's limit (a token must be left to compute)
    assert n == 2
    assert cache.lookup([9, 9], limit=1) == (0, None)
    # an entry that a newer one extends is dropped; one that covers the newer one is only refreshed
    cache.insert([1, 2, 3, 4, 5, 6], kv(6))
    assert len(cache) == 2 and cache.tokens == 9
    cache.insert([1, 2, 3], kv(3))
    assert len(cache) == 2 and cache.tokens == 9
    # over the budget (12 > 10 tokens): the least recently used entry, [1, 2, 7], goes
    cache.insert([4, 4, 4], kv(3))
    assert cache.tokens == 9 and cache.lookup([1, 2, 7], limit=3)[0] == 2  # only [1..6]'s [1, 2] is left
    cache.insert(list(range(11)), kv(11))  # larger than the whole cache: not kept
    assert cache.tokens == 9 and cache.lookup(list(range(11)), limit=11) == (0, None)
    cache.clear()
    assert len(cache) == 0 and cache.tokens == 0 and cache.lookup([1, 2], limit=2) == (0, None)
    with pytest.raises(ValueError, match="must be >= 0 tokens"):
        PrefixCache(-1)
