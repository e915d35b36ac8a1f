"""Pack several training sequences into one row with a block-diagonal causal mask (the CPU path;
with Transformer Engine on GPU the same sequences could use THD packing instead).

For a row of sequences s_1..s_n laid end to end (``L = sum len(s_i)``): ``tokens [1, L]``,
``position_ids [1, L]`` restarting at 0 per sequence (``[3, 1, L]`` M-RoPE positions for VLMs),
``attention_mask [1, 1, L, L]`` True where attention is NOT allowed (Megatron's convention), and
for the response tokens: the row positions whose logits predict them (``logit_index [T]``), the
targets (``targets [T]``) and the sequence each belongs to (``seq_ids [T]``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slime_mt.types import TrainingSample


@dataclass
class PackedRow:
    tokens: torch.Tensor  # [1, L]
    position_ids: torch.Tensor  # [1, L] or [3, 1, L]
    attention_mask: torch.Tensor  # [1, 1, L, L] bool, True = masked
    logit_index: torch.Tensor  # [T] row position whose logits predict each response token
    targets: torch.Tensor  # [T]
    seq_ids: torch.Tensor  # [T] index into the packed sequences
    sample_index: list[int]  # which TrainingSample each packed sequence is
    lengths: list[int]  # tokens per packed sequence
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None

    @property
    def num_real_tokens(self) -> int:
        return int(self.tokens.shape[1])


def pack_row(samples: list[TrainingSample], indices: list[int], mrope_positions=None) -> PackedRow:
    """Pack ``samples[i] for i in indices`` into one row. ``mrope_positions(sample) -> [3, len]``
    gives M-RoPE positions for VLM sequences (None for text models)."""
    tokens, positions, logit_index, targets, seq_ids, lengths = [], [], [], [], [], []
    pixels, grids = [], []
    offset = 0
    for k, i in enumerate(indices):
        s = samples[i]
        seq = s.prompt_ids + s.response_ids
        n, p, r = len(seq), len(s.prompt_ids), len(s.response_ids)
        if p == 0:
            raise ValueError(f"sample {s.trajectory_id}: empty prompt; the first response token has no context")
        tokens.extend(seq)
        positions.append(mrope_positions(s) if mrope_positions else torch.arange(n).unsqueeze(0))
        logit_index.extend(range(offset + p - 1, offset + p - 1 + r))
        targets.extend(s.response_ids)
        seq_ids.extend([k] * r)
        lengths.append(n)
        if s.multimodal_train_inputs:
            pixels.append(s.multimodal_train_inputs["pixel_values"])
            grids.append(s.multimodal_train_inputs["image_grid_thw"])
        offset += n
    mask = torch.ones(offset, offset, dtype=torch.bool)
    start = 0
    for n in lengths:
        mask[start:start + n, start:start + n] = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)
        start += n
    position_ids = torch.cat(positions, dim=-1)  # [1, L] or [3, L]
    position_ids = position_ids.unsqueeze(1) if mrope_positions else position_ids
    return PackedRow(
        tokens=torch.tensor([tokens]), position_ids=position_ids, attention_mask=mask[None, None],
        logit_index=torch.tensor(logit_index, dtype=torch.long), targets=torch.tensor(targets, dtype=torch.long),
        seq_ids=torch.tensor(seq_ids, dtype=torch.long), sample_index=list(indices), lengths=lengths,
        pixel_values=torch.cat(pixels) if pixels else None, image_grid_thw=torch.cat(grids) if grids else None)


def padding_efficiency(lengths: list[int], rows: list[list[int]], row_capacity: int) -> float:
    """Real tokens / processed tokens when each row is processed at ``row_capacity`` tokens."""
    return sum(lengths) / max(len(rows) * row_capacity, 1)
