"""Peak memory of the attention of one long packed row (one sequence), forward and backward, on one CP
rank (launched by torchrun over gloo at CP > 1, or plain python for CP=1, where it is the fused
attention's causal SDPA): the rise of this process's peak resident memory over what it held with the
inputs allocated (the kernel's high-water mark reset there: what set it before, imports and the inputs'
gather, would otherwise hide the attention's rise). Writes {"cp", "tokens", "peak_rise_bytes"} (the
largest over the ranks).

    python cp_memory_worker.py OUT.json TOKENS            # CP=1
    python -m torch.distributed.run --standalone --nproc-per-node 2 cp_memory_worker.py OUT.json TOKENS
"""

import json
import os
import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from slime_mt.backends.megatron.context_parallel import ContextParallelSegments, gather_sequence, segment_attention

HEADS, DIM = 2, 16


STATUS = Path("/proc/self/status")


def resident_bytes(field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (the peak since the last reset) of this process, in bytes."""
    return int(re.search(rf"{field}:\s+(\d+) kB", STATUS.read_text()).group(1)) * 1024


def reset_peak() -> int:
    """The high-water mark set back to the resident memory now (Linux >= 4.0: ``5`` to ``clear_refs``)
    -> the bytes resident now."""
    Path("/proc/self/clear_refs").write_text("5")
    return resident_bytes("VmRSS")


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
        before = reset_peak()
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
        before = reset_peak()
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=DIM**-0.5)
    out.sum().backward()
    rise = torch.tensor([resident_bytes("VmHWM") - before], dtype=torch.float64)
    if cp > 1:
        dist.all_reduce(rise, op=dist.ReduceOp.MAX)
    if cp == 1 or dist.get_rank() == 0:
        json.dump({"cp": cp, "tokens": tokens, "peak_rise_bytes": float(rise)}, open(out_path, "w"))
    if cp > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
