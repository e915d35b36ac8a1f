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
  ``ContextParallelSegments`` (this CP rank's share of   keys and values gathered over the CP group,
  a row, ``context_parallel.py``)                        then tile-by-tile attention of its queries

Shapes follow Megatron: ``query [sq, b, np, hn]``, ``key``/``value [sk, b, ng, hn]`` (``ng`` key/value
groups, repeated to the ``np`` heads of this tensor-parallel rank), output ``[sq, b, np * hn]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from slime_mt.backends.megatron.context_parallel import ContextParallelSegments, gather_sequence, segment_attention
from slime_mt.backends.megatron.layouts import Segments, Tree, segments_attention, tree_attention


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
        cp = isinstance(attention_mask, ContextParallelSegments)
        if cp:  # the keys and values of the whole row, from every CP rank (before repeating the groups)
            key, value = gather_sequence(key, attention_mask.group), gather_sequence(value, attention_mask.group)
        q = query.permute(1, 2, 0, 3)  # [b, np, sq, hn]
        k, v = key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3)  # [b, ng, sk, hn]
        if self.heads != self.groups:
            k = k.repeat_interleave(self.heads // self.groups, dim=1)
            v = v.repeat_interleave(self.heads // self.groups, dim=1)
        dropout = self.dropout if self.training else 0.0
        if cp:
            if dropout:
                raise ValueError("context parallelism without Transformer Engine has no attention dropout")
            m = attention_mask
            out = segment_attention(
                q, k, v, m.query_segment, m.query_position, m.key_segment, m.key_position, self.scale
            )
        elif isinstance(attention_mask, Segments):
            if sum(attention_mask.lengths) != sq:
                raise ValueError(f"segments cover {sum(attention_mask.lengths)} tokens but the row has {sq}")
            out = segments_attention(q, k, v, attention_mask, self.scale, dropout)
        elif isinstance(attention_mask, Tree):
            if len(attention_mask) != sq:
                raise ValueError(f"the tree has {len(attention_mask)} nodes but the row has {sq}")
            out = tree_attention(q, k, v, attention_mask, dropout, self.scale)
        elif isinstance(attention_mask, torch.Tensor) and attention_mask.dtype == torch.bool:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=~attention_mask, dropout_p=dropout, scale=self.scale
            )
        else:
            raise ValueError(
                f"FusedCoreAttention needs a Segments, Tree or ContextParallelSegments layout or a boolean mask, got "
                f"{type(attention_mask).__name__}"
            )
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.heads * out.shape[-1])  # [sq, b, np * hn]
