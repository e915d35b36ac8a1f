"""Per-token log-probs and entropy of the scored rows, from vocab-sharded logits (tensor parallel),
one chunk of rows at a time, with gradients.

Each TP rank holds the output weight ``[V/tp, H]`` of its vocabulary slice. For the hidden rows
``[T, H]`` whose next token is scored, ``log p(target) = z_target - logZ`` with ``logZ`` from a
max-shifted sum of exponentials reduced over the TP group, and the entropy is
``H = logZ - sum_v p_v (z_v - max)``, reduced the same way. Temperature divides the logits first, as
the engine does; padded vocabulary rows never win. The softmax is always float32, whatever the
model's dtype.

``hidden_logprobs`` runs one autograd function per chunk of rows (``_ChunkLogprobs``). Its forward
keeps no logits: it saves the rows, the targets and two float32 numbers per row (the log normaliser
and the entropy). Its backward recomputes the chunk's logits once and writes the analytic gradient
into them in place,

    d log p_t / dz_v = [v == t] - p_v,        dH / dz_v = -p_v (log p_v + H),

then needs one matmul each for the rows' and the weight's gradients. So no more than one
``[chunk, V/tp]`` block of float32 logits (and its exponentials) exists at any time, and backward
makes no autograd graph over it. The rows' gradient is partial on each TP rank (its vocabulary
slice); ``copy_to_tensor_model_parallel_region`` all-reduces it, as Megatron's output layer does.
The entropy carries a gradient only with ``entropy_grad`` (an entropy term in the loss); otherwise
it is a metric, computed in the forward pass only.
"""

from __future__ import annotations

import torch

# fp32 logits [rows, V/tp] alive at once in the log-prob path (a model's chunk of rows: this many bytes)
LOGIT_CHUNK_BYTES = 64 * 1024 * 1024


def _tp_group_info():
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def _all_reduce(x: torch.Tensor, op=torch.distributed.ReduceOp.SUM) -> torch.Tensor:
    """In place over the TP group (nothing at TP=1); no autograd."""
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(x, op=op, group=parallel_state.get_tensor_model_parallel_group())
    return x


class _Shard:
    """Where this rank's vocabulary slice sits, and the targets it owns."""

    def __init__(self, local: int, vocab_size: int, targets: torch.Tensor):
        rank, _ = _tp_group_info()
        self.start = rank * local
        self.padded_from = max(vocab_size - self.start, 0) if self.start + local > vocab_size else None
        self.owned = (targets >= self.start) & (targets < self.start + local)  # [C]
        self.index = (targets - self.start).clamp(0, local - 1).unsqueeze(-1)  # [C, 1]


def _logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float, shard: _Shard) -> torch.Tensor:
    """This rank's float32 logits ``[C, V/tp]`` / temperature, padded columns at the float32 minimum
    (their probability is exactly 0 and ``0 * logit`` stays finite)."""
    z = torch.nn.functional.linear(hidden, weight).float()  # a fresh tensor: every later step is in place
    if temperature != 1.0:
        z.div_(temperature)
    if shard.padded_from is not None:
        z[:, shard.padded_from :] = torch.finfo(torch.float32).min
    return z


class _ChunkLogprobs(torch.autograd.Function):
    """``hidden [C, H]``, ``weight [V/tp, H]``, ``targets [C]`` -> (log p(target) ``[C]``, entropy
    ``[C]``; zeros without ``with_entropy``); see the module docstring."""

    @staticmethod
    def forward(
        ctx, hidden, weight, targets, vocab_size: int, temperature: float, with_entropy: bool, entropy_grad: bool
    ):
        shard = _Shard(weight.shape[0], vocab_size, targets)
        z = _logits(hidden, weight, temperature, shard)
        peak = _all_reduce(z.max(dim=-1).values, torch.distributed.ReduceOp.MAX)  # [C]
        shifted = z.sub_(peak.unsqueeze(-1))
        exp = torch.exp(shifted)
        log_z = torch.log(_all_reduce(exp.sum(dim=-1)))  # [C]
        picked = shifted.gather(-1, shard.index).squeeze(-1) * shard.owned
        logprobs = _all_reduce(picked) - log_z
        if with_entropy:
            p_shifted = exp.div_(torch.exp(log_z).unsqueeze(-1)).mul_(shifted)  # in place: p is not needed again
            entropy = log_z - _all_reduce(p_shifted.sum(dim=-1))
        else:
            entropy = torch.zeros_like(logprobs)
        del z, shifted, exp
        ctx.save_for_backward(hidden, weight, targets, peak + log_z, entropy)
        ctx.vocab_size, ctx.temperature, ctx.entropy_grad = vocab_size, temperature, with_entropy and entropy_grad
        if not ctx.entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, targets, log_norm, entropy = ctx.saved_tensors
        shard = _Shard(weight.shape[0], ctx.vocab_size, targets)
        log_p = _logits(hidden, weight, ctx.temperature, shard).sub_(log_norm.unsqueeze(-1))  # [C, V/tp]
        p = torch.exp(log_p)
        if ctx.entropy_grad:  # p * (-g_H (log p + H) - g_lp), in the log_p buffer
            grad = log_p.add_(entropy.unsqueeze(-1)).mul_(-grad_entropy.unsqueeze(-1))
            grad = grad.sub_(grad_logprobs.unsqueeze(-1)).mul_(p)
            if shard.padded_from is not None:  # p = 0 there, but (log p + H) g_H may have overflowed
                grad[:, shard.padded_from :] = 0.0
            del p
        else:
            del log_p
            grad = p.mul_(-grad_logprobs.unsqueeze(-1))
        grad.scatter_add_(-1, shard.index, (grad_logprobs * shard.owned).unsqueeze(-1))
        if ctx.temperature != 1.0:
            grad.div_(ctx.temperature)
        grad = grad.to(weight.dtype)
        return grad @ weight, grad.t() @ hidden, None, None, None, None, None


def hidden_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    vocab_size: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk: int = 1024,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``hidden [T, H]`` (the rows whose next token is scored), ``weight [V/tp, H]`` (this rank's
    output weight), ``targets [T]`` (global ids) -> (log-probs ``[T]``, entropy ``[T]`` or None), in
    float32. ``vocab_size``: the real vocabulary (padded rows never win). ``entropy_grad=False``: the
    entropy is a detached metric."""
    _, tp = _tp_group_info()
    if tp > 1 and torch.is_grad_enabled():
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        hidden = copy_to_tensor_model_parallel_region(hidden)  # backward: sum the ranks' partial gradients
    logprob_chunks, entropy_chunks = [], []
    for begin in range(0, hidden.shape[0], chunk):
        lp, ent = _ChunkLogprobs.apply(
            hidden[begin : begin + chunk],
            weight,
            targets[begin : begin + chunk],
            vocab_size,
            temperature,
            with_entropy,
            entropy_grad,
        )
        logprob_chunks.append(lp)
        entropy_chunks.append(ent)
    if not logprob_chunks:  # still on the graph: a context-parallel rank with no response token backpropagates
        empty = hidden.float().sum(dim=-1)  # [0]
        return empty, empty.clone() if with_entropy else None
    return torch.cat(logprob_chunks), torch.cat(entropy_chunks) if with_entropy else None
