"""One CP rank of the context-parallel attention check (launched by torchrun over gloo): its zigzag share
of a packed row's queries, keys and values through the fused core attention (which gathers the keys
and values of the whole row over the CP group), then forward and backward; writes the largest
differences from one process's causal SDPA per sequence (output and the gradients of this rank's
queries, keys and values).

    python -m torch.distributed.run --standalone --nproc-per-node 2 cp_attention_worker.py OUT.json
"""

import json
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

from slime_mt.backends.megatron.attention import FusedCoreAttention
from slime_mt.backends.megatron.context_parallel import ContextParallelSegments, padded_length
from slime_mt.backends.megatron.layouts import Segments, segments_attention

LENGTHS = [37, 300, 700, 11]
HEADS, GROUPS, DIM = 4, 2, 16


def main():
    dist.init_process_group("gloo")
    cp, rank = dist.get_world_size(), dist.get_rank()
    group = dist.new_group(list(range(cp)))
    padded = padded_length(sum(LENGTHS), cp)
    lengths = [*LENGTHS, padded - sum(LENGTHS)]
    g = torch.Generator().manual_seed(0)
    # Megatron's layout: [s, b, heads or groups, d]
    query, key, value = (torch.randn(padded, 1, n, DIM, generator=g) for n in (HEADS, GROUPS, GROUPS))
    grad = torch.randn(1, HEADS, padded, DIM, generator=g)
    scale = DIM**-0.5

    def heads(x):  # [s, b, g, d] -> [b, heads, s, d]
        return x.permute(1, 2, 0, 3).repeat_interleave(HEADS // x.shape[2], dim=1)

    full = [x.clone().requires_grad_() for x in (query, key, value)]
    want = segments_attention(*(heads(x) for x in full), Segments(tuple(lengths)), scale)
    want.backward(grad)
    layout = ContextParallelSegments.of(LENGTHS, padded, cp, rank, group)
    mine = layout.query_position
    local = [x[mine].clone().requires_grad_() for x in (query, key, value)]
    config = SimpleNamespace(
        num_attention_heads=HEADS, num_query_groups=GROUPS, kv_channels=DIM, softmax_scale=None, attention_dropout=0.0
    )
    attention = FusedCoreAttention(
        config, 1, None, "self", pg_collection=SimpleNamespace(tp=SimpleNamespace(size=lambda: 1))
    )
    out = attention(*local, layout)  # [s, b, heads * d]
    out = out.reshape(len(mine), 1, HEADS, DIM).permute(1, 2, 0, 3)
    out.backward(grad[:, :, mine])
    diffs = torch.tensor(
        [
            float((out - want[:, :, mine]).abs().max()),
            *(float((x.grad - f.grad[mine]).abs().max()) for x, f in zip(local, full)),
        ]
    )
    dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
    if rank == 0:
        names = ["output", "grad_query", "grad_key", "grad_value"]
        json.dump({"cp": cp, **dict(zip(names, diffs.tolist()))}, open(sys.argv[1], "w"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
