"""Every patch that lets megatron-core run on a CPU-only machine (gloo), in one place.

Applied by ``apply_cpu_patches()`` only when no GPU is present; each patch names the hard-coded CUDA
call it replaces. Nothing here changes numerics: the same layers, the same collectives.
"""

from __future__ import annotations

import contextlib
import math

import torch

_APPLIED = False


class CpuRNGStatesTracker:
    """Replaces megatron's ``CudaRNGStatesTracker`` (``torch.cuda.get_rng_state``/``manual_seed``):
    named CPU generator states, forked around model-parallel regions (dropout, init)."""

    def __init__(self, *args, **kwargs):
        self.reset()

    def reset(self):
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._is_initialized = False

    def is_initialized(self):
        return self._is_initialized

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.seeds_.add(seed)
        original = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(original)

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        original = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(original)


def _cpu_model_parallel_seed(seed: int, *args, **kwargs) -> None:
    """Replaces ``model_parallel_cuda_manual_seed`` (calls ``torch.cuda.manual_seed``): the default
    generator gets ``seed``, the tensor-parallel state ``seed + 2718 + tp_rank`` as megatron does."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    torch.manual_seed(seed)
    tracker = CpuRNGStatesTracker()
    tracker.add(random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * tp_rank)
    random._CUDA_RNG_STATE_TRACKER = tracker
    random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def _cpu_causal_mask(sq: int) -> torch.Tensor:
    """Replaces ``get_default_causal_mask`` (allocates with ``device="cuda"``)."""
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


def _cpu_grad_norm_fp32(grads_for_norm, norm_type=2, grad_stats_parallel_group=None, data_parallel_group=None):
    """Replaces ``get_grad_norm_fp32`` (apex multi-tensor L2 norm on ``device='cuda'``): local norm
    of this rank's grads, all-reduced over the model-parallel group (as megatron does)."""
    if isinstance(grads_for_norm, torch.Tensor):
        grads_for_norm = [grads_for_norm]
    norm_type = float(norm_type)
    if norm_type == math.inf:
        local = max((g.abs().max() for g in grads_for_norm), default=torch.tensor(0.0))
        total = torch.tensor([float(local)])
        op = torch.distributed.ReduceOp.MAX
    else:
        total = torch.zeros(1)
        for g in grads_for_norm:
            total += torch.norm(g.float(), norm_type) ** norm_type
        op = torch.distributed.ReduceOp.SUM
    for group in (data_parallel_group, grad_stats_parallel_group):
        if group is not None:
            torch.distributed.all_reduce(total, op=op, group=group)
    return float(total[0]) if norm_type == math.inf else float(total[0]) ** (1.0 / norm_type)


def _cpu_clip_by_total_norm(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """Replaces ``clip_grad_by_total_norm_fp32`` (asserts ``torch.cuda.FloatTensor`` grads)."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff < 1.0:
        for p in parameters:
            grad = p.decoupled_grad if use_decoupled_grad else p.grad
            if grad is not None:
                grad.mul_(coeff)


_torch_tensor = torch.tensor


def _tensor_on_cpu(*args, **kwargs):
    """``torch.tensor`` that places ``device="cuda"`` requests on the CPU."""
    if str(kwargs.get("device", "")).startswith("cuda"):
        kwargs["device"] = "cpu"
    return _torch_tensor(*args, **kwargs)


def _allocating_on_cpu(init):
    """Wrap an ``__init__`` whose ``torch.tensor(..., device='cuda')`` calls must land on the CPU."""

    def wrapped(self, *args, **kwargs):
        torch.tensor = _tensor_on_cpu
        try:
            init(self, *args, **kwargs)
        finally:
            torch.tensor = _torch_tensor

    return wrapped


_tensor_type = torch.Tensor.type


def _cuda_type_name(self, *args, **kwargs):
    """``Tensor.type()`` answering a CPU tensor's type with the CUDA name (torch.cuda.BFloat16Tensor)."""
    name = _tensor_type(self, *args, **kwargs)
    if not args and not kwargs and name.startswith("torch.") and not name.startswith("torch.cuda."):
        return "torch.cuda." + name[len("torch.") :]
    return name


def _cuda_type_names(init):
    """Wrap an ``__init__`` that sorts parameters by ``param.type()`` against CUDA type names only."""

    def wrapped(self, *args, **kwargs):
        torch.Tensor.type = _cuda_type_name
        try:
            init(self, *args, **kwargs)
        finally:
            torch.Tensor.type = _tensor_type

    return wrapped


def _splits_on_host(tensor, as_numpy: bool = False):
    """A split-size tensor as the host copy the all-to-all takes (numpy with ``as_numpy``)."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


def _cpu_dtoh_and_synchronize(self, point: str, tokens_per_expert=None):
    """Replaces ``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize``, which copies the split
    sizes to the host on a CUDA side stream and waits on a CUDA event: on the CPU they are host
    tensors already, so at the same point they only become the numpy arrays the all-to-all takes."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        self.input_splits = _splits_on_host(self.input_splits, as_numpy=True)
        self.output_splits = _splits_on_host(self.output_splits, as_numpy=True)
        self.output_splits_tp = _splits_on_host(self.output_splits_tp, as_numpy=True)
    return tokens_per_expert


def _gloo_gather(gather):
    """Wrap ``mappings._gather_along_first_dim`` for gloo: it gathers no bool tensors (the MoE
    all-gather dispatcher's routing map; they travel as uint8) and equal sizes only, so an uneven
    gather (``output_split_sizes``: the dispatcher's tokens per rank) pads every rank's part to the
    largest, gathers, and cuts the padding out again."""

    def wrapped(input_, group, output_split_sizes=None, use_global_buffer=False):
        if input_.dtype == torch.bool and group.size() > 1:
            return wrapped(input_.to(torch.uint8), group, output_split_sizes, use_global_buffer).bool()
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(n) for n in output_split_sizes]
        longest = max(sizes)
        padded = torch.zeros((longest, *input_.shape[1:]), dtype=input_.dtype, device=input_.device)
        padded[: input_.shape[0]] = input_
        gathered = gather(padded, group, None, False).split(longest, dim=0)
        return torch.cat([part[:n] for part, n in zip(gathered, sizes)])

    return wrapped


def _uneven_reduce_scatter(reduce_scatter):
    """Wrap ``mappings._reduce_scatter_along_first_dim``: gloo has no uneven reduce-scatter, so the
    whole tensor is summed over the group and each rank keeps its own rows (``input_split_sizes``)."""

    def wrapped(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        summed = input_.contiguous().clone()
        torch.distributed.all_reduce(summed, group=group)
        sizes = [int(n) for n in input_split_sizes]
        start = sum(sizes[: group.rank()])
        return summed[start : start + sizes[group.rank()]].contiguous()

    return wrapped


def _patch_moe() -> None:
    """The MoE layer on the CPU: the all-to-all dispatcher's device-to-host stream (a class attribute
    created with ``torch.cuda.Stream()`` when the first dispatcher is built) gets a placeholder, its
    split sizes become host arrays without a CUDA event, ``moe_utils.te_general_gemm`` (left
    undefined by megatron-core 0.16.1 when Transformer Engine does not import) is None, so the
    router's fp32 gemm takes its torch path, and the uneven all-gather and reduce-scatter of tokens
    over the expert-tensor-parallel group work on gloo."""
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    mappings._gather_along_first_dim = _gloo_gather(mappings._gather_along_first_dim)
    mappings._reduce_scatter_along_first_dim = _uneven_reduce_scatter(mappings._reduce_scatter_along_first_dim)
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    dispatcher = token_dispatcher.MoEAlltoAllTokenDispatcher
    dispatcher.cuda_dtoh_stream = object()  # never used on the CPU: only the patched method read it
    dispatcher._maybe_dtoh_and_synchronize = _cpu_dtoh_and_synchronize


class _TorchOnCpu:
    """The ``torch`` a module sees where it creates tensors on ``device="cuda"``: those land on the
    CPU; everything else is torch itself."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, **kwargs):
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return torch.zeros(*args, **kwargs)


def _embedding_copy_on_cpu(setup):
    """Wrap ``LanguageModule.setup_embeddings_and_output_layer``: under PP with tied embeddings it
    moves the shared weight with ``.cuda()`` before the all-reduce over the embedding group."""

    def wrapped(self, *args, **kwargs):
        cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda tensor, *a, **k: tensor
        try:
            return setup(self, *args, **kwargs)
        finally:
            torch.Tensor.cuda = cuda

    return wrapped


def _patch_pipeline() -> None:
    """Megatron's pipeline schedules on the CPU: they count tokens in ``torch.zeros([], device="cuda")``
    (the no-pipelining path included), the p2p exchange calls ``torch.cuda.synchronize()`` after its
    batched sends (nothing to wait for on the CPU: gloo's requests were waited on), and tied
    embeddings move the last stage's copy with ``.cuda()``."""
    from megatron.core.models.common.language_module import language_module
    from megatron.core.pipeline_parallel import schedules

    schedules.torch = _TorchOnCpu()
    torch.cuda.synchronize = lambda *args, **kwargs: None
    module = language_module.LanguageModule
    module.setup_embeddings_and_output_layer = _embedding_copy_on_cpu(module.setup_embeddings_and_output_layer)


def apply_cpu_patches() -> bool:
    """Patch megatron-core for CPU when CUDA is absent; returns True when patches were applied."""
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True
    # torch.cuda.current_device() places buffers in DDP grad buffers, rotary inv_freq, the global
    # memory buffer, TP gathers and M-RoPE: on a CPU-only torch it raises, so it answers "cpu".
    torch.cuda.current_device = lambda: "cpu"
    from megatron.core import tensor_parallel
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.tensor_parallel import random
    from megatron.core.transformer import utils as transformer_utils

    random.CudaRNGStatesTracker = CpuRNGStatesTracker
    # activation recompute keeps and restores the CUDA generator's state (torch.cuda.get_rng_state):
    # there is none; the CPU generator and the tracker's states are kept and restored as on a GPU
    random._get_cuda_rng_state = lambda *args, **kwargs: None
    random._set_cuda_rng_state = lambda *args, **kwargs: None
    random.model_parallel_cuda_manual_seed = _cpu_model_parallel_seed
    tensor_parallel.model_parallel_cuda_manual_seed = _cpu_model_parallel_seed
    transformer_utils.get_default_causal_mask = _cpu_causal_mask
    clip_grads.get_grad_norm_fp32 = _cpu_grad_norm_fp32
    clip_grads.clip_grad_by_total_norm_fp32 = _cpu_clip_by_total_norm
    # FP32Optimizer / MixedPrecisionOptimizer allocate their loss-scale and found-inf flags with
    # torch.tensor(..., device='cuda') in __init__.
    optimizer.FP32Optimizer.__init__ = _allocating_on_cpu(optimizer.FP32Optimizer.__init__)
    optimizer.MixedPrecisionOptimizer.__init__ = _allocating_on_cpu(optimizer.MixedPrecisionOptimizer.__init__)
    # Float16OptimizerWithFloat16Params (bf16 training) accepts only 'torch.cuda.*Tensor' parameters.
    optimizer.Float16OptimizerWithFloat16Params.__init__ = _cuda_type_names(
        optimizer.Float16OptimizerWithFloat16Params.__init__
    )
    optimizer.get_grad_norm_fp32 = _cpu_grad_norm_fp32
    optimizer.clip_grad_by_total_norm_fp32 = _cpu_clip_by_total_norm
    # so does the distributed optimizer (--use-distributed-optimizer) as it shards them
    from megatron.core.optimizer import distrib_optimizer

    distrib_optimizer.DistributedOptimizer.__init__ = _cuda_type_names(distrib_optimizer.DistributedOptimizer.__init__)
    _patch_moe()
    _patch_pipeline()
    _APPLIED = True
    return True
