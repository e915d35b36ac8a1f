"""A weight update in bf16 against one in block-wise FP8: bytes sent and seconds per update, one run.

    .venv/bin/python benchmarks/weight_update.py [--model qwen3-0.6b] [--updates 3]

The model: ``--model``'s published configuration with random weights (``slime_mt.assets.sized_model_dir``,
built in code; Qwen3-0.6B by default, its 151,936 x 1,024 embedding tied). The update: every tensor in
bf16, as a ``--bf16`` trainer exports them, pushed by ``DistributedWeights`` (``--weight-transport
distributed``: announced bucket by bucket over HTTP, broadcast over a gloo group, 512 MiB buckets) to an
embedded engine in another process, which loads it all or nothing; the FP8 update goes through
``EngineWeights``' quantization first (``--rollout-quantization fp8``, 128 x 128 blocks) to an engine
serving the FP8 copy of the same folder. Printed per precision: the bytes of one update (the quantized
tensors apart), the median seconds of ``--updates`` updates (rank 0's push: quantization, broadcast and
the engine's load), the seconds of the quantization alone, and the FP8 / bf16 ratios. On CPUs the
embedded engine dequantizes what it receives (its load is slower in FP8); SGLang on GPUs loads the FP8
tensors as they come.
"""

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from slime_mt.assets import qwen_tokenizer_dir, sized_model_dir
from slime_mt.engine.clients.control import EngineControl
from slime_mt.engine.embedded.server import wait_healthy
from slime_mt.engine.launch import free_port
from slime_mt.engine.weights.fp8 import BlockFp8, convert_folder, quantize_stream, quantized
from slime_mt.engine.weights.sync import DistributedWeights, EngineWeights, UpdatePlan
from slime_mt.safetensors_files import load_hf_state

REPO = Path(__file__).resolve().parents[1]
BUFFER = 512 * 1024**2  # --update-weight-buffer-size's default


def serve(folder: Path):
    port = free_port()
    cmd = [sys.executable, "-m", "slime_mt.cli", "serve", "--model-path", str(folder), "--port", str(port)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, timeout=600)
    return proc, url


def nbytes(named) -> tuple[int, int]:
    """(all bytes, the FP8 tensors' and their scales' bytes) of an update."""
    total = fp8 = 0
    for name, t in named:
        size = t.numel() * t.element_size()
        total += size
        fp8 += size if (t.dtype == torch.float8_e4m3fn or name.endswith("_scale_inv")) else 0
    return total, fp8


class _open:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def measure(folder: Path, state: dict, quantization: BlockFp8 | None, updates: int) -> dict:
    proc, url = serve(folder)
    side = EngineControl("local", url, [url], timeout=600.0, max_retries=0)  # the client a trainer rank holds
    try:
        weights = EngineWeights(lambda urls: DistributedWeights(side, [1], BUFFER), [url], quantization)
        seconds = []
        for v in range(1, updates + 1):
            started = time.perf_counter()
            weights.push(iter(state.items()), v, UpdatePlan([url]), _open)
            seconds.append(time.perf_counter() - started)
        weights.close()
    finally:
        side.close()
        proc.terminate()
        proc.wait(timeout=60)
    stream = state.items() if quantization is None else quantize_stream(state.items(), quantization)
    started = time.perf_counter()
    total, fp8 = nbytes(stream)
    return {
        "bytes": total,
        "quantized": fp8,
        "seconds": statistics.median(seconds),
        "encode": time.perf_counter() - started,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--updates", type=int, default=3)
    args = parser.parse_args()
    source = sized_model_dir(args.model)
    work = Path(tempfile.mkdtemp(prefix="weight_update_"))
    try:
        full = work / "bf16"
        full.mkdir()
        for f in source.iterdir():
            (full / f.name).symlink_to(f)
        for f in qwen_tokenizer_dir("qwen3").iterdir():  # the engine needs a tokenizer; the asset has none
            if f.is_file() and not (full / f.name).exists():
                shutil.copy2(f, full / f.name)
        fp8 = convert_folder(full, work / "fp8", BlockFp8((128, 128)))
        state = {k: v.to(torch.bfloat16) for k, v in load_hf_state(source).items()}
        results = {
            "bf16": measure(full, state, None, args.updates),
            "fp8": measure(fp8, state, BlockFp8((128, 128)), args.updates),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{args.model}: one update of {len(state)} tensors, DistributedWeights (gloo) to an embedded engine")
    print(f"(median of {args.updates} updates each)")
    print(f"{'precision':<10}{'bytes':>16}{'quantized tensors':>20}{'s / update (median)':>22}{'encode s':>10}")
    for name, r in results.items():
        print(f"{name:<10}{r['bytes']:>16,}{r['quantized']:>20,}{r['seconds']:>22.2f}{r['encode']:>10.2f}")
    b, f = results["bf16"], results["fp8"]
    linear = sum(v.numel() * v.element_size() for k, v in state.items() if quantized(k, v))  # in bf16
    print(
        f"fp8 / bf16: bytes {f['bytes'] / b['bytes']:.3f} (the quantized tensors {f['quantized'] / linear:.4f}), "
        f"seconds {f['seconds'] / b['seconds']:.2f}"
    )


if __name__ == "__main__":
    main()
