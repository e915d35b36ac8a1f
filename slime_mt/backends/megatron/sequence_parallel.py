"""Sequence parallelism (``--sequence-parallel``, Megatron's): under TP > 1, what every TP rank would
compute alike on the whole row (the norms, the residual stream, the MLP's and attention's inputs) is
split along the sequence, each TP rank holding ``1 / tp`` of the row's tokens between the
tensor-parallel regions. Megatron's layers do the exchanges: a column-parallel projection all-gathers
its input's sequence, a row-parallel one reduce-scatters its output (instead of an all-reduce).

How this trainer runs it (``TextPolicy.hidden``): the row is embedded whole (the vision tower's
embeddings merged, the CP rank's share selected), then split over the TP group
(``scatter_sequence``); the decoder runs on the slice, and its final hidden states are gathered back
(``gather_sequence``) for the log-probs, which every TP rank computes over its vocabulary slice of
every row. The gather's backward keeps this rank's slice of a gradient the log-prob path already
summed over the TP group. Under SP the packed row is padded to a multiple of the TP size (``2 cp tp``
with context parallelism), the padding one more sequence that scores nothing.

Parameters that see only their rank's tokens get a partial gradient on each TP rank, which
``finalize_model_grads`` sums over the TP group for those marked ``sequence_parallel``: the norms
(``SequenceParallelNorm`` on the local spec; Transformer Engine's norms mark themselves) and the
MoE routers.
"""

from __future__ import annotations

import torch


class SequenceParallelNorm(torch.nn.RMSNorm):
    """The local layer spec's RMSNorm (Megatron's ``WrappedTorchNorm``, which refuses sequence
    parallelism) for a layer that may see one TP rank's slice of the sequence: its weight is marked
    ``sequence_parallel`` so that its partial gradients are summed over the TP group."""

    def __init__(
        self,
        config,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "RMSNorm",
    ):
        if config.normalization != "RMSNorm" or config.layernorm_zero_centered_gamma:
            raise ValueError(f"{config.normalization} (zero-centred: {config.layernorm_zero_centered_gamma}): RMSNorm")
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


def use_sequence_parallel_norms(layers: list) -> None:
    """Give the local layer specs ``layers`` (in place) ``SequenceParallelNorm`` wherever they hold
    Megatron's torch norm: the layer's two and the attention's q/k norms (these see the gathered
    sequence, but Megatron's torch norm refuses a config with sequence parallelism)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    for layer in layers:
        sub = layer.submodules
        for owner, name in (
            (sub, "input_layernorm"),
            (sub, "pre_mlp_layernorm"),
            (sub.self_attention.submodules, "q_layernorm"),
            (sub.self_attention.submodules, "k_layernorm"),
        ):
            if getattr(owner, name, None) is WrappedTorchNorm:
                setattr(owner, name, SequenceParallelNorm)


def _tp_group():
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def scatter_sequence(hidden: torch.Tensor) -> torch.Tensor:
    """``[L, B, H]`` -> this TP rank's slice ``[L / tp, B, H]`` (backward: the slices all-gathered)."""
    from megatron.core.tensor_parallel.mappings import scatter_to_sequence_parallel_region

    return scatter_to_sequence_parallel_region(hidden, group=_tp_group())


def gather_sequence(hidden: torch.Tensor) -> torch.Tensor:
    """This TP rank's slice ``[L / tp, B, H]`` -> the row ``[L, B, H]``; backward: this rank's slice
    of the gradient, which the log-prob path has already summed over the TP group."""
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    return gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False, group=_tp_group())


def sequence_slice(length: int) -> tuple[int, int]:
    """(first row position, count) of this TP rank's slice of a row of ``length`` tokens (a multiple
    of the TP size)."""
    group = _tp_group()
    tp = group.size()
    if length % tp:
        raise ValueError(f"a row of {length} tokens does not split over {tp} TP ranks")
    return group.rank() * (length // tp), length // tp
