"""``export``: the HF weights gather to global rank 0 alone, one tensor at a time."""

import torch.distributed as dist

from slime_mt.assets import tiny_model_dir
from slime_mt.backends.megatron.actor import MegatronActor
from slime_mt.config import AlgoConfig, TrainConfig


def check_export_ranks(args, info, out):
    """Export gathers to global rank 0 only: the other ranks never hold a full tensor (an MoE model
    in an expert-parallel world, where every rank lends its experts)."""
    kind = "qwen3-moe" if info.ep_size > 1 else "qwen2"
    actor = MegatronActor(str(tiny_model_dir(kind)), TrainConfig(), AlgoConfig(), info)
    counts = {"full": 0, "none": 0}
    for _, tensor in actor.iter_hf_weights():
        counts["full" if tensor is not None else "none"] += 1
    everyone = [None] * info.world_size
    dist.all_gather_object(everyone, counts)
    out["export_ranks"] = everyone


CHECKS = {
    "export_ranks": check_export_ranks,
}
