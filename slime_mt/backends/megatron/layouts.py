"""What a packed row looks like to attention, in plain torch (no Megatron): ``Segments`` (independent
sequences laid end to end) and ``Tree`` (a prefix tree in depth-first order), passed where Megatron
passes ``attention_mask``, and the attention of a tree row without an ``[N, N]`` tensor. ``packing.py``
builds them; ``attention.py`` (the core-attention module) computes with them."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Segments:
    """The attention layout of a packed row: sequences of ``lengths`` laid end to end, each causal
    and blind to the others. Passed where Megatron passes ``attention_mask``; it holds no tensor."""

    lengths: tuple[int, ...]

    def bounds(self) -> list[tuple[int, int]]:
        out, start = [], 0
        for n in self.lengths:
            out.append((start, start + n))
            start += n
        return out

    def to(self, *args, **kwargs) -> Segments:  # PackedRow.to moves tensors; a layout has none
        return self


def segments_attention(q, k, v, segments: Segments, scale: float, dropout: float = 0.0) -> torch.Tensor:
    """Causal SDPA per packed sequence of ``q, k, v [b, h, L, d]`` (one fused call each) -> ``[b, h, L, d]``."""
    parts = [
        F.scaled_dot_product_attention(
            q[:, :, a:e], k[:, :, a:e], v[:, :, a:e], dropout_p=dropout, is_causal=True, scale=scale
        )
        for a, e in segments.bounds()
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


@dataclass(frozen=True, eq=False)
class Tree:
    """The attention layout of a prefix-tree row: nodes in depth-first order, ``parents[i]`` the node
    before node i on its path (-1 for a root). Node i attends to its ancestors and itself; in
    depth-first order, node ``k`` is an ancestor-or-self of ``q`` exactly when ``k <= q < ends[k]``,
    ``ends[k]`` being the end of ``k``'s subtree. Passed where Megatron passes ``attention_mask``."""

    parents: tuple[int, ...]
    _block_masks: dict = field(default_factory=dict, repr=False)  # device -> flex BlockMask, built once per row

    def __len__(self) -> int:
        return len(self.parents)

    @cached_property
    def ends(self) -> list[int]:
        ends = list(range(1, len(self.parents) + 1))
        for i in reversed(range(len(self.parents))):  # children come after their parent: fold upwards
            p = self.parents[i]
            if p >= 0:
                ends[p] = max(ends[p], ends[i])
        return ends

    @cached_property
    def branches(self) -> list[tuple[int, int, list[tuple[int, int]]]]:
        """``(start, end, ancestors)`` for each maximal chain ``start..end-1`` (each node's parent the
        node before it); ``ancestors``: the node ranges above the chain, root first."""
        out, branch_of = [], {}
        for i, p in enumerate(self.parents):
            if i > 0 and p == i - 1 and out[-1][1] == i:
                out[-1][1] = i + 1
            else:
                ranges, node = [], p
                while node >= 0:
                    b = out[branch_of[node]]
                    ranges.append((b[0], node + 1))
                    node = self.parents[b[0]]
                out.append([i, i + 1, ranges[::-1]])
            branch_of[i] = len(out) - 1
        return [(a, e, ranges) for a, e, ranges in out]

    def block_mask(self, device: torch.device):
        """flex_attention's block mask of the tree on ``device`` (CUDA), built once for all layers."""
        if device not in self._block_masks:
            from torch.nn.attention.flex_attention import create_block_mask

            ends = torch.tensor(self.ends, dtype=torch.int32, device=device)

            def ancestor_or_self(b, h, q, k):
                return (k <= q) & (q < ends[k])

            n = len(self.parents)
            self._block_masks[device] = create_block_mask(ancestor_or_self, None, None, n, n, device=device)
        return self._block_masks[device]

    def to(self, *args, **kwargs) -> Tree:
        return self


_flex_attention = None


def _compiled_flex_attention():
    """flex_attention compiled once per process (uncompiled, it materialises the scores)."""
    global _flex_attention
    if _flex_attention is None:
        from torch.nn.attention.flex_attention import flex_attention

        _flex_attention = torch.compile(flex_attention, dynamic=True)
    return _flex_attention


def tree_attention(q, k, v, tree: Tree, dropout: float, scale: float) -> torch.Tensor:
    """Attention of a prefix-tree row without an ``[N, N]`` tensor (``q [b, np, N, hn]``, ``k``/``v``
    with the heads already repeated)."""
    if q.is_cuda and dropout == 0.0:
        return _compiled_flex_attention()(q, k, v, block_mask=tree.block_mask(q.device), scale=scale)
    parts = []
    for start, end, ancestors in tree.branches:
        qs = q[:, :, start:end]
        if not ancestors:
            parts.append(
                F.scaled_dot_product_attention(
                    qs, k[:, :, start:end], v[:, :, start:end], dropout_p=dropout, is_causal=True, scale=scale
                )
            )
            continue
        index = torch.cat(
            [torch.arange(a, e, device=q.device) for a, e in ancestors] + [torch.arange(start, end, device=q.device)]
        )
        above, n = index.numel() - (end - start), end - start
        allowed = torch.ones(n, above + n, dtype=torch.bool, device=q.device)
        allowed[:, above:] = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        parts.append(
            F.scaled_dot_product_attention(
                qs,
                k.index_select(2, index),
                v.index_select(2, index),
                attn_mask=allowed,
                dropout_p=dropout,
                scale=scale,
            )
        )
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
