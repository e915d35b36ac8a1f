"""Pack several training sequences into one row.

For a row of sequences s_1..s_n laid end to end (``L = sum len(s_i)``): ``tokens [1, L]``,
``position_ids [1, L]`` restarting at 0 per sequence (``[3, 1, L]`` M-RoPE positions for VLMs), and
for the response tokens: the row positions whose logits predict them (``logit_index [T]``), the
targets (``targets [T]``) and the sequence each belongs to (``seq_ids [T]``).

Sequences are isolated in one of three ways (``layout``):
  ``thd``       Transformer Engine's THD packing (``packed_seq_params``: cumulative lengths, the kernel
                restarts causality per sequence);
  ``segments``  ``attention.Segments(lengths)`` in place of the mask, for ``FusedCoreAttention``: one
                fused causal kernel per sequence, no ``[L, L]`` tensor at all;
  ``dense``     a block-diagonal causal mask ``attention_mask [1, 1, L, L]`` (True where attention is
                NOT allowed, Megatron's convention) for Megatron's ``DotProductAttention``, whose cost
                grows with L^2 while only ``useful_attention_fraction`` of its entries are inside a
                sequence.

``pack_tree_row`` packs the sequences as a prefix tree instead (``prefix_tree.py``): the row is the
trie's nodes, each shared token once, with its ``attention.Tree`` layout (every node sees its
ancestors; no ``[N, N]`` tensor) and each node's position; the response tokens are gathered per
path, so log-probs equal the flat row's.

``cp_share`` gives a context-parallel rank its share of a flat row (``context_parallel.py``).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import torch

from slime_mt.backends.megatron.context_parallel import ContextParallelSegments, padded_length, zigzag_index
from slime_mt.backends.megatron.layouts import Segments, Tree
from slime_mt.backends.megatron.prefix_tree import build_tree
from slime_mt.types import TrainingSample


@dataclass
class PackedRow:
    tokens: torch.Tensor  # [1, L]
    position_ids: torch.Tensor  # [1, L] or [3, 1, L]
    attention_mask: (
        torch.Tensor | Segments | Tree | None
    )  # dense [1, 1, L, L] bool (True = masked), a layout, or None (THD)
    logit_index: torch.Tensor  # [T] row position whose logits predict each response token
    targets: torch.Tensor  # [T]
    seq_ids: torch.Tensor  # [T] index into the packed sequences
    sample_index: list[int]  # which TrainingSample each packed sequence is
    lengths: list[int]  # tokens per packed sequence
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    packed_seq_params: object | None = None  # megatron PackedSeqParams (THD) with Transformer Engine
    image_order: list[int] | None = None  # prefix trees: the image (of pixel_values') of each pad run, in row order
    routes: torch.Tensor | None = None  # R3: [L, moe_layers, top_k] int64, -1 where the router decides
    # context parallel (``cp_share``): the CP rank holding each response token's logit row; logit_index
    # and targets are then this rank's, in row order, and tokens and positions stay the whole row's
    logit_owner: torch.Tensor | None = None
    padding: torch.Tensor | None = None  # [L / cp] bool: this rank's tokens that only pad the row
    pad: int = 0  # tokens after the sequences that pad a flat row (``sp_pad``): one more sequence in its layout

    @property
    def num_real_tokens(self) -> int:
        return int(self.tokens.shape[1])

    def to(self, device: torch.device) -> PackedRow:
        """The row's tensors on ``device`` (the trainer's one device); index bookkeeping stays."""

        def move(t):
            return None if t is None else t.to(device, non_blocking=True)

        params = self.packed_seq_params
        if params is not None:
            params = _thd_params([*self.lengths, self.pad] if self.pad else self.lengths, device)
        return PackedRow(
            move(self.tokens),
            move(self.position_ids),
            move(self.attention_mask),
            move(self.logit_index),
            move(self.targets),
            move(self.seq_ids),
            self.sample_index,
            self.lengths,
            move(self.pixel_values),
            move(self.image_grid_thw),
            params,
            self.image_order,
            move(self.routes),
            move(self.logit_owner),
            move(self.padding),
            self.pad,
        )


def _thd_params(lengths: list[int], device: torch.device | None = None):
    """Megatron's PackedSeqParams for THD packing of sequences of ``lengths``."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
    longest = max(lengths)
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
    )


LAYOUTS = ("segments", "dense", "thd")


def pack_row(
    samples: list[TrainingSample], indices: list[int], mrope_positions=None, layout: str = "segments"
) -> PackedRow:
    """Pack ``samples[i] for i in indices`` into one row (on the CPU; ``PackedRow.to`` moves it).
    ``mrope_positions(sample) -> [3, len]`` gives M-RoPE positions for VLM sequences (None for text
    models). ``layout``: how sequences are isolated (module docstring)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: use one of {LAYOUTS}")
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
        positions.append(mrope_positions(s) if mrope_positions else torch.arange(n, device="cpu").unsqueeze(0))
        logit_index.extend(range(offset + p - 1, offset + p - 1 + r))
        targets.extend(s.response_ids)
        seq_ids.extend([k] * r)
        lengths.append(n)
        if s.multimodal_train_inputs:
            pixels.append(s.multimodal_train_inputs["pixel_values"])
            grids.append(s.multimodal_train_inputs["image_grid_thw"])
        offset += n
    mask = (
        Segments(tuple(lengths))
        if layout == "segments"
        else block_causal_mask(lengths)[None, None]
        if layout == "dense"
        else None
    )
    position_ids = torch.cat(positions, dim=-1)  # [1, L] or [3, L]
    position_ids = position_ids.unsqueeze(1) if mrope_positions else position_ids
    return PackedRow(
        tokens=torch.tensor([tokens], device="cpu"),
        position_ids=position_ids,
        attention_mask=mask,
        logit_index=torch.tensor(logit_index, dtype=torch.long, device="cpu"),
        targets=torch.tensor(targets, dtype=torch.long, device="cpu"),
        seq_ids=torch.tensor(seq_ids, dtype=torch.long, device="cpu"),
        sample_index=list(indices),
        lengths=lengths,
        pixel_values=torch.cat(pixels) if pixels else None,
        image_grid_thw=torch.cat(grids) if grids else None,
        packed_seq_params=_thd_params(lengths) if layout == "thd" else None,
    )


def _padded_tail(row: PackedRow, pad: int) -> dict:
    """The row's tokens, positions and routes with ``pad`` tokens after them (token 0, position 0, -1
    routes: the router decides, and the padding counts nowhere)."""
    routes = None if row.routes is None else torch.nn.functional.pad(row.routes, (0, 0, 0, 0, 0, pad), value=-1)
    return dict(
        tokens=torch.nn.functional.pad(row.tokens, (0, pad)),
        position_ids=torch.nn.functional.pad(row.position_ids, (0, pad)),
        routes=routes,
    )


def sp_pad(row: PackedRow, tp: int) -> PackedRow:
    """A flat packed ``row`` padded to a multiple of the TP size for sequence parallelism (each TP rank
    a slice of it): the padding one more sequence of its layout, which no logit row reads, routed
    nowhere that counts (``padding``)."""
    length = row.num_real_tokens
    pad = -length % tp
    if pad == 0:
        return row
    lengths = [*row.lengths, pad]
    mask = row.attention_mask
    if isinstance(mask, Segments):
        mask = Segments(tuple(lengths))
    elif isinstance(mask, torch.Tensor):  # dense
        mask = block_causal_mask(lengths)[None, None]
    elif mask is not None:
        raise ValueError(f"sequence parallelism pads flat packed rows, not a {type(mask).__name__} layout")
    return dataclasses.replace(
        row,
        **_padded_tail(row, pad),
        attention_mask=mask,
        packed_seq_params=None if row.packed_seq_params is None else _thd_params(lengths),
        padding=torch.arange(length + pad, device="cpu") >= length,
        pad=pad,
    )


def cp_share(row: PackedRow, cp: int, rank: int, group, tp: int = 1) -> PackedRow:
    """CP rank ``rank``'s share of a flat packed ``row`` (``context_parallel.py``): the row padded to
    a multiple of ``2 * cp`` (``2 * cp * tp`` under sequence parallelism: each CP rank's share splits
    over the TP ranks; the padding one more sequence), its layout, the logit rows this rank holds (the
    others' are gathered after the log-probs) and its tokens' routes; the tokens and positions stay
    the whole row's (the policy embeds the row, then keeps this rank's tokens)."""
    length = row.num_real_tokens
    padded = padded_length(length, cp * tp)
    pad = padded - length
    layout = ContextParallelSegments.of(row.lengths, padded, cp, rank, group)
    owner = torch.zeros(padded, dtype=torch.long, device="cpu")
    local = torch.zeros(padded, dtype=torch.long, device="cpu")
    for r in range(cp):
        held = zigzag_index(padded, cp, r)
        owner[held] = r
        local[held] = torch.arange(len(held), device="cpu")
    logit_owner = owner[row.logit_index]
    mine = logit_owner == rank
    tail = _padded_tail(row, pad)
    if tail["routes"] is not None:  # this rank's tokens' routes
        tail["routes"] = tail["routes"][layout.query_position]
    return dataclasses.replace(
        row,
        **tail,
        attention_mask=layout,
        logit_index=local[row.logit_index[mine]],
        targets=row.targets[mine],
        logit_owner=logit_owner,
        padding=layout.query_padding,
    )


def block_causal_mask(lengths: list[int]) -> torch.Tensor:
    """``[L, L]`` bool, True where attention is not allowed: causal inside each sequence, nothing across."""
    total = sum(lengths)
    mask = torch.ones(total, total, dtype=torch.bool, device="cpu")
    start = 0
    for n in lengths:
        mask[start : start + n, start : start + n] = torch.triu(
            torch.ones(n, n, dtype=torch.bool, device="cpu"), diagonal=1
        )
        start += n
    return mask


def padding_efficiency(lengths: list[int], rows: list[list[int]], row_capacity: int) -> float:
    """Real tokens / processed tokens when each row is processed at ``row_capacity`` tokens."""
    return sum(lengths) / max(len(rows) * row_capacity, 1)


def useful_attention_fraction(lengths: list[int], rows: list[list[int]]) -> float:
    """Of the ``L x L`` score entries a dense block-diagonal mask makes each row compute, the fraction
    inside a sequence (``sum n_i^2 / L^2`` per row; a causal kernel needs about half of those). THD
    packing computes only those."""
    inside = sum(lengths[i] ** 2 for row in rows for i in row)
    computed = sum(sum(lengths[i] for i in row) ** 2 for row in rows)
    return inside / max(computed, 1)


def tree_keys(sample: TrainingSample, image_token_id: int | None = None) -> list:
    """What each token of ``sample`` must equal to share a trie node: its id, or for an image pad
    ``("image", digest, offset)``, the image's content digest and the pad's offset in it (equal images
    at equal places share)."""
    return _keys(sample, _images(sample, image_token_id), image_token_id)


def _keys(sample: TrainingSample, images: list, image_token_id: int | None) -> list:
    """``tree_keys`` given the sample's ``_images``."""
    seq = sample.prompt_ids + sample.response_ids
    if not images:
        return seq
    keys, image, offset = [], 0, 0
    for token in seq:
        if token != image_token_id:
            keys.append(token)
            continue
        if image >= len(images):
            raise ValueError(f"sample {sample.trajectory_id}: more image pad tokens than its images have")
        keys.append(("image", images[image][0], offset))
        offset += 1
        if offset == images[image][1]:
            image, offset = image + 1, 0
    if image != len(images):
        raise ValueError(f"sample {sample.trajectory_id}: {len(images)} images but pads for {image}")
    return keys


def _images(sample: TrainingSample, image_token_id: int | None) -> list[tuple[str, int, torch.Tensor, torch.Tensor]]:
    """Per image of ``sample``: (content digest, pad tokens, its pixel rows, its grid ``[1, 3]``)."""
    import hashlib

    inputs = sample.multimodal_train_inputs
    if not inputs or image_token_id is None:
        return []
    pixels, grid = inputs["pixel_values"], inputs["image_grid_thw"]
    patches = [int(g.prod()) for g in grid]
    pads = sum(1 for t in sample.prompt_ids + sample.response_ids if t == image_token_id)
    if sum(patches) != pixels.shape[0]:
        raise ValueError(
            f"sample {sample.trajectory_id}: the grids give {sum(patches)} patches, the pixels "
            f"have {pixels.shape[0]} rows"
        )
    if not pads or sum(patches) % pads:
        raise ValueError(f"sample {sample.trajectory_id}: {pads} image pad tokens for {sum(patches)} patches")
    merge = sum(patches) // pads  # patches per pad token (the spatial merge size squared)
    out = []
    for rows, g in zip(pixels.split(patches), grid):
        digest = hashlib.sha256(
            rows.detach().cpu().contiguous().numpy().tobytes() + str(g.tolist()).encode()
        ).hexdigest()
        out.append((digest, int(g.prod()) // merge, rows, g[None]))
    return out


def pack_tree_row(
    samples: list[TrainingSample], indices: list[int], mrope_positions=None, image_token_id: int | None = None
) -> PackedRow:
    """``samples[indices]`` as one prefix-tree row: tokens and positions of the trie's nodes
    (``mrope_positions(sample) -> [3, len]`` for VLMs, computed per sequence), the tree layout, per
    sequence the nodes whose logits predict its response tokens, and each distinct image once:
    ``pixel_values`` / ``image_grid_thw`` of the unique images, ``image_order`` the unique image of
    each pad run of the row, in row order."""
    batch = [samples[i] for i in indices]
    for s in batch:
        if not s.prompt_ids:
            raise ValueError(f"sample {s.trajectory_id}: empty prompt; the first response token has no context")
        if s.multimodal_train_inputs and (mrope_positions is None or image_token_id is None):
            raise ValueError(f"sample {s.trajectory_id}: image inputs need a VLM policy (M-RoPE positions)")
    positions = None
    if mrope_positions is not None:
        positions = [[tuple(p) for p in mrope_positions(s).T.tolist()] for s in batch]
    images = [_images(s, image_token_id) for s in batch]  # each image hashed once per row
    keys = [_keys(s, im, image_token_id) for s, im in zip(batch, images)]
    tree = build_tree([s.prompt_ids + s.response_ids for s in batch], keys=keys, positions=positions)
    logit_index, targets, seq_ids = [], [], []
    for k, s in enumerate(batch):
        p, r = len(s.prompt_ids), len(s.response_ids)
        logit_index.extend(tree.logit_nodes(k, p, p + r))
        targets.extend(s.response_ids)
        seq_ids.extend([k] * r)
    pixels, grids, order = _unique_images(tree, keys, images)
    if mrope_positions is not None:
        position_ids = torch.tensor(tree.positions, dtype=torch.long, device="cpu").T.unsqueeze(1)  # [3, 1, N]
    else:
        position_ids = torch.tensor([tree.positions], dtype=torch.long, device="cpu")
    return PackedRow(
        tokens=torch.tensor([tree.tokens], device="cpu"),
        position_ids=position_ids,
        attention_mask=Tree(tuple(tree.parents)),
        logit_index=torch.tensor(logit_index, dtype=torch.long, device="cpu"),
        targets=torch.tensor(targets, dtype=torch.long, device="cpu"),
        seq_ids=torch.tensor(seq_ids, dtype=torch.long, device="cpu"),
        sample_index=list(indices),
        lengths=[len(s.prompt_ids) + len(s.response_ids) for s in batch],
        pixel_values=torch.cat(pixels) if pixels else None,
        image_grid_thw=torch.cat(grids) if grids else None,
        image_order=order,
    )


def _unique_images(tree, keys: list[list], images: list[list]):
    """(pixel rows and grids of the row's distinct images, first seen first; per pad run of the row,
    in row order, the index of its image among them). ``keys`` / ``images``: per sequence of the
    tree, its ``_keys`` and ``_images``."""
    if not any(images):
        return [], [], None
    run_image = {}  # the node of a run's first pad -> (digest, pixels, grid)
    for seq_keys, seq_images, path in zip(keys, images, tree.paths):
        pictures = {digest: (rows, grid) for digest, _, rows, grid in seq_images}
        for k, key in enumerate(seq_keys):
            if isinstance(key, tuple) and key[2] == 0:  # an image's first pad
                run_image[path[k]] = (key[1], *pictures[key[1]])
    unique, pixels, grids, order = {}, [], [], []
    for node in sorted(run_image):  # nodes are numbered in row (depth-first) order
        digest, rows, grid = run_image[node]
        if digest not in unique:
            unique[digest] = len(unique)
            pixels.append(rows)
            grids.append(grid)
        order.append(unique[digest])
    return pixels, grids, order
