"""Runs inside vLLM's worker processes: the weight group (``engine/weights/group.py``) as a backend of
vLLM's own weight-transfer endpoints, so the trainer's ``--weight-transport distributed`` reaches a
vLLM server as it reaches SGLang.

vLLM's RL API moves weights through a pluggable transfer engine: ``/init_weight_transfer_engine``
joins the trainer; a version is ``/start_weight_update``, one ``/update_weights`` per bucket, and
``/finish_weight_update`` with the new ``weight_version``. Its built-in backends speak their own wire
formats (NCCL through vLLM's ``PyNcclCommunicator``, CUDA IPC), which need vLLM on the trainer side
and a GPU. ``WeightGroupEngine`` is the backend ``slime_mt``: it joins the same torch process group
as SGLang's ``/init_weights_update_group`` (gloo on CPUs, NCCL on GPUs; the trainer is rank 0,
the engine's devices follow from ``rank_offset``) and receives each bucket as SGLang's
``/update_weights_from_distributed`` does, one broadcast per tensor in the order of the request,
then loads it with the model's ``load_weights`` (HF names) inside vLLM's layerwise reload.

A server gets it with ``--worker-extension-cls slime_mt.engine.weights.vllm_worker.WeightGroupWorker``
(importing this module in each worker registers the backend, before the worker builds its transfer
engine) and ``--weight-transfer-config '{"backend": "slime_mt"}'``; ``engine/launch.py`` starts
servers so, with slime_mt importable. This module needs only torch and vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from slime_mt.engine.weights import group as weight_group

BACKEND = "slime_mt"


@dataclass
class GroupInitInfo(WeightTransferInitInfo):
    """``/init_weight_transfer_engine``'s ``init_info``: SGLang's ``/init_weights_update_group`` body."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = weight_group.GROUP_NAME
    backend: str = "nccl"

    def __post_init__(self) -> None:
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend {self.backend!r}: gloo or nccl")
        if not 1 <= self.rank_offset < self.world_size:
            raise ValueError(f"rank_offset {self.rank_offset} must be in 1 .. world_size-1 ({self.world_size - 1})")


@dataclass
class BucketInfo(WeightTransferUpdateInfo):
    """``/update_weights``' ``update_info``: one bucket's names, dtypes and shapes, in broadcast order."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        weight_group.check_bucket({"names": self.names, "dtypes": self.dtype_names, "shapes": self.shapes})


class WeightGroupEngine(WeightTransferEngine[GroupInitInfo, BucketInfo]):
    """One worker's end of the weight group: joined once, one bucket per ``update_weights``."""

    init_info_cls = GroupInitInfo
    update_info_cls = BucketInfo
    supports_draft_weight_update = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.group = None

    def init_transfer_engine(self, init_info: GroupInitInfo) -> None:
        """Join as ``rank_offset`` + this worker's rank among the server's devices (data-parallel
        replicas after one another, as vLLM's NCCL backend counts them); a group joined before is left."""
        self.shutdown()
        parallel = self.parallel_config
        rank = init_info.rank_offset + parallel.data_parallel_index * parallel.world_size + parallel.rank
        if rank >= init_info.world_size:
            raise ValueError(f"this worker is rank {rank} of a weight group of {init_info.world_size}")
        self.group = weight_group.join(
            init_info.backend,
            init_info.master_address,
            init_info.master_port,
            init_info.world_size,
            rank,
            init_info.group_name,
        )

    def start_weight_update(self) -> None:
        """A version begins: vLLM's layerwise reload puts back the checkpoint's layout of each layer
        (a CPU or quantized layer keeps its weights in a processed form) and defers each layer's
        processing until all of its tensors have arrived, as vLLM's NCCL backend does."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        """The version's last bucket arrived: the layers not processed yet are (a layer that received
        nothing keeps its weights); the server then sets the version, the client resets the prefix cache."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        repack_cpu_kernels(self.model)

    def update_weights(self, update_info: dict) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: BucketInfo) -> None:
        if self.group is None:
            raise RuntimeError("no weight group joined: call /init_weight_transfer_engine first")
        tensors = weight_group.receive(
            self.group, update_info.names, update_info.dtype_names, update_info.shapes, str(self.device)
        )
        self.model.load_weights(weights=tensors.items())

    def shutdown(self) -> None:
        if self.group is not None:
            weight_group.leave(self.group)
            self.group = None


def repack_cpu_kernels(model: torch.nn.Module) -> int:
    """Pack again, from the weights they hold now, the CPU GEMM kernels of layers that keep their
    weight (embeddings and LM heads) -> how many.

    vLLM's CPU build packs each GEMM's weight into a kernel once the weights are loaded. An in-place
    reload (``reload_weights``, or a weight-transfer update) processes again only the layers that
    received a tensor, so an LM head tied to the input embedding, which receives none, keeps a kernel
    packed from the old embedding: the logits come from the old weights while the inputs embed with
    the new. GPUs do not pack, and there this does nothing."""
    if next(model.parameters()).device.type != "cpu":
        return 0
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    repacked = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        kernel = getattr(module, "cpu_linear", None)
        if kernel is None or kernel is torch.nn.functional.linear:
            continue
        if isinstance(weight, torch.Tensor) and weight.ndim == 2 and weight.numel() > 0:
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            repacked += 1
    return repacked


class WeightGroupWorker:
    """The ``--worker-extension-cls`` that brings this module, and so the ``slime_mt`` backend, into
    every vLLM worker process, and adds the call the disk path makes after ``reload_weights``."""

    def slime_mt_repack_cpu_kernels(self) -> int:
        """``repack_cpu_kernels`` on this worker's model (``/collective_rpc``)."""
        return repack_cpu_kernels(self.model_runner.get_model())


try:
    WeightTransferEngineFactory.register_engine(BACKEND, WeightGroupEngine)
except ValueError:  # registered already: this module was imported before in this process
    pass
