"""Context parallelism without Transformer Engine: a packed row split over the CP ranks in the zigzag
layout, and the attention of a rank's tokens over the whole row without an ``[S/cp, S]`` tensor.

Zigzag (Megatron's and Transformer Engine's layout): the row, padded to a multiple of ``2 * cp``, is cut
into ``2 * cp`` chunks; CP rank r holds chunks r and ``2cp - 1 - r``, so under causal attention every
rank has the same work. Every token keeps its place in the row (its position ids, its sequence).

Attention (``attention.FusedCoreAttention`` given a ``ContextParallelSegments`` layout): a rank gathers
the keys and values of the whole row from the CP group (``gather_sequence``, an all-gather whose
backward is a reduce-scatter), then attends its own queries over them with ``segment_attention``:
exact softmax attention, causal within each packed sequence, computed one ``[query block, key block]``
tile at a time with a running log-sum-exp (as flash attention does), its backward recomputing each
tile from the saved log-sum-exp. What it holds for the backward is the queries, keys, values, output
and one log-sum-exp per query; a tile is at most ``block x block`` scores, whatever the row's length.
Tiles no query of which may see (another sequence, the future) are skipped. Keys may come in any
order: visibility is read from each token's sequence and position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 512  # queries and keys per tile: 512 x 512 fp32 scores (1 MB per head)


def padded_length(length: int, cp: int) -> int:
    """The row's length padded to a multiple of ``2 * cp`` (the zigzag chunks are equal)."""
    return length + (-length) % (2 * cp)


def zigzag_index(length: int, cp: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """The row positions CP rank ``rank`` holds, in its order: chunk ``rank`` then chunk
    ``2cp - 1 - rank`` of a row of ``length`` tokens (a multiple of ``2 * cp``)."""
    if length % (2 * cp):
        raise ValueError(f"a row of {length} tokens does not split into {2 * cp} equal chunks")
    chunk = length // (2 * cp)
    first, second = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat(
        [
            torch.arange(first, first + chunk, device=device),
            torch.arange(second, second + chunk, device=device),
        ]
    )


def gathered_index(length: int, cp: int, device: torch.device | None = None) -> torch.Tensor:
    """The row positions of an all-gather of every rank's tokens over the CP group (rank order)."""
    return torch.cat([zigzag_index(length, cp, r, device) for r in range(cp)])


@dataclass(frozen=True, eq=False)
class ContextParallelSegments:
    """The attention layout of this CP rank's share of a packed row (passed where Megatron passes
    ``attention_mask``): the sequence id and position in the row of each of its query tokens, and of
    each token of the row in the order an all-gather over ``group`` returns them."""

    query_segment: torch.Tensor  # [m] int64
    query_position: torch.Tensor  # [m] int64, the token's index in the row
    key_segment: torch.Tensor  # [n] int64
    key_position: torch.Tensor  # [n] int64
    group: object  # the CP process group
    query_padding: torch.Tensor | None = None  # [m] bool: tokens only there to pad the row

    @classmethod
    def of(cls, lengths: list[int], padded: int, cp: int, rank: int, group, device=None):
        """The layout of rank ``rank``'s share of a row of sequences of ``lengths`` padded to
        ``padded`` tokens (the padding is one more sequence)."""
        segment = torch.repeat_interleave(
            torch.arange(len(lengths) + 1, device=device),
            torch.tensor([*lengths, padded - sum(lengths)], device=device),
        )
        mine, every = zigzag_index(padded, cp, rank, device), gathered_index(padded, cp, device)
        return cls(segment[mine], mine, segment[every], every, group, segment[mine] == len(lengths))

    def to(self, device, *args, **kwargs) -> ContextParallelSegments:
        return ContextParallelSegments(
            self.query_segment.to(device),
            self.query_position.to(device),
            self.key_segment.to(device),
            self.key_position.to(device),
            self.group,
            None if self.query_padding is None else self.query_padding.to(device),
        )


def _visible(q_seg, q_pos, k_seg, k_pos) -> torch.Tensor:
    """[queries, keys] True where the query may see the key: same sequence, not after it."""
    return (q_seg[:, None] == k_seg[None, :]) & (k_pos[None, :] <= q_pos[:, None])


def _tiles(q_seg, q_pos, k_seg, k_pos, block: int):
    """(query slice, key slice, visibility) of every tile with at least one visible pair."""
    for qs in range(0, len(q_seg), block):
        q = slice(qs, min(qs + block, len(q_seg)))
        for ks in range(0, len(k_seg), block):
            k = slice(ks, min(ks + block, len(k_seg)))
            mask = _visible(q_seg[q], q_pos[q], k_seg[k], k_pos[k])
            if bool(mask.any()):
                yield q, k, mask


class _SegmentAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, q_seg, q_pos, k_seg, k_pos, scale, block):
        b, h, m, d = q.shape
        out = torch.zeros(b, h, m, v.shape[-1], dtype=torch.float32, device=q.device)
        row_max = torch.full((b, h, m), float("-inf"), dtype=torch.float32, device=q.device)
        row_sum = torch.zeros(b, h, m, dtype=torch.float32, device=q.device)
        for qi, ki, mask in _tiles(q_seg, q_pos, k_seg, k_pos, block):
            scores = torch.matmul(q[:, :, qi].float(), k[:, :, ki].float().transpose(-1, -2)) * scale
            scores = scores.masked_fill(~mask, float("-inf"))
            new_max = torch.maximum(row_max[:, :, qi], scores.amax(dim=-1))
            safe = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
            weights = torch.exp(scores - safe[..., None])
            keep = torch.exp(row_max[:, :, qi] - safe)
            row_sum[:, :, qi] = row_sum[:, :, qi] * keep + weights.sum(dim=-1)
            out[:, :, qi] = out[:, :, qi] * keep[..., None] + torch.matmul(weights, v[:, :, ki].float())
            row_max[:, :, qi] = new_max
        out = out / row_sum[..., None]
        lse = row_max + torch.log(row_sum)
        ctx.save_for_backward(q, k, v, out, lse, q_seg, q_pos, k_seg, k_pos)
        ctx.scale, ctx.block = scale, block
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, q_seg, q_pos, k_seg, k_pos = ctx.saved_tensors
        scale = ctx.scale
        grad_out = grad_out.float()
        delta = (grad_out * out).sum(dim=-1)  # [b, h, m]
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        for qi, ki, mask in _tiles(q_seg, q_pos, k_seg, k_pos, ctx.block):
            qf, kf, vf, go = q[:, :, qi].float(), k[:, :, ki].float(), v[:, :, ki].float(), grad_out[:, :, qi]
            scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale
            probs = torch.exp(scores - lse[:, :, qi, None]).masked_fill(~mask, 0.0)
            dv[:, :, ki] += torch.matmul(probs.transpose(-1, -2), go)
            dscores = probs * (torch.matmul(go, vf.transpose(-1, -2)) - delta[:, :, qi, None])
            dq[:, :, qi] += torch.matmul(dscores, kf) * scale
            dk[:, :, ki] += torch.matmul(dscores.transpose(-1, -2), qf) * scale
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None


def segment_attention(q, k, v, q_seg, q_pos, k_seg, k_pos, scale: float, block: int = BLOCK) -> torch.Tensor:
    """Softmax attention of queries ``q [b, h, m, d]`` over keys and values ``k, v [b, h, n, d]``
    where a query sees the keys of its own sequence (``*_seg``) at or before its position (``*_pos``),
    tile by tile (see the module docstring). -> ``[b, h, m, d]`` in ``q``'s dtype, computed in fp32."""
    return _SegmentAttention.apply(q, k, v, q_seg, q_pos, k_seg, k_pos, scale, block)


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence dim (0) over a group; backward: the sum over the group of the
    gradients, each rank keeping its own slice (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(group.size())]
        torch.distributed.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad):
        group = ctx.group
        grad = grad.contiguous()
        if torch.distributed.get_backend(group) == "nccl":
            mine = torch.empty_like(grad.chunk(group.size(), dim=0)[0])
            torch.distributed.reduce_scatter_tensor(mine, grad, group=group)
            return mine, None
        grad = grad.clone()  # gloo: an all-reduce, then this rank's slice
        torch.distributed.all_reduce(grad, group=group)
        return grad.chunk(group.size(), dim=0)[group.rank()].contiguous(), None


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Every CP rank's ``x [s, ...]`` in rank order ``[cp * s, ...]``, differentiable."""
    return _GatherSequence.apply(x, group)


class _GatherOwned(torch.autograd.Function):
    """Every CP rank's values of a row's response tokens, put back in row order (each token's value
    comes from the rank that owns its logit row); backward: this rank's tokens' gradients, unsummed
    (every CP rank computes the same loss from the whole row's values)."""

    @staticmethod
    def forward(ctx, values, owner, group):
        ctx.mine = owner == group.rank()
        counts = [int((owner == r).sum()) for r in range(group.size())]
        padded = torch.zeros(max(counts), dtype=values.dtype, device=values.device)
        padded[: len(values)] = values
        parts = [torch.empty_like(padded) for _ in counts]
        torch.distributed.all_gather(parts, padded, group=group)
        out = torch.empty(len(owner), dtype=values.dtype, device=values.device)
        for r, (part, n) in enumerate(zip(parts, counts)):
            out[owner == r] = part[:n]
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.mine], None, None


def gather_owned(values: torch.Tensor, owner: torch.Tensor, group) -> torch.Tensor:
    """``values [t]`` of this rank's response tokens (in row order) -> ``[T]`` of the whole row,
    differentiable; ``owner [T]``: the CP rank of each token (``packing.cp_share``)."""
    return _GatherOwned.apply(values, owner, group)
