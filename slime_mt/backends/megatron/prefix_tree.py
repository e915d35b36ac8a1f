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

from dataclasses import dataclass, field
from typing import Hashable, Sequence

import torch


@dataclass
class TreeRow:
    """Trie nodes in depth-first order (a parent before its children)."""

    tokens: list[int] = field(default_factory=list)  # [N] token id of each node
    parents: list[int] = field(default_factory=list)  # [N] parent node (-1 for a root)
    positions: list[int] = field(default_factory=list)  # [N] the node's index in its sequences
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
        return self.paths[sequence][start - 1:end - 1]


def build_tree(sequences: Sequence[Sequence[int]], keys: Sequence[Sequence[Hashable]] | None = None,
               positions: Sequence[Sequence[int]] | None = None) -> TreeRow:
    """The trie of ``sequences`` (token ids). ``keys[s][k]``: what token k of sequence s must equal to
    share a node (default: its id); ``positions[s][k]``: its position id (default: k)."""
    children: list[dict] = []  # per node: key -> child node (insertion order)
    roots: dict = {}
    node_token, node_position, node_parent = [], [], []
    inserted: list[list[int]] = []
    for s, seq in enumerate(sequences):
        seq_keys = keys[s] if keys is not None else seq
        seq_positions = positions[s] if positions is not None else range(len(seq))
        if len(seq_keys) != len(seq) or len(seq_positions) != len(seq):
            raise ValueError(f"sequence {s}: {len(seq)} tokens but {len(seq_keys)} keys and "
                             f"{len(seq_positions)} positions")
        level, parent, path = roots, -1, []
        for token, key, position in zip(seq, seq_keys, seq_positions):
            node = level.get(key)
            if node is None:
                node = len(node_token)
                level[key] = node
                node_token.append(int(token))
                node_position.append(int(position))
                node_parent.append(parent)
                children.append({})
            elif node_position[node] != int(position):
                raise ValueError(f"sequence {s}: a shared prefix token at position {position} was inserted at "
                                 f"position {node_position[node]}; positions must depend on the prefix only")
            path.append(node)
            level, parent = children[node], node
        inserted.append(path)
    # depth-first order: every node after its parent, siblings in insertion order
    order, stack = [], list(reversed(list(roots.values())))
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(reversed(list(children[node].values())))
    rank = {node: i for i, node in enumerate(order)}
    return TreeRow(tokens=[node_token[n] for n in order],
                   parents=[rank[node_parent[n]] if node_parent[n] >= 0 else -1 for n in order],
                   positions=[node_position[n] for n in order],
                   paths=[[rank[n] for n in path] for path in inserted])
