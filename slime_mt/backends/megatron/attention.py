"""Core attention on PyTorch's fused kernels, for the layer spec without Transformer Engine.

Megatron's local ``DotProductAttention`` materialises the ``[b, heads, L, L]`` scores of a packed row
(plus an ``[L, L]`` mask), so its cost and memory grow with the square of the row, not of its
sequences. ``FusedCoreAttention`` takes the same inputs and computes the same result with
``torch.nn.functional.scaled_dot_product_attention`` (the flash / memory-efficient kernels on CPU and
CUDA), never holding the scores:

  ``Segments`` (a packed row of independent sequences)  one causal SDPA call per sequence
  ``Tree`` (a prefix-tree row, ``prefix_tree.py``)       on CUDA, ``flex_attention`` with a block mask
                                                         built from the tree; elsewhere one SDPA call
                                                         per branch over its ancestors and itself
  a boolean mask ``[1, 1, L, L]`` (True = masked)        one SDPA call with that mask

Shapes follow Megatron: ``query [sq, b, np, hn]``, ``key``/``value [sk, b, ng, hn]`` (``ng`` key/value
groups, repeated to the ``np`` heads of this tensor-parallel rank), output ``[sq, b, np * hn]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule


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


def _tree_attention(q, k, v, tree: Tree, dropout: float, scale: float) -> torch.Tensor:
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


class FusedCoreAttention(MegatronModule):
    """Drop-in ``core_attention`` for Megatron's local layer spec (see the module docstring)."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if pg_collection is not None:
            tp = pg_collection.tp.size()
        else:
            from megatron.core import parallel_state

            tp = parallel_state.get_tensor_model_parallel_world_size()
        if config.num_attention_heads % tp or config.num_query_groups % tp:
            raise ValueError(
                f"TP size {tp} must divide {config.num_attention_heads} heads and "
                f"{config.num_query_groups} key/value groups"
            )
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        head_dim = config.kv_channels
        scale = softmax_scale if softmax_scale is not None else config.softmax_scale
        self.scale = scale if scale is not None else head_dim**-0.5
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError(
                "FusedCoreAttention takes a Segments or Tree layout or a boolean mask, not packed_seq_params "
                "or an attention bias (those are the Transformer Engine path's)"
            )
        sq, b = query.shape[:2]
        q = query.permute(1, 2, 0, 3)  # [b, np, sq, hn]
        k, v = key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3)  # [b, ng, sk, hn]
        if self.heads != self.groups:
            k = k.repeat_interleave(self.heads // self.groups, dim=1)
            v = v.repeat_interleave(self.heads // self.groups, dim=1)
        dropout = self.dropout if self.training else 0.0
        if isinstance(attention_mask, Segments):
            if sum(attention_mask.lengths) != sq:
                raise ValueError(f"segments cover {sum(attention_mask.lengths)} tokens but the row has {sq}")
            parts = [
                F.scaled_dot_product_attention(
                    q[:, :, a:e], k[:, :, a:e], v[:, :, a:e], dropout_p=dropout, is_causal=True, scale=self.scale
                )
                for a, e in attention_mask.bounds()
            ]
            out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
        elif isinstance(attention_mask, Tree):
            if len(attention_mask) != sq:
                raise ValueError(f"the tree has {len(attention_mask)} nodes but the row has {sq}")
            out = _tree_attention(q, k, v, attention_mask, dropout, self.scale)
        elif isinstance(attention_mask, torch.Tensor) and attention_mask.dtype == torch.bool:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=~attention_mask, dropout_p=dropout, scale=self.scale
            )
        else:
            raise ValueError(
                f"FusedCoreAttention needs a Segments or Tree layout or a boolean mask, got "
                f"{type(attention_mask).__name__}"
            )
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.heads * out.shape[-1])  # [sq, b, np * hn]
