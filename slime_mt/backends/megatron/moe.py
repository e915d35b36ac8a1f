"""Megatron's MoE layer as this trainer runs it: under tensor parallelism with or without sequence
parallelism.

Megatron's token dispatchers assume that, under TP, each TP rank holds a different slice of the
sequence (sequence parallelism), and its MoE layer refuses to train otherwise. Under
``--sequence-parallel`` the decoder hands each MoE layer this TP rank's slice already. Without it this
trainer keeps whole rows on every TP rank, so an MoE layer under TP > 1 is ``SequenceShardedMoE``: it
takes this TP rank's slice of the tokens (the row padded to a multiple of the TP size; pad tokens are
masked out of the load-balancing statistics), runs Megatron's layer with sequence parallelism on, and
gathers the slices back. The all-gather dispatcher exchanges equal token counts over the
expert-parallel group, so under EP > 1 the layer also pads its slice to the longest of the group's
(one all-reduce of a length per layer); the dense layers never see that padding.
Its backward gives every TP rank the full gradient of its input, as the dense layers' column-parallel
inputs expect. Parameters that see only their rank's tokens (the router) get a partial gradient on
each TP rank: ``sum_sequence_sharded_grads`` sums them over the TP group after ``finalize_model_grads``
(which sums them itself under ``--sequence-parallel``).

Rollout routing replay (R3, ``--use-rollout-routing-replay``): before every forward pass the trainer
gives each MoE layer the engine's routes of the packed row or None (``replay_routes``, ``[L, top_k]``,
-1 where the engine routed nothing); the layer slices them as it slices the tokens, and its router's ``RouteReplay``
(Megatron's ``router_replay`` hook) takes those experts instead of its own top k, weighting them by
its own scores (softmax over the chosen logits), and counts the (token, layer) routes where its own
choice differs.
"""

from __future__ import annotations

import contextlib
import copy
import logging

import torch
import torch.nn.functional as F

from slime_mt.backends.megatron.parallel import current_device
from slime_mt.backends.megatron.recompute import in_backward


class RouteReplay:
    """A router's replay hook (the interface of Megatron's ``RouterReplay.get_replay_topk``, without
    its global registry): the engine's experts where ``target`` has them, the router's own elsewhere."""

    def __init__(self):
        self.target: torch.Tensor | None = None  # [tokens, top_k] int64, -1: route it yourself
        self.routes = 0  # (token, layer) routes compared since the last reset
        self.mismatched = 0  # of which the router's own top k differed
        self.chosen: list[torch.Tensor] | None = None  # a list: every forward's chosen experts are kept (inspection)
        self.valid: torch.Tensor | None = None  # [tokens] bool of the coming forward (None: all; pads are not)
        self.load: torch.Tensor | None = None  # [experts] tokens routed to each since the last reset
        self.counting = True  # False during a pass that trains nothing (an idle pass)

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        values, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.target is None:
            self._count(own, scores.shape[1])
            return values, own
        target = self.target.to(device=scores.device)
        known = (target >= 0).all(dim=-1)  # [tokens]
        if bool(known.any()) and self.counting and not in_backward():
            differs = (own.sort(dim=-1).values != target.sort(dim=-1).values).any(dim=-1) & known
            self.routes += int(known.sum())
            self.mismatched += int(differs.sum())
        chosen = torch.where(known.unsqueeze(-1), target, own)
        self._count(chosen, scores.shape[1])
        return scores.gather(1, chosen), chosen

    def _count(self, chosen: torch.Tensor, experts: int) -> None:
        """Keep what inspection asked for, and add the real tokens' experts to the load (not again when
        the backward pass recomputes the layer)."""
        if in_backward():
            return
        if self.chosen is not None:
            self.chosen.append(chosen.detach().cpu())
        if not self.counting:
            return
        real = chosen if self.valid is None else chosen[self.valid.to(chosen.device)]
        counts = torch.bincount(real.reshape(-1), minlength=experts).to(torch.float64)
        self.load = counts if self.load is None else self.load + counts


def _sharded_moe_class():
    from megatron.core.tensor_parallel.mappings import (
        gather_from_sequence_parallel_region,
        scatter_to_sequence_parallel_region,
    )
    from megatron.core.transformer.moe.moe_layer import MoELayer

    class SequenceShardedMoE(MoELayer):
        """``MoELayer`` on this TP rank's share of the tokens, the row padded to a length every rank
        of the expert-parallel group shares when the dispatcher needs one (see the module docstring)."""

        def __init__(self, config, submodules=None, layer_number=None, pg_collection=None):
            self.sliced_input = config.sequence_parallel  # the model runs SP: its input is this rank's slice
            if config.tensor_model_parallel_size > 1:  # the layer and its router/dispatcher/experts see SP
                config = copy.copy(config)
                config.sequence_parallel = True
            super().__init__(config, submodules, layer_number=layer_number, pg_collection=pg_collection)
            self.router.router_replay = RouteReplay()
            self.replay_routes: torch.Tensor | None = None  # R3: [L, top_k] of the next forward's row
            self.row_padding: torch.Tensor | None = None  # [L] True for tokens that only pad the row (CP)

        def forward(self, hidden_states: torch.Tensor, intermediate_tensors=None, padding_mask=None):
            if padding_mask is None and self.row_padding is not None:  # out of the load and its loss
                padding_mask = self.row_padding[None, :]
            group = self.attn_tp_group
            tp = group.size()
            # this rank routes ``share`` tokens: the row's [start, start + count), then padding
            length = hidden_states.shape[0]
            share = length if self.sliced_input else (length + (-length) % tp) // tp
            if self.config.moe_token_dispatcher_type == "allgather" and self.ep_group.size() > 1:
                agreed = torch.tensor([share], dtype=torch.int64, device=hidden_states.device)
                torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX, group=self.ep_group)
                share = int(agreed)
            if self.sliced_input:  # sequence parallel: the model gave this rank its slice of the row
                start, count = group.rank() * length, length
                pad = share - length
                local = F.pad(hidden_states, (0, 0, 0, 0, 0, pad)) if pad else hidden_states
            else:
                start = group.rank() * share
                count = max(0, min(share, length - start))
                pad = share * tp - length
                full = F.pad(hidden_states, (0, 0, 0, 0, 0, pad)) if pad else hidden_states
                local = scatter_to_sequence_parallel_region(full, group=group) if tp > 1 else full
            valid = torch.zeros(local.shape[1], share, dtype=torch.bool, device=local.device)
            valid[:, :count] = True
            if padding_mask is not None:  # Megatron's: [batch, seq], True for a pad token
                valid[:, :count] &= ~padding_mask[:, start : start + count].bool()
            local_pad = ~valid if pad or padding_mask is not None else None
            # the row's routes, padded and sliced as its tokens are; kept after the pass, for a backward
            # that recomputes the layer (``recompute.py``), until the next forward sets its own
            replay = self.router.router_replay
            replay.target = None
            if self.replay_routes is not None:
                routes = self.replay_routes[start : start + count]
                replay.target = F.pad(routes, (0, 0, 0, share - count), value=-1)
            replay.valid = None if local_pad is None else ~local_pad.reshape(-1)
            output, bias = super().forward(local, padding_mask=local_pad)
            if self.sliced_input:
                return output[:length], bias
            if tp > 1:
                output = gather_from_sequence_parallel_region(output, tensor_parallel_output_grad=False, group=group)
            return output[:length], bias

    return SequenceShardedMoE


class _OwnMoeLayer(logging.Filter):
    """Megatron's TransformerLayer passes ``pg_collection`` to the MLP classes it knows and warns
    about any other; ``SequenceShardedMoE`` takes the default process groups, which are the same."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Unknown MLP type" not in record.getMessage()


def shard_moe_layers(layers: list, config) -> None:
    """Give the MoE layers of a block spec ``SequenceShardedMoE`` (in place): it shards tokens under
    TP > 1, pads for the all-gather dispatcher under EP > 1 (it exchanges equal token counts only;
    packed rows differ in length from rank to rank), and replays routes (R3); otherwise it is
    Megatron's layer as is."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    logging.getLogger("megatron.core.transformer.transformer_layer").addFilter(_OwnMoeLayer())
    sharded = _sharded_moe_class()
    for layer in layers:
        mlp = layer.submodules.mlp
        if getattr(mlp, "module", None) is MoELayer:
            layer.submodules.mlp = copy.copy(mlp)
            layer.submodules.mlp.module = sharded


def moe_layers(model: torch.nn.Module) -> list:
    """The MoE layers of a decoder, in order (``SequenceShardedMoE`` modules)."""
    return [m for m in model.modules() if hasattr(m, "replay_routes")]


def router_metrics(model: torch.nn.Module, micro_batches: int, device: torch.device) -> dict[str, float]:
    """The routers users watch, over the training passes since the last ``reset_router_metrics`` and
    every rank (collective): per MoE layer the busiest expert's load over the mean load
    (``moe/load_max_over_mean/layer_L``, 1.0 is perfect balance; their maximum
    ``moe/load_max_over_mean``), and the load-balancing loss per micro-batch averaged over layers and
    ranks (``moe/load_balancing_loss``, tracked by Megatron when its coefficient is above 0). No token
    is ever dropped: experts have no capacity limit."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    layers = moe_layers(model)
    experts = layers[0].config.num_moe_experts if layers else 0
    # [moe layers, experts]; a pipeline stage of dense layers has none
    loads = torch.zeros((len(layers), experts), dtype=torch.float64, device=device)
    for k, layer in enumerate(layers):
        if layer.router.router_replay.load is not None:
            loads[k] = layer.router.router_replay.load.to(device)
    from megatron.core import parallel_state

    tracker = get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
    aux = torch.tensor([0.0, 0.0], dtype=torch.float64, device=device)  # (sum over layers and micro-batches, layers)
    if tracker is not None:
        # a TP or CP rank's value is its tokens' share of the row's (Megatron's global-batch form):
        # summed over the group, counted once per group
        aux[0] = tracker["values"].double().sum() / max(1, micro_batches)
        aux[1] = len(layers) if parallel_state.get_tensor_and_context_parallel_rank() == 0 else 0
    # the loads over the ranks holding these layers (a pipeline stage's: every rank without PP), the
    # load-balancing loss over every rank
    stage = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
    torch.distributed.all_reduce(loads, group=stage)
    torch.distributed.all_reduce(aux)
    clear_aux_losses_tracker()
    out: dict[str, float] = {}
    ratios = (loads.max(dim=1).values / loads.mean(dim=1).clamp_min(1e-12)).tolist() if layers else []
    for layer, ratio in zip(layers, ratios):
        out[f"moe/load_max_over_mean/layer_{layer.layer_number - 1}"] = ratio
    if layers:
        out["moe/load_max_over_mean"] = max(ratios)
    if aux[1] > 0:
        out["moe/load_balancing_loss"] = float(aux[0] / aux[1])
    return out


def count_routes(model: torch.nn.Module, counting: bool) -> None:
    """Whether the coming passes count in the router metrics and replay counts (idle passes do not)."""
    for layer in moe_layers(model):
        layer.router.router_replay.counting = counting


def reset_router_metrics(model: torch.nn.Module) -> None:
    for layer in moe_layers(model):
        layer.router.router_replay.load = None


def replay_counts(model: torch.nn.Module, reset: bool = True) -> tuple[int, int]:
    """(routes compared, routes where the router's own choice differed) over the model's MoE layers
    since the last reset."""
    routes = mismatched = 0
    for layer in moe_layers(model):
        replay = layer.router.router_replay
        routes, mismatched = routes + replay.routes, mismatched + replay.mismatched
        if reset:
            replay.routes = replay.mismatched = 0
    return routes, mismatched


def set_aux_loss_scale(moe, scale: float) -> None:
    """The weight of the load-balancing loss's gradient in the coming backward passes (Megatron's
    schedules set ``1 / micro-batches``; an idle pass sets 0). Nothing for dense models."""
    if moe is None:
        return
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    # shape [1], as Megatron's schedules set it (they copy into the tensor set first)
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor([scale], dtype=torch.float32, device=current_device()))


@contextlib.contextmanager
def scaled_aux_loss_coefficient(model: torch.nn.Module, factor: float):
    """Every MoE layer's load-balancing coefficient times ``factor`` while the block runs (0: no
    load-balancing loss). Megatron's pipeline schedules set the loss's gradient scale to 1 for every
    micro-batch (``set_aux_loss_scale`` cannot hold), so under pipeline parallelism the scale goes into
    the coefficient; the logged loss is divided by the coefficient, so it is unchanged."""
    configs = {id(layer.router.config): layer.router.config for layer in moe_layers(model)}
    saved = {key: config.moe_aux_loss_coeff for key, config in configs.items()}
    for key, config in configs.items():
        config.moe_aux_loss_coeff = saved[key] * factor
    try:
        yield
    finally:
        for key, config in configs.items():
            config.moe_aux_loss_coeff = saved[key]


def sum_sequence_sharded_grads(model: torch.nn.Module, tp_group) -> None:
    """Sum over the TP group the gradients of parameters that saw only their rank's tokens (marked
    ``sequence_parallel`` by Megatron inside a ``SequenceShardedMoE``), when the model itself does not
    run sequence parallelism (Megatron's ``finalize_model_grads`` sums them only then)."""
    if tp_group is None or tp_group.size() == 1:
        return
    grads = [
        p.main_grad if getattr(p, "main_grad", None) is not None else p.grad
        for p in model.parameters()
        if p.requires_grad and getattr(p, "sequence_parallel", False)
    ]
    grads = [g for g in grads if g is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    torch.distributed.all_reduce(flat, group=tp_group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
