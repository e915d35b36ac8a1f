"""What the suite's fork server (tests/helpers/forkserver.py) saves per ``slime-mt`` process, measured in
one run.

The same command, ``python -m slime_mt.cli train --dry-run`` on the tiny Qwen2 (it imports torch and
transformers, reads the model's config and plug-ins, prints the plan and exits), and ``train`` for one
step (it also imports megatron-core and builds the model and the engine), each started ``--runs`` times
as a plain process and as a fork of a server that imported torch, transformers and megatron-core once.
Per command: the median wall and CPU seconds of each way and their ratio, and the server's own start
(paid once per pytest worker).

    .venv/bin/python benchmarks/forkserver_startup.py [--runs 3] [--no-train]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests" / "helpers"), str(REPO)]

import forkserver  # noqa: E402
import tiers  # noqa: E402
from train_helpers import PLUGINS, TWO_SMALL_STEPS, demo_train_cmd, repo_env  # noqa: E402

from slime_mt.assets import tiny_model_dir  # noqa: E402


def timed(popen, cmd: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one run of ``cmd`` started by ``popen``."""
    started, before = time.perf_counter(), tiers.cpu_seconds()
    proc = popen(cmd, cwd=REPO, env=repo_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    return time.perf_counter() - started, tiers.cpu_seconds() - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-train", action="store_true", help="only the dry run")
    args = parser.parse_args()
    tiny = tiny_model_dir("qwen2")
    root = Path(tempfile.mkdtemp(prefix="forkserver-bench-"))
    subprocess.run([sys.executable, str(REPO / "examples/demo/make_data.py"), str(root / "data")], check=True)
    (root / "plugins.py").write_text(PLUGINS)
    commands = {
        "train --dry-run": [sys.executable, "-m", "slime_mt.cli", "train", "--dry-run", "--hf-checkpoint", str(tiny)]
    }
    if not args.no_train:
        one_step = [*TWO_SMALL_STEPS, "--num-rollout", "1", "--custom-rm-path", f"{root}/plugins.py:rm"]
        commands["train, one step"] = lambda k: demo_train_cmd(
            tiny, root / "data/train.jsonl", root / f"run{k}", *one_step
        )
    started = time.perf_counter()
    server = forkserver._server()
    assert server.ok, "the fork server did not start"
    print(
        f"the server's start (torch, transformers, megatron-core imported once): {time.perf_counter() - started:.2f} s"
    )
    print(f"{'command':<18} {'plain s':>8} {'forked s':>9} {'ratio':>6} {'plain CPU-s':>12} {'forked CPU-s':>13}")
    try:
        k = 0
        for name, cmd in commands.items():
            figures = {}
            for way, popen in (("plain", forkserver.PLAIN_POPEN), ("forked", forkserver.Popen)):
                runs = []
                for _ in range(args.runs):
                    k += 1
                    runs.append(timed(popen, cmd(k) if callable(cmd) else cmd))
                figures[way] = (statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs))
            (pw, pc), (fw, fc) = figures["plain"], figures["forked"]
            print(f"{name:<18} {pw:8.2f} {fw:9.2f} {pw / fw:5.2f}x {pc:12.2f} {fc:13.2f}")
            print(f"  saved per process: {pw - fw:.2f} s, {pc - fc:.2f} CPU-s (median of {args.runs})")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
