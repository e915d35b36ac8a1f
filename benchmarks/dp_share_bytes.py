"""Bytes each trainer rank receives per step, at DP=1, 2 and 4, on a VLM run.

    .venv/bin/python benchmarks/dp_share_bytes.py [--steps 2]

Three short geo3k runs of the tiny Qwen2.5-VL (synthetic problems, one diagram each, 8 prompt groups of
2 a step) under torchrun: DP=1 at TP=2 (two ranks that train the same groups), DP=2 and DP=4 at TP=1.
Rank 0 splits each step's batch by DP rank (``algo.batching.split_by_dp``) and sends every rank its
share alone; the run logs what it sent (``train/batch_bytes``: the shares together, the whole batch;
``train/batch_bytes_per_rank``: the largest share). Printed per DP: the bytes of the whole batch, the
most one rank received, their ratio (expected 1/DP: whole groups with their images, plus the pickle
headers), and what each rank received before (the whole batch, broadcast to every rank).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from slime_mt.assets import tiny_model_dir

REPO = Path(__file__).resolve().parents[1]
LAYOUTS = [(1, 2), (2, 1), (4, 1)]  # (DP, TP)


def run(data: Path, out: Path, dp: int, tp: int, steps: int) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(dp * tp)]
    cmd += ["-m", "slime_mt.cli", "train", "--hf-checkpoint", str(tiny_model_dir("qwen2.5-vl"))]
    cmd += ["--prompt-data", str(data / "train.jsonl"), "--input-key", "messages", "--label-key", "answer"]
    cmd += ["--tool-key", "tools", "--multimodal-keys", '{"image": "images"}']
    cmd += ["--rollout-interaction-env-path", str(REPO / "envs/geo3k.py"), "--max-turns", "2"]
    cmd += ["--rollout-max-response-len", "16", "--rollout-max-context-len", "1024"]
    cmd += ["--n-samples-per-prompt", "2", "--rollout-batch-size", "8", "--global-batch-size", "16"]
    cmd += ["--micro-batch-size", "2", "--num-rollout", str(steps), "--tensor-model-parallel-size", str(tp)]
    cmd += ["--log-dir", str(out)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"DP={dp} TP={tp} failed:\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "geo3k"
        subprocess.run(
            [sys.executable, "-m", "slime_mt.cli", "prepare-data", "--synthetic", "16", "--out", str(data)],
            check=True,
            capture_output=True,
        )
        print(
            f"{'DP':>3} {'TP':>3} {'whole batch (B)':>16} {'most to one rank (B)':>21} {'ratio':>6} {'1/DP':>6}  before"
        )
        for dp, tp in LAYOUTS:
            rows = run(data, Path(tmp) / f"dp{dp}", dp, tp, args.steps)
            whole = statistics.median(r["train/batch_bytes"] for r in rows)
            per_rank = statistics.median(r["train/batch_bytes_per_rank"] for r in rows)
            ratio = per_rank / whole
            print(f"{dp:>3} {tp:>3} {whole:>16,.0f} {per_rank:>21,.0f} {ratio:>6.3f} {1 / dp:>6.3f}  {whole:>20,.0f}")


if __name__ == "__main__":
    main()
