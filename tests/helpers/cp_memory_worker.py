"""Peak memory of the attention of one long packed row (one sequence), forward and backward, on one CP
rank (launched by torchrun over gloo at CP > 1, or plain python for CP=1, where it is the fused
attention's causal SDPA): the rise of this process's peak resident memory over what it held with the
inputs allocated. Writes {"cp", "tokens", "peak_rise_bytes"} (the largest over the ranks).

    python cp_memory_worker.py OUT.json TOKENS            # CP=1
    python -m torch.distributed.run --standalone --nproc-per-node 2 cp_memory_worker.py OUT.json TOKENS
"""

import json
import os
import resource
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from slime_mt.backends.megatron.context_parallel import ContextParallelSegments, gather_sequence, segment_attention

HEADS, DIM = 2, 16


def peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: kilobytes


def main():
    out_path, tokens = sys.argv[1], int(sys.argv[2])
    cp = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    if cp > 1:
        dist.init_process_group("gloo")
        group = dist.new_group(list(range(cp)))
        layout = ContextParallelSegments.of([tokens], tokens, cp, dist.get_rank(), group)
        q, k, v = (torch.randn(1, HEADS, tokens // cp, DIM, generator=g).requires_grad_() for _ in range(3))
        gathered = [gather_sequence(x.permute(2, 0, 1, 3), group).permute(1, 2, 0, 3) for x in (k, v)]
        before = peak_bytes()
        out = segment_attention(
            q,
            *gathered,
            layout.query_segment,
            layout.query_position,
            layout.key_segment,
            layout.key_position,
            DIM**-0.5,
        )
    else:
        q, k, v = (torch.randn(1, HEADS, tokens, DIM, generator=g).requires_grad_() for _ in range(3))
        before = peak_bytes()
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=DIM**-0.5)
    out.sum().backward()
    rise = torch.tensor([peak_bytes() - before], dtype=torch.float64)
    if cp > 1:
        dist.all_reduce(rise, op=dist.ReduceOp.MAX)
    if cp == 1 or dist.get_rank() == 0:
        json.dump({"cp": cp, "tokens": tokens, "peak_rise_bytes": float(rise)}, open(out_path, "w"))
    if cp > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
