"""The train-vs-rollout log-prob gap with the engine serving the trainer's precision and with it serving
FP8, and the share of tokens each TIS band would clip or mask, one run each.

    .venv/bin/python benchmarks/fp8_gap.py [--steps 3]

The demo's recipe (examples/demo/config.yaml: SmolLM2-135M-Instruct, the two-turn secret-word game, the
embedded engine in fp32, Megatron in fp32) for ``--steps`` steps, once as it is and once with
``--rollout-quantization fp8`` (128 x 128 blocks; SmolLM2's 576-wide hidden size and 192-wide key-value
projections end in partial blocks). Every step is dumped with the trainer's log-prob of each trained token
beside the engine's. Printed per precision, over every trained token of every step: the gap |train -
rollout| (mean and max), and for each band [low, high] the share of tokens whose importance weight
exp(train - rollout) falls outside it: what ``--tis-mode token`` clips and ``--tis-mode token_mask`` masks
at ``--tis-clip-low low --tis-clip high``. The sequence modes act on a sequence's product (``sequence``)
or geometric mean (``geo_mean_mask``) of those weights: the geometric mean's share is printed too.
"""

import argparse
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from slime_mt.assets import smollm2_dir
from slime_mt.inspection.dumps import load_dump

REPO = Path(__file__).resolve().parents[1]
BANDS = [(0.5, 2.0), (0.8, 1.25), (0.9, 1.1), (0.95, 1.05)]


def run(work: Path, data: Path, steps: int, fp8: bool) -> list[dict]:
    out = work / ("fp8" if fp8 else "full")
    cmd = [sys.executable, "-m", "slime_mt.cli", "train", "--config", str(REPO / "examples/demo/config.yaml")]
    cmd += ["--hf-checkpoint", str(smollm2_dir()), "--prompt-data", str(data / "train.jsonl")]
    cmd += ["--log-dir", str(out), "--num-rollout", str(steps), "--eval-interval", "1000"]
    cmd += ["--save-debug-rollout-data", str(out / "dumps/{rollout_id}.pt")]
    if fp8:
        cmd += ["--rollout-quantization", "fp8"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return [s for step in range(steps) for s in load_dump(out / f"dumps/{step}.pt")["train"]["samples"]]


def summary(samples: list[dict]) -> dict:
    gaps, means = [], []  # log w = train - rollout per trained token; per sequence, their mean
    for s in samples:
        logs = [t - r for t, r, m in zip(s["train_log_probs"], s["rollout_log_probs"], s["loss_mask"]) if m]
        gaps += logs
        if logs:
            means.append(sum(logs) / len(logs))
    row = {"tokens": len(gaps), "mean": sum(abs(g) for g in gaps) / len(gaps), "max": max(abs(g) for g in gaps)}
    for low, high in BANDS:
        row[(low, high)] = sum(not (math.log(low) <= g <= math.log(high)) for g in gaps) / len(gaps)
        row[("geo", low, high)] = sum(not (math.log(low) <= g <= math.log(high)) for g in means) / len(means)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fp8_gap_"))
    data = work / "data"
    subprocess.run([sys.executable, str(REPO / "examples/demo/make_data.py"), str(data)], check=True, cwd=REPO)
    rows = {name: summary(run(work, data, args.steps, fp8)) for name, fp8 in (("fp32", False), ("fp8", True))}
    print(f"the demo's recipe, {args.steps} steps; the gap |log p_train - log p_rollout| over the trained tokens")
    bands = "".join(f"{f'[{lo}, {hi}]':>14}" for lo, hi in BANDS)
    print(f"{'engine':<8}{'tokens':>8}{'mean gap':>10}{'max gap':>9}  outside the band (token):{bands}")
    for name, r in rows.items():
        shares = "".join(f"{r[b]:>14.2%}" for b in BANDS)
        print(f"{name:<8}{r['tokens']:>8}{r['mean']:>10.4f}{r['max']:>9.3f}  {'':>25}{shares}")
    for name, r in rows.items():
        shares = "".join(f"{r[('geo', *b)]:>14.2%}" for b in BANDS)
        print(f"{name:<8}{'':>27}  outside the band (sequence geo mean):{shares}")
    print(f"fp8 / fp32 mean gap: {rows['fp8']['mean'] / rows['fp32']['mean']:.1f}x")


if __name__ == "__main__":
    main()
