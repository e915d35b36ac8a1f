"""A bounded prefix cache of KV states for the embedded engine (SGLang's radix cache, in small).

When a request leaves the running batch (finished or aborted), the KV state of every token it has
one for (the prompt and all generated tokens but the last, which was sampled and never fed back) is
kept under that token sequence. A new request reuses the longest cached prefix of its prompt and
prefills only the rest, so the next turn of a trajectory (its prompt is the previous context, the
previous output and the observation) and a resumed turn prefill only their new tokens; the response
reports the reused count as ``meta_info.cached_tokens``, as SGLang does.

An MoE model's entries also keep their tokens' routes (``slime_mt/routes.py``): a request that reuses
a prefix reports the routes it was computed with, as SGLang keeps them with its KV slots.

Entries live in namespaces: the KV state of rows decoded with a LoRA adapter is that adapter's
(``lora.py``), and a request reuses only states of its own namespace (None: the base model's).

The cache holds at most ``max_tokens`` tokens over all entries, least recently used evicted first.
An entry that is a prefix of a newer one is dropped (the newer one covers it). A weight update
clears it (states of the old weights must not be reused), as does ``/flush_cache``. Text models
only: a VLM prompt's positions depend on its images, and the engine does not key them yet.
"""

from __future__ import annotations

import collections

import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [1, H, L, D]


def common_prefix(a: tuple[int, ...], b: list[int], limit: int) -> int:
    """Length of the common prefix of ``a`` and ``b``, at most ``limit``."""
    n = min(len(a), len(b), limit)
    if a[:n] == tuple(b[:n]):
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]: bisect on slices (C-speed comparisons)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == tuple(b[:mid]):
            lo = mid
        else:
            hi = mid
    return lo


class PrefixCache:
    def __init__(self, max_tokens: int):
        if max_tokens < 0:
            raise ValueError(f"the engine's prefix cache size must be >= 0 tokens, got {max_tokens}")
        self.max_tokens = max_tokens
        # (namespace, tokens) -> KV; namespace None is the base model's, else an adapter's
        self._entries: collections.OrderedDict[tuple[object, tuple[int, ...]], KV] = collections.OrderedDict()
        self._routes: dict[tuple[object, tuple[int, ...]], torch.Tensor] = {}  # MoE: [tokens, moe_layers, top_k]
        self.tokens = 0  # held over all entries
        self.reused_tokens = 0  # served from the cache since the start
        self.hits = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, ids: list[int], limit: int, namespace: object = None) -> tuple[int, KV | None]:
        """The longest cached prefix of ``ids`` of at most ``limit`` tokens in ``namespace`` -> (its
        length, its KV (views of the entry: the caller must not write into them)), or (0, None)."""
        n, kv, _ = self.match(ids, limit, namespace)
        return n, kv

    def match(self, ids: list[int], limit: int, namespace: object = None) -> tuple[int, KV | None, torch.Tensor | None]:
        """``lookup``, with the routes of the reused tokens (MoE models; None otherwise)."""
        best, best_key = 0, None
        for key in self._entries:
            if key[0] != namespace:
                continue
            n = common_prefix(key[1], ids, limit)
            if n > best:
                best, best_key = n, key
        if best_key is None:
            return 0, None, None
        self._entries.move_to_end(best_key)
        self.hits += 1
        self.reused_tokens += best
        routes = self._routes.get(best_key)
        kv = [(k[..., :best, :], v[..., :best, :]) for k, v in self._entries[best_key]]
        return best, kv, None if routes is None else routes[:best]

    def insert(self, ids: list[int], kv: KV, routes: torch.Tensor | None = None, namespace: object = None) -> None:
        """Keep ``kv`` (the state of exactly ``ids``; owned by the cache from now on) in ``namespace`` and,
        for an MoE model, ``routes`` (one row per token of ``ids``)."""
        if not ids or len(ids) > self.max_tokens:
            return
        tokens = tuple(ids)
        for other in list(self._entries):
            space, held = other
            if space != namespace:
                continue
            if len(held) >= len(tokens) and held[: len(tokens)] == tokens:  # already covered: refresh it
                self._entries.move_to_end(other)
                return
            if held == tokens[: len(held)]:  # the new entry covers this one
                self._drop(other)
        key = (namespace, tokens)
        self._entries[key] = kv
        if routes is not None:
            self._routes[key] = routes
        self.tokens += len(tokens)
        while self.tokens > self.max_tokens:
            self._drop(next(iter(self._entries)))

    def clear(self) -> None:
        self._entries.clear()
        self._routes.clear()
        self.tokens = 0

    def nbytes(self) -> int:
        """Bytes of KV state held over all entries."""
        return sum(k.nbytes + v.nbytes for kv in self._entries.values() for k, v in kv)

    def _drop(self, key: tuple[object, tuple[int, ...]]) -> None:
        del self._entries[key]
        self._routes.pop(key, None)
        self.tokens -= len(key[1])
