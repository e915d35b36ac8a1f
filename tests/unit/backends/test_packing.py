"""Packed rows under sequence parallelism (unit tier, <1 s): a row padded to split over the TP ranks
keeps every real token's place, position, logit row and route, its padding one more sequence of each
attention layout (so the real tokens attend exactly as before), and a CP share pads to 2 x CP x TP.
The trainer under SP on real TP ranks: tests/integration/backends/test_sequence_parallel.py."""

import pytest
import torch

from slime_mt.backends.megatron.layouts import Segments, segments_attention
from slime_mt.backends.megatron.packing import cp_share, pack_row, sp_pad
from slime_mt.types import TrainingSample


def _samples(shapes):
    return [
        TrainingSample(list(range(1, p + 1)), [7] * r, [1] * r, [-1.0] * r, 0.0, f"{i}/0", i, True)
        for i, (p, r) in enumerate(shapes)
    ]


SAMPLES = _samples([(4, 3), (2, 2)])  # 11 tokens


@pytest.mark.parametrize("layout", ["segments", "dense", "thd"])
def test_a_row_pads_to_a_multiple_of_tp_with_one_more_sequence(layout):
    row = pack_row(SAMPLES, [0, 1], layout=layout)
    row.routes = torch.arange(11 * 2 * 2).reshape(11, 2, 2)
    padded = sp_pad(row, 4)
    assert padded.num_real_tokens == 12 and padded.pad == 1 and padded.lengths == row.lengths == [7, 4]
    assert torch.equal(padded.tokens[:, :11], row.tokens) and torch.equal(padded.position_ids[:, :11], row.position_ids)
    assert torch.equal(padded.logit_index, row.logit_index) and torch.equal(padded.targets, row.targets)
    assert padded.padding.tolist() == [False] * 11 + [True]
    assert torch.equal(padded.routes[:11], row.routes) and (padded.routes[11] == -1).all()
    if layout == "segments":
        assert padded.attention_mask == Segments((7, 4, 1))
    elif layout == "dense":
        mask = padded.attention_mask[0, 0]
        assert torch.equal(mask[:11, :11], row.attention_mask[0, 0]) and mask[11, :11].all() and not mask[11, 11]
    else:
        assert padded.packed_seq_params.cu_seqlens_q.tolist() == [0, 7, 11, 12]
        assert padded.to(torch.device("cpu")).packed_seq_params.cu_seqlens_q.tolist() == [0, 7, 11, 12]
    assert sp_pad(row, 11) is row  # already splits


def test_the_real_tokens_attend_as_in_the_unpadded_row():
    torch.manual_seed(0)
    row = pack_row(SAMPLES, [0, 1])
    padded = sp_pad(row, 4)
    q, k, v = (torch.randn(1, 2, 12, 8) for _ in range(3))
    whole = segments_attention(q, k, v, padded.attention_mask, 8**-0.5)
    real = segments_attention(q[:, :, :11], k[:, :, :11], v[:, :, :11], row.attention_mask, 8**-0.5)
    assert torch.allclose(whole[:, :, :11], real, atol=1e-6)


def test_a_vlm_rows_3d_positions_pad_and_a_prefix_tree_is_refused():
    row = pack_row(
        SAMPLES, [0, 1], mrope_positions=lambda s: torch.arange(len(s.prompt_ids + s.response_ids)).expand(3, -1)
    )
    assert sp_pad(row, 4).position_ids.shape == (3, 1, 12)
    row.attention_mask = object()
    with pytest.raises(ValueError, match="sequence parallelism pads flat packed rows, not a object layout"):
        sp_pad(row, 4)


def test_a_cp_share_under_sequence_parallelism_pads_to_2_cp_tp():
    row = pack_row(SAMPLES, [0, 1])
    for tp, padded in ((1, 12), (2, 16), (4, 16)):
        shares = [cp_share(row, 2, r, group=None, tp=tp) for r in range(2)]
        assert all(s.num_real_tokens == padded and len(s.padding) == padded // 2 for s in shares)
        assert (padded // 2) % tp == 0  # each CP rank's share splits over the TP ranks
        assert sum(int((~s.padding).sum()) for s in shares) == 11
