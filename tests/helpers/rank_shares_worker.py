"""One rank of a gloo world (torchrun) that receives its share of a batch from rank 0 as the trainer
sends it (``roles.link.send_shares``), at TP=2: writes what it received to ``OUT/rank_R.json``."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from slime_mt.algo.batching import split_by_dp
from slime_mt.backends.megatron.parallel import ParallelInfo
from slime_mt.errors import RolloutFailedError
from slime_mt.roles.link import send_shares
from slime_mt.types import TrainBatch, TrainingSample

TP = 2


def batch(groups: int) -> TrainBatch:
    """``groups`` prompt groups of 2 samples, each with an image's pixels (16 KiB)."""
    samples = []
    for k in range(2 * groups):
        n = 3 + k % 4
        pixels = torch.full((64, 64), float(k), dtype=torch.float32)
        samples.append(
            TrainingSample(
                [1, 2], [7] * n, [1] * n, [-0.5] * n, 1.0, f"t{k}", k // 2, True, None, {"pixel_values": pixels}
            )
        )
    return TrainBatch(samples, [float(k) for k in range(len(samples))], {}, {}, 0.0, 0.0, {}, [], "")


def split(samples, advantages, prompts_per_step):
    """``MegatronActor.split`` at DP=2 with the default loss reduction and length (no model needed)."""
    return split_by_dp(samples, advantages, prompts_per_step, 2, "token_mean", 4096)


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    info = ParallelInfo(rank, world, rank % TP, TP, rank // TP, world // TP)
    dp_of_rank = [r // TP for r in range(world)] if rank == 0 else None
    whole = batch(8)
    share, sent = send_shares(split(whole.samples, whole.advantages, 8) if rank == 0 else None, dp_of_rank, info)
    pixels = [float(s.multimodal_train_inputs["pixel_values"][0, 0]) for s in share.samples]
    (out / f"rank_{rank}.json").write_text(
        json.dumps({"indices": share.indices, "pixels": pixels, "weights": share.weights, "sent": sent})
    )
    failure = RolloutFailedError("step 3: every sample failed")
    failed, _ = send_shares(failure if rank == 0 else None, dp_of_rank, info)
    (out / f"failed_{rank}.txt").write_text(f"{type(failed).__name__}: {failed}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
