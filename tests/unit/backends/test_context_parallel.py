"""Context parallelism's pieces in one process (unit tier, <2 s): the zigzag split of a packed row, the
layout each CP rank attends with, and the tile-by-tile attention, which equals PyTorch's causal SDPA per
sequence (values and gradients) whatever the order of the keys, and keeps no [queries, keys] tensor for
its backward. The split over real CP ranks: tests/integration/backends/test_context_parallel.py."""

import pytest
import torch

from slime_mt.backends.megatron.context_parallel import (
    ContextParallelSegments,
    gathered_index,
    padded_length,
    segment_attention,
    zigzag_index,
)
from slime_mt.backends.megatron.layouts import Segments, segments_attention

LENGTHS = [37, 300, 700, 11]


def test_the_zigzag_split_gives_every_rank_two_chunks_and_every_token_to_one_rank():
    assert padded_length(1048, 2) == 1048 and padded_length(1049, 2) == 1052 and padded_length(5, 4) == 8
    assert zigzag_index(8, 2, 0).tolist() == [0, 1, 6, 7] and zigzag_index(8, 2, 1).tolist() == [2, 3, 4, 5]
    for cp in (1, 2, 4):
        every = gathered_index(48, cp)
        assert sorted(every.tolist()) == list(range(48))
        assert torch.equal(every, torch.cat([zigzag_index(48, cp, r) for r in range(cp)]))
    with pytest.raises(ValueError, match="a row of 10 tokens does not split into 4 equal chunks"):
        zigzag_index(10, 2, 0)


def test_a_ranks_layout_holds_its_tokens_and_the_whole_row_in_gathered_order():
    padded = padded_length(sum(LENGTHS), 2)
    layouts = [ContextParallelSegments.of(LENGTHS, padded, 2, r, group=None) for r in range(2)]
    segment = torch.repeat_interleave(torch.arange(5), torch.tensor([*LENGTHS, padded - sum(LENGTHS)]))
    for r, layout in enumerate(layouts):
        assert torch.equal(layout.query_position, zigzag_index(padded, 2, r))
        assert torch.equal(layout.query_segment, segment[layout.query_position])
        assert torch.equal(layout.key_position, torch.cat([x.query_position for x in layouts]))
        assert torch.equal(layout.key_segment, segment[layout.key_position])


def test_tile_attention_equals_causal_sdpa_per_sequence_and_keeps_no_score_matrix():
    torch.manual_seed(0)
    total, scale = sum(LENGTHS), 16**-0.5
    q, k, v = (torch.randn(1, 4, total, 16, requires_grad=True) for _ in range(3))
    segment = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))
    position = torch.arange(total)
    reference = segments_attention(q, k, v, Segments(tuple(LENGTHS)), scale)
    grad = torch.randn_like(reference)
    want = torch.autograd.grad(reference, (q, k, v), grad)
    order = torch.randperm(total)  # keys in any order: visibility comes from sequence and position
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        out = segment_attention(
            q, k[:, :, order], v[:, :, order], segment, position, segment[order], position[order], scale, block=128
        )
    got = torch.autograd.grad(out, (q, k, v), grad)
    assert (out - reference).abs().max() < 2e-6
    for g, w in zip(got, want):
        assert (g - w).abs().max() < 2e-6
    assert max(saved) <= q.numel() < total * total  # what the backward keeps: inputs, output, one value per query
    half = segment_attention(*(x.detach().bfloat16() for x in (q, k, v)), segment, position, segment, position, scale)
    assert half.dtype == torch.bfloat16 and (half.float() - reference).abs().max() < 0.05
