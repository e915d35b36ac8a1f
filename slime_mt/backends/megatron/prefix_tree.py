"""Prefix-tree packing: the sequences of a micro-batch as one trie, each shared token computed once.

Sequences are inserted into a trie by token key (the token id; for image pads, the id with the
image's content and the pad's offset in it, so equal images at equal positions share and different
ones do not). The trie's nodes, in depth-first order, are the row: a node's parent comes before it,
and a token attends exactly to its ancestors and itself (``TreeRow.mask``, True where attention is
NOT allowed, Megatron's convention). Each node keeps the position id it has in its sequences (equal
in every sequence through it, as positions depend only on the prefix; M-RoPE positions likewise).
Sequence ``s``'s ``k``-th token is node ``paths[s][k]``, so its logits predict ``paths[s][k + 1]``:
gathering per path gives every sequence exactly its unpacked log-probs.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class TreeRow:
    """Trie nodes in depth-first order (a parent before its children)."""

    tokens: list[int] = field(default_factory=list)  # [N] token id of each node
    parents: list[int] = field(default_factory=list)  # [N] parent node (-1 for a root)
    positions: list = field(default_factory=list)  # [N] the node's position id (a (t, h, w) tuple for M-RoPE)
    paths: list[list[int]] = field(default_factory=list)  # per sequence: its tokens' nodes, in order

    @property
    def num_nodes(self) -> int:
        return len(self.tokens)

    @property
    def num_sequence_tokens(self) -> int:
        """Tokens the sequences have together, unpacked (the row has ``num_nodes``)."""
        return sum(len(p) for p in self.paths)

    def mask(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """``[N, N]`` bool, True where attention is not allowed: node i sees its ancestors and itself."""
        n = self.num_nodes
        allowed = torch.zeros(n, n, dtype=torch.bool, device=device)
        for i, parent in enumerate(self.parents):
            if parent >= 0:
                allowed[i] = allowed[parent]  # DFS order: the parent's row is complete
            allowed[i, i] = True
        return ~allowed

    def logit_nodes(self, sequence: int, start: int, end: int) -> list[int]:
        """Nodes whose logits predict tokens ``start..end-1`` of ``sequence`` (``start >= 1``)."""
        if start < 1:
            raise ValueError("the first token of a sequence has no context to be predicted from")
        return self.paths[sequence][start - 1 : end - 1]


class PrefixTrie:
    """The trie being built: ``add`` inserts a sequence, ``new_tokens`` says how many nodes it would
    add (a token budget's test), ``row`` lays the nodes out depth-first."""

    def __init__(self):
        self._roots: dict = {}
        self._children: list[dict] = []  # per node: key -> child node (insertion order)
        self._token: list[int] = []
        self._position: list[int] = []
        self._parent: list[int] = []
        self._paths: list[list[int]] = []

    @property
    def num_nodes(self) -> int:
        return len(self._token)

    def new_tokens(self, keys: Sequence[Hashable]) -> int:
        """Nodes that adding a sequence of ``keys`` would create (its tokens past the shared prefix)."""
        level, shared = self._roots, 0
        for key in keys:
            node = level.get(key)
            if node is None:
                break
            shared += 1
            level = self._children[node]
        return len(keys) - shared

    def add(
        self, seq: Sequence[int], keys: Sequence[Hashable] | None = None, positions: Sequence[int] | None = None
    ) -> None:
        """Insert ``seq`` (token ids); ``keys[k]``: what token k must equal to share a node (default:
        its id); ``positions[k]``: its position id (default: k; a tuple for M-RoPE)."""
        s = len(self._paths)
        keys = seq if keys is None else keys
        positions = range(len(seq)) if positions is None else positions
        if len(keys) != len(seq) or len(positions) != len(seq):
            raise ValueError(f"sequence {s}: {len(seq)} tokens but {len(keys)} keys and {len(positions)} positions")
        level, parent, path = self._roots, -1, []
        for token, key, position in zip(seq, keys, positions):
            position = tuple(position) if isinstance(position, (tuple, list)) else int(position)
            node = level.get(key)
            if node is None:
                node = len(self._token)
                level[key] = node
                self._token.append(int(token))
                self._position.append(position)
                self._parent.append(parent)
                self._children.append({})
            elif self._position[node] != position:
                raise ValueError(
                    f"sequence {s}: a shared prefix token at position {position} was inserted at "
                    f"position {self._position[node]}; positions must depend on the prefix only"
                )
            path.append(node)
            level, parent = self._children[node], node
        self._paths.append(path)

    def row(self) -> TreeRow:
        """The nodes in depth-first order: every node after its parent, siblings in insertion order."""
        order, stack = [], list(reversed(list(self._roots.values())))
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(reversed(list(self._children[node].values())))
        rank = {node: i for i, node in enumerate(order)}
        return TreeRow(
            tokens=[self._token[n] for n in order],
            parents=[rank[self._parent[n]] if self._parent[n] >= 0 else -1 for n in order],
            positions=[self._position[n] for n in order],
            paths=[[rank[n] for n in path] for path in self._paths],
        )


def build_tree(
    sequences: Sequence[Sequence[int]],
    keys: Sequence[Sequence[Hashable]] | None = None,
    positions: Sequence[Sequence[int]] | None = None,
) -> TreeRow:
    """The trie of ``sequences`` (token ids) as a row. ``keys[s][k]``: what token k of sequence s must
    equal to share a node (default: its id); ``positions[s][k]``: its position id (default: k)."""
    trie = PrefixTrie()
    for s, seq in enumerate(sequences):
        trie.add(seq, keys[s] if keys is not None else None, positions[s] if positions is not None else None)
    return trie.row()
