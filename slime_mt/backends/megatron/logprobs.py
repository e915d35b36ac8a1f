"""Per-token log-probs and entropy from vocab-sharded logits (tensor parallel), with gradients.

Each TP rank holds ``logits [T, V/tp]`` for its vocabulary slice. ``log p(target) = z_target - logZ``
with ``logZ`` from a max-shifted sum of exponentials reduced over the TP group; the entropy is
``-sum p log p`` reduced the same way. The reductions use megatron's
``reduce_from_tensor_model_parallel_region`` (all-reduce forward, identity backward), so every rank
computes the same loss and back-propagates into its own slice. Temperature divides the logits first,
as the engine does. The softmax is always computed in float32, whatever the model's dtype.

``hidden_logprobs`` starts from the decoder's hidden rows and projects one chunk of rows at a time;
with gradients each chunk is checkpointed (its logits are recomputed in backward), so no more than
one ``[chunk, V/tp]`` block of float32 logits exists at any time. The entropy has its own autograd
function (see ``_VocabParallelEntropy``); when it is only a metric (``entropy_grad=False``: no
entropy term in the loss) it is computed without a graph, once per chunk in the forward pass, and
not again when backward recomputes the chunk.
"""

from __future__ import annotations

import torch


def _tp_group_info():
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def _reduce_sum(x: torch.Tensor) -> torch.Tensor:
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(x)


def _reduce_max(x: torch.Tensor) -> torch.Tensor:
    from megatron.core import parallel_state

    x = x.detach().clone()
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(x, op=torch.distributed.ReduceOp.MAX,
                                     group=parallel_state.get_tensor_model_parallel_group())
    return x


class _VocabParallelEntropy(torch.autograd.Function):
    """Entropy of softmax(z) over the whole (sharded) vocabulary with the analytic gradient
    dH/dz_v = -p_v (log p_v + H), computed locally from this rank's p_v and the global H.
    (Differentiating through a reduce with identity backward would drop the other ranks' share of
    dH/dlogZ.)"""

    @staticmethod
    def forward(ctx, shifted: torch.Tensor, log_z: torch.Tensor) -> torch.Tensor:
        p, log_p, entropy = _entropy_parts(shifted, log_z)
        ctx.save_for_backward(p, log_p, entropy)
        return entropy

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        p, log_p, entropy = ctx.saved_tensors
        log_p = torch.where(p > 0, log_p, torch.zeros_like(log_p))
        return -p * (log_p + entropy.unsqueeze(-1)) * grad.unsqueeze(-1), None


def _entropy_parts(shifted: torch.Tensor, log_z: torch.Tensor):
    """(p, log p, entropy [C]) of softmax over the sharded vocabulary, from max-shifted logits."""
    log_p = shifted - log_z.unsqueeze(-1)  # [C, V/tp]
    p = torch.exp(log_p)
    local = -(p * torch.where(p > 0, log_p, torch.zeros_like(log_p))).sum(-1)
    return p, log_p, _all_reduce_sum_no_grad(local)


def _all_reduce_sum_no_grad(x: torch.Tensor) -> torch.Tensor:
    from megatron.core import parallel_state

    x = x.clone()
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(x, group=parallel_state.get_tensor_model_parallel_group())
    return x


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, temperature: float = 1.0,
                   with_entropy: bool = False, chunk: int = 1024, entropy_grad: bool = True
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``logits [T, V/tp]`` (this rank's vocab slice), ``targets [T]`` (global ids) ->
    (log-probs ``[T]``, entropy ``[T]`` or None). ``vocab_size``: real vocabulary (padded rows masked).
    ``entropy_grad``: the entropy carries a gradient (else it is a detached metric)."""
    rank, tp = _tp_group_info()
    local = logits.shape[-1]
    start = rank * local
    logprob_chunks, entropy_chunks = [], []
    for begin in range(0, logits.shape[0], chunk):
        z = logits[begin:begin + chunk].float() / temperature  # [C, V/tp]
        if start + local > vocab_size:  # padded vocabulary rows never win
            z = z.clone()
            z[:, max(vocab_size - start, 0):] = float("-inf")
        t = targets[begin:begin + chunk]
        shifted = z - _reduce_max(z.max(dim=-1).values).unsqueeze(-1)  # [C, V/tp]
        log_z = torch.log(_reduce_sum(torch.exp(shifted).sum(dim=-1)))  # [C]
        owned = (t >= start) & (t < start + local)
        local_index = (t - start).clamp(0, local - 1)
        picked = shifted.gather(-1, local_index.unsqueeze(-1)).squeeze(-1) * owned
        logprob_chunks.append(_reduce_sum(picked) - log_z)
        if with_entropy and entropy_grad:
            entropy_chunks.append(_VocabParallelEntropy.apply(shifted, log_z.detach()))
        elif with_entropy:
            with torch.no_grad():
                entropy_chunks.append(_entropy_parts(shifted, log_z)[2])
    logprobs = torch.cat(logprob_chunks) if logprob_chunks else logits.new_zeros(0)
    entropy = torch.cat(entropy_chunks) if with_entropy and entropy_chunks else None
    return logprobs, entropy


def hidden_logprobs(hidden: torch.Tensor, project, targets: torch.Tensor, vocab_size: int, temperature: float = 1.0,
                    with_entropy: bool = False, chunk: int = 1024, entropy_grad: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``hidden [T, H]`` (the rows whose next token is scored), ``project(hidden) -> [C, V/tp]``
    (this rank's logits), ``targets [T]`` -> (log-probs ``[T]``, entropy ``[T]`` or None).
    ``entropy_grad=False``: the entropy is a detached metric, computed in the forward pass only."""
    from torch.utils.checkpoint import checkpoint

    scored: set[int] = set()  # chunks whose metric entropy exists (a backward recompute skips it)

    def score(h, t, begin):
        metric_due = with_entropy and not entropy_grad and begin not in scored
        scored.add(begin)
        lp, ent = token_logprobs(project(h), t, vocab_size, temperature, with_entropy and (entropy_grad or metric_due),
                                 chunk=h.shape[0] or 1, entropy_grad=entropy_grad)
        return (lp, ent) if ent is not None else (lp,)

    logprob_chunks, entropy_chunks = [], []
    for begin in range(0, hidden.shape[0], chunk):
        h, t = hidden[begin:begin + chunk], targets[begin:begin + chunk]
        out = checkpoint(score, h, t, begin, use_reentrant=False) if torch.is_grad_enabled() else score(h, t, begin)
        logprob_chunks.append(out[0])
        if with_entropy:
            entropy_chunks.append(out[1])
    logprobs = torch.cat(logprob_chunks) if logprob_chunks else hidden.new_zeros(0, dtype=torch.float32)
    entropy = torch.cat(entropy_chunks) if with_entropy and entropy_chunks else None
    return logprobs, entropy
