"""Megatron checks run in their own processes (one process per rank, launched by the tests with
``torchrun`` or plain python for world size 1). Each check writes its numbers to ``--out`` as JSON /
.pt; the pytest side asserts on them. One launch runs many checks: importing megatron +
transformers costs ~10 s per process, so tests share launches (``megatron_worlds.WORLDS``).

    python megatron_worker.py --tp 1 --checks families,matrix --out DIR

The checks live in ``megatron_checks/``, one module per part of the backend (``model``, ``scoring``,
``train``, ``export``, ``parallel``, ``state``); this file only dispatches. Every check drives the backend
through its own code paths (``MegatronModel``, ``scoring``, ``export``, the actor's ``accumulate_gradients``
/ ``apply_gradients`` / ``train``), never a copy of them.
"""

import argparse
import json
from pathlib import Path

from megatron_checks import adapters, export, model, parallel, scoring, state, train
from megatron_checks.common import LAUNCH, is_main
from megatron_worlds import DENSE_FAMILIES, FAMILIES, MOE_FAMILIES

from slime_mt.backends.megatron.parallel import destroy_parallel, init_parallel

CHECKS = {
    **adapters.CHECKS,
    **model.CHECKS,
    **scoring.CHECKS,
    **train.CHECKS,
    **export.CHECKS,
    **parallel.CHECKS,
    **state.CHECKS,
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--etp", type=int, default=None)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--sp", action="store_true", help="sequence parallelism in the matrix and aux-loss checks")
    parser.add_argument("--families", choices=["all", "dense", "moe"], default="all")
    parser.add_argument("--checks", required=True, help=f"comma-separated, of: {', '.join(sorted(CHECKS))}")
    parser.add_argument("--out", required=True)
    parser.add_argument("--samples", help="train_file: a torch-saved dict of samples written by a test")
    parser.add_argument("--name", help="results_NAME.json (default: results_tpTP_worldWORLD.json)")
    args = parser.parse_args()
    LAUNCH.families = {"all": FAMILIES, "dense": DENSE_FAMILIES, "moe": MOE_FAMILIES}[args.families]
    LAUNCH.sequence_parallel = args.sp
    info = init_parallel(args.tp, seed=1234, ep_size=args.ep, etp_size=args.etp, cp_size=args.cp, pp_size=args.pp)
    out = {}
    for name in args.checks.split(","):
        CHECKS[name](args, info, out)
    if is_main(info):
        name = args.name or f"tp{args.tp}_world{info.world_size}"
        (Path(args.out) / f"results_{name}.json").write_text(json.dumps(out, indent=1))
    # gloo's threads torn down by interpreter exit can abort a rank ("terminate called without an active
    # exception") after the work is done; a destroyed process group exits cleanly
    destroy_parallel()


if __name__ == "__main__":
    main()
