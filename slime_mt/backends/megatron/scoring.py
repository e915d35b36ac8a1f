"""Packed rows through a ``MegatronModel``: what every role computes with a model, written once.

  score(model, samples, indices, post)                -> per sample: post's outputs, forward only
  forward_backward(model, samples, indices, post, loss) -> each row's loss backpropagated

Both pack the samples into micro-batches (rows of whole sequences within ``--max-tokens-per-micro-batch``
or ``--micro-batch-size``; prefix trees with ``--shared-prefix-training``), attach the engine's routes
(R3), give a context-parallel rank its share of each row and gather the per-token outputs back, split a
row over the TP ranks under sequence parallelism, run pipeline stages through Megatron's schedule (the
outputs on the last stage, sent to the others), and run idle passes where another expert-parallel rank
still has a row (every MoE layer's token exchange is collective).

``post(model, row, hidden)`` turns hidden states into per-token outputs: ``hidden [T, H]`` is the last
stage's (normed) hidden state at each row position that predicts a response token (a CP rank's own, in
row order) -> a tuple of tensors ``[T]`` (None for an output it does not compute). ``LogProbs`` gives
log-probs and entropies without ever building ``[T, V]`` logits (``logprobs.hidden_logprobs``: chunks of
rows); ``Values`` reads a value head. A new head is a new ``post``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from slime_mt.algo.batching import micro_batches_by_count, micro_batches_by_tokens
from slime_mt.backends.megatron.context_parallel import gather_owned
from slime_mt.backends.megatron.logprobs import hidden_logprobs
from slime_mt.backends.megatron.model import MegatronModel
from slime_mt.backends.megatron.moe import (
    count_routes,
    moe_layers,
    replay_counts,
    reset_router_metrics,
    scaled_aux_loss_coefficient,
    set_aux_loss_scale,
)
from slime_mt.backends.megatron.packing import PackedRow, cp_share, pack_row, pack_tree_row, sp_pad, tree_keys
from slime_mt.backends.megatron.pipeline import from_last_stage, run_pipeline
from slime_mt.backends.megatron.prefix_tree import PrefixTrie
from slime_mt.routes import replay_targets
from slime_mt.types import TrainingSample

Outputs = tuple[torch.Tensor | None, ...]  # per-token outputs of one row, each [T]
Post = Callable[[MegatronModel, PackedRow, torch.Tensor], Outputs]
RowLoss = Callable[[PackedRow, Outputs], torch.Tensor]  # a row's loss from its outputs, scaled as it trains


@dataclass(frozen=True)
class LogProbs:
    """Post: (log-probs ``[T]``, entropies ``[T]`` or None) of the response tokens at ``temperature``, in
    fp32; the entropy carries a gradient only with ``entropy_grad`` (an entropy term in the loss)."""

    temperature: float = 1.0
    entropy: bool = False
    entropy_grad: bool = False

    def __call__(self, model: MegatronModel, row: PackedRow, hidden: torch.Tensor) -> Outputs:
        return hidden_logprobs(
            hidden,
            model.module.output_weight(),
            row.targets,
            model.spec.vocab_size,
            self.temperature,
            self.entropy,
            chunk=model.logit_chunk_rows,
            entropy_grad=self.entropy_grad,
        )


@dataclass(frozen=True)
class Values:
    """Post: (values ``[T]``,) in fp32 from the model's value head (``MegatronModel(head=...)``: ``[T, H]`` ->
    ``[T, 1]``), at each position that predicts a response token: the state before that token."""

    def __call__(self, model: MegatronModel, row: PackedRow, hidden: torch.Tensor) -> Outputs:
        return (model.module.head(hidden)[:, 0].float(),)


# ---------------------------------------------------------------- rows


def pack(model: MegatronModel, samples: list[TrainingSample], indices: list[int], replay: bool = True) -> PackedRow:
    """A packed row of ``samples[indices]`` on the model's device (a prefix tree with
    ``--shared-prefix-training``), with the engine's routes under ``--use-rollout-routing-replay``
    unless ``replay`` is False; a CP rank's share of it, or under SP padded for the TP ranks' slices."""
    if model.cfg.shared_prefix_training:
        return pack_tree_row(samples, indices, model.mrope, model.image_token_id).to(model.device)
    row = pack_row(samples, indices, model.mrope, model.layout)
    if model.spec.moe is not None and model.cfg.use_rollout_routing_replay and replay:
        moe, top_k = sum(model.spec.moe.sparse_layers), model.spec.moe.topk
        row.routes = torch.cat(
            [replay_targets(samples[i].routed_experts, n, moe, top_k) for i, n in zip(indices, row.lengths)]
        )
    if model.info.cp_size > 1:  # this rank's share of the row
        tp = model.info.tp_size if model.sequence_parallel else 1
        row = cp_share(row, model.info.cp_size, model.info.cp_rank, model.cp_group(), tp)
    elif model.sequence_parallel:  # each TP rank a slice of the row
        row = sp_pad(row, model.info.tp_size)
    return row.to(model.device)


def micro_batches(model: MegatronModel, samples: list[TrainingSample], indices: list[int]) -> list[list[int]]:
    """``indices`` grouped into packed rows: by the token budget (first-fit decreasing; a prefix tree's
    tokens counted once, in order so a group's samples stay together), else ``--micro-batch-size``."""
    budget = model.cfg.max_tokens_per_micro_batch
    if budget and model.cfg.shared_prefix_training:
        rows: list[list[int]] = []
        trie = PrefixTrie()
        for i in indices:
            seq = samples[i].prompt_ids + samples[i].response_ids
            keys = tree_keys(samples[i], model.image_token_id)
            if not rows or trie.num_nodes + trie.new_tokens(keys) > budget:
                rows.append([])
                trie = PrefixTrie()
            rows[-1].append(i)
            trie.add(seq, keys)
        return rows
    if budget:
        lengths = [len(samples[i].prompt_ids) + len(samples[i].response_ids) for i in indices]
        return [[indices[k] for k in row] for row in micro_batches_by_tokens(lengths, budget)]
    return [[indices[k] for k in row] for row in micro_batches_by_count(len(indices), model.cfg.micro_batch_size)]


def aligned(model: MegatronModel, rows: list[list[int]]) -> list[list[int] | None]:
    """``rows`` padded with None to the largest row count of any rank when experts are split over
    ranks: every MoE layer's token exchange is collective over the expert-parallel group, so every
    rank runs as many forward (and backward) passes as the busiest one."""
    if model.spec.moe is None or model.info.ep_size == 1:
        return list(rows)
    count = torch.tensor([len(rows)], dtype=torch.int64, device=model.device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return list(rows) + [None] * (int(count) - len(rows))


def idle_row(model: MegatronModel) -> PackedRow:
    """One placeholder token pair, packed: a pass that trains nothing (``idle_pass``)."""
    return pack(model, [TrainingSample([0], [0], [0], [0.0], 0.0, "idle/0", -1, True)], [0])


# ---------------------------------------------------------------- one row


def hidden(model: MegatronModel, row: PackedRow) -> torch.Tensor:
    """The row through the model's decoder (this pipeline stage's layers) -> ``[L, 1, H]``."""
    module = model.module
    extra = (
        {"pixel_values": row.pixel_values, "image_grid_thw": row.image_grid_thw, "image_order": row.image_order}
        if model.mrope
        else {}
    )
    # R3: each MoE layer replays the engine's routes of the row (None: its own), until the next
    # forward: a backward that recomputes the layer replays them again
    before = sum(model.spec.moe.sparse_layers[: model.stage.layers.start]) if model.spec.moe else 0
    for k, layer in enumerate(moe_layers(module), start=before):  # k: the MoE layer's index in the decoder
        layer.replay_routes = None if row.routes is None else row.routes[:, k]
        layer.row_padding = row.padding  # context parallel: pad tokens route nowhere that counts
    return module.hidden(row.tokens, row.position_ids, row.attention_mask, row.packed_seq_params, **extra)


def outputs(model: MegatronModel, row: PackedRow, last_hidden: torch.Tensor, post: Post) -> Outputs:
    """``post`` of the row's response tokens from the last stage's ``last_hidden [L, 1, H]``; under
    context parallelism the whole row's, from every CP rank."""
    out = post(model, row, last_hidden[:, 0].index_select(0, row.logit_index))  # from [T, H]
    if row.logit_owner is None:
        return out
    group = model.cp_group()
    return tuple(None if t is None else gather_owned(t, row.logit_owner, group) for t in out)


def row_outputs(model: MegatronModel, row: PackedRow, post: Post) -> Outputs:
    """``post`` of one packed row, forward through the whole decoder (no pipeline stages)."""
    return outputs(model, row, hidden(model, row), post)


def idle_pass(model: MegatronModel, post: Post, backward: bool) -> None:
    """A forward (and backward) pass of the idle row: its first output enters the graph times zero, it
    counts in no router metric, and the load-balancing loss is off for it."""
    row = idle_row(model)
    set_aux_loss_scale(model.spec.moe, 0.0)
    count_routes(model.module, False)
    try:
        out = row_outputs(model, row, post)
        if backward:
            (out[0].sum() * 0.0).backward()
    finally:
        count_routes(model.module, True)


def _stage_hidden(model: MegatronModel, row: PackedRow, idle: PackedRow | None) -> torch.Tensor:
    """``hidden`` of a pipeline micro-batch; the ``idle`` row (expert parallelism: another rank of
    the expert group still has a row) counts in no router metric and has no load-balancing loss."""
    if row is not idle:
        return hidden(model, row)
    count_routes(model.module, False)
    try:
        with scaled_aux_loss_coefficient(model.module, 0.0):  # no load-balancing loss either
            return hidden(model, row)
    finally:
        count_routes(model.module, True)


# ---------------------------------------------------------------- many rows


@torch.no_grad()
def score(
    model: MegatronModel,
    samples: list[TrainingSample],
    indices: list[int] | None,
    post: Post,
    replay: bool = True,
) -> list[Outputs | None]:
    """``post``'s outputs for ``samples[indices]`` (all by default), each ``[len(response)]``, None for
    the samples not asked; nothing is trained and the model is in eval mode meanwhile. ``replay=False``:
    the routers choose their own experts even under ``--use-rollout-routing-replay``."""
    module = model.module
    was_training = module.training
    module.eval()
    out: list[Outputs | None] = [None] * len(samples)
    indices = list(range(len(samples))) if indices is None else indices
    rows = aligned(model, micro_batches(model, samples, indices))
    try:
        if model.info.pp_size > 1:
            _score_stages(model, samples, rows, post, replay, out)
            return out
        for row_indices in rows:
            if row_indices is None:  # another expert-parallel rank still has a row
                idle_pass(model, post, backward=False)
                continue
            row = pack(model, samples, row_indices, replay)
            _split(row, row_outputs(model, row, post), out)
        return out
    finally:
        module.train(was_training)


def _score_stages(model, samples, rows, post, replay, out) -> None:
    """``score``'s rows through the pipeline (forward only); the last stage's outputs on every stage."""
    idle = idle_row(model) if None in rows else None
    packed = [idle if r is None else pack(model, samples, r, replay) for r in rows]

    def on_last_stage(row, last_hidden):  # forward only: no loss
        return last_hidden.new_zeros(()), outputs(model, row, last_hidden, post)

    forward = functools.partial(_stage_hidden, model, idle=idle)
    kept = run_pipeline(model.module, packed, forward, on_last_stage, forward_only=True)
    kept = [tuple(None if t is None else t.cpu() for t in got) for got in kept]
    for row, got in zip(packed, from_last_stage(kept)):
        if row is not idle:
            _split(row, tuple(None if t is None else t.to(model.device) for t in got), out)


def _split(row: PackedRow, got: Outputs, out: list) -> None:
    """A row's outputs -> each of its samples' (by their place in the batch)."""
    for k, i in enumerate(row.sample_index):
        out[i] = tuple(None if t is None else t[row.seq_ids == k] for t in got)


def forward_backward(
    model: MegatronModel, samples: list[TrainingSample], indices: list[int], post: Post, loss: RowLoss
) -> int:
    """Forward and backward of ``samples[indices]`` into the model's gradient buffers (zeroed by the
    caller, finalized by it after): each row's ``loss(row, post's outputs)``, backpropagated as it is ->
    the rows this rank trained (its idle passes not counted). Router metrics and replay counts restart
    here; a CP rank's load-balancing loss is its tokens' share of the row's (Megatron's global-batch
    form), summed over CP as the row's loss is."""
    replay_counts(model.module)  # count this pass's routes only
    reset_router_metrics(model.module)
    rows = aligned(model, micro_batches(model, samples, indices))
    trained = sum(r is not None for r in rows)  # this rank's, without the idle passes
    set_aux_loss_scale(model.spec.moe, model.info.cp_size / max(1, trained))
    if model.info.pp_size > 1:  # the schedule runs the backward from each row's loss on the last stage
        idle = idle_row(model) if None in rows else None

        def on_last_stage(row, last_hidden):
            got = outputs(model, row, last_hidden, post)
            if row is idle:  # trains nothing
                return got[0].sum() * 0.0, None
            return loss(row, got), None

        packed = [idle if r is None else pack(model, samples, r) for r in rows]
        forward = functools.partial(_stage_hidden, model, idle=idle)
        # the schedule sets the load-balancing loss's gradient scale to 1: the coefficient carries it
        with scaled_aux_loss_coefficient(model.module, 1.0 / max(1, trained)):
            run_pipeline(model.module, packed, forward, on_last_stage, False)
        return trained
    for row_indices in rows:
        if row_indices is None:  # another expert-parallel rank still has a row
            idle_pass(model, post, backward=True)
            continue
        row = pack(model, samples, row_indices)
        loss(row, row_outputs(model, row, post)).backward()
    return trained
