"""Pipeline parallelism: packed rows through Megatron's schedules (``forward_backward_func``).

Each stage runs its layers on every micro-batch (one packed row each); the rows differ in length, so
their shapes travel with them (``variable_seq_lengths``). The last stage turns its output into what the
caller asks of a row (``on_last_stage``: log-probs, a loss); the schedule runs the backward from that
loss through every stage, 1F1B. Tied embeddings: the first stage's embedding and the last stage's copy
of it as the output layer get the sum of both gradients from Megatron's ``finalize_model_grads``
(the actor's step).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# on_last_stage(row, hidden) -> (loss, what the caller keeps of the row): hidden is the last stage's
# output [L, 1, H] (normed); the loss is backpropagated as it is (no averaging over micro-batches)
OnLastStage = Callable[[Any, torch.Tensor], tuple[torch.Tensor, Any]]


def run_pipeline(
    model, rows: list, forward: Callable[[Any], torch.Tensor], on_last_stage: OnLastStage, forward_only: bool
) -> list:
    """``rows`` (packed rows, the same on every stage) through the pipeline, one micro-batch each:
    ``forward(row)`` runs this stage's layers (``model.hidden``), ``on_last_stage`` turns the last
    stage's output into a loss and what to keep -> on the last stage, what it kept of each row, in
    order; on the others, []."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    kept: list = []

    def forward_step(data_iterator, module):
        row = next(data_iterator)
        hidden = forward(row)

        def loss_func(output: torch.Tensor):
            loss, keep = on_last_stage(row, output)
            kept.append(keep)
            # (loss, tokens, reduced): with calculate_per_token_loss the schedule scales nothing
            return loss, torch.ones((), dtype=torch.int, device=loss.device), {}

        return hidden, loss_func

    config = model.config
    per_token = config.calculate_per_token_loss
    config.calculate_per_token_loss = True
    try:
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(rows),
            model=[model],
            num_microbatches=len(rows),
            seq_length=max(int(row.tokens.shape[-1]) for row in rows),
            micro_batch_size=1,
            forward_only=forward_only,
        )
    finally:
        config.calculate_per_token_loss = per_token
    return kept


def from_last_stage(value: Any) -> Any:
    """The last pipeline stage's ``value`` (tensors and numbers in lists and dicts) on every stage of
    this rank's pipeline; the other stages pass what they have (ignored)."""
    from megatron.core import parallel_state

    box = [value]
    torch.distributed.broadcast_object_list(
        box,
        src=parallel_state.get_pipeline_model_parallel_last_rank(),
        group=parallel_state.get_pipeline_model_parallel_group(),
    )
    return box[0]


def every_stage(value: Any) -> list:
    """Every stage's ``value`` of this rank's pipeline, in stage order (collective over it)."""
    from megatron.core import parallel_state

    out: list = [None] * parallel_state.get_pipeline_model_parallel_world_size()
    torch.distributed.all_gather_object(out, value, group=parallel_state.get_pipeline_model_parallel_group())
    return out
