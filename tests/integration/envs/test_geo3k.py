"""geo3k: answer grading, the env's tool turns and final reward, and data preparation."""

import io
import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image
from train_helpers import REPO


def png(color):
    buffer = io.BytesIO()
    Image.new("RGB", (32, 24), color).save(buffer, format="PNG")
    return buffer.getvalue()


def test_prepare_from_parquet(tmp_path):
    table = pa.table(
        {
            "problem": ["<image>Find x.", "<image>Find the area."],
            "answer": ["4", "12.5"],
            "images": [[{"bytes": png((1, 1, 1)), "path": None}], [{"bytes": png((2, 2, 2)), "path": None}]],
        }
    )
    pq.write_table(table, tmp_path / "train-00000.parquet")
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts/prepare_geo3k.py"),
            "--parquet",
            str(tmp_path / "train-00000.parquet"),
            "--out",
            str(out),
            "--test-fraction",
            "0.5",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(x) for f in ("train.jsonl", "test.jsonl") for x in (out / f).read_text().splitlines()]
    assert sorted(r["answer"] for r in rows) == ["12.5", "4"]
    for r in rows:
        assert (out / r["images"][0]).is_file()
        assert r["messages"][1]["content"] == r["problem"] and r["tools"][0]["function"]["name"] == "calc_score"


def test_prepare_rejects_bad_parquet(tmp_path):
    pq.write_table(pa.table({"question": ["x"]}), tmp_path / "bad.parquet")
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts/prepare_geo3k.py"),
            "--parquet",
            str(tmp_path / "bad.parquet"),
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "missing geo3k columns ['problem', 'answer', 'images']" in proc.stderr
