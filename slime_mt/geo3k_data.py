"""geo3k data for the recipes: convert the real geo3k parquet from disk, or draw synthetic problems.

Output: ``OUT/train.jsonl``, ``OUT/test.jsonl`` (rows ``{"problem": "<image>...", "answer": "...",
"images": ["images/00000.png"], "messages": [system, user], "tools": [calc_score]}``) and
``OUT/images/``; read them with ``--input-key messages --label-key answer --tool-key tools
--multimodal-keys '{"image": "images"}'``. Files are written to temp names and
renamed, so an interrupted run leaves no half-written jsonl.
"""

from __future__ import annotations

import io
import json
import math
import os
import random
from pathlib import Path

from PIL import Image, ImageDraw

GEO3K_FIELDS = ("problem", "answer", "images")
# the geo3k environment's tool and system prompt (envs/geo3k.py), which the rows carry
TOOL = {
    "type": "function",
    "function": {
        "name": "calc_score",
        "description": "Check a candidate answer to the geometry question; returns whether it is correct.",
        "parameters": {
            "type": "object",
            "properties": {"answer": {"type": "string", "description": "The answer"}},
            "required": ["answer"],
        },
    },
}

SYSTEM_PROMPT = (
    "Solve the geometry problem about the diagram. You may check a candidate answer with the "
    "calc_score tool. Give your final answer as \\boxed{answer}."
)


def _with_chat(row: dict) -> dict:
    """Add the chat form the recipes train on: a system prompt and the problem, plus the tool schema."""
    return {
        **row,
        "messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": row["problem"]}],
        "tools": [TOOL],
    }


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, path)


def _save_image(image: Image.Image, folder: Path, index: int) -> str:
    name = f"{index:05d}.png"
    image.convert("RGB").save(folder / name)
    return f"images/{name}"


def convert_parquet(paths: list[str], out: Path) -> list[dict]:
    """Rows of geo3k parquet files (``problem`` with an ``<image>`` placeholder, ``answer``,
    ``images`` as [{"bytes": ...}]) -> project rows with image files."""
    import pyarrow.parquet as pq

    images_dir = out / "images"
    images_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for path in paths:
        if not Path(path).is_file():
            raise FileNotFoundError(f"geo3k parquet not found: {path}")
        table = pq.read_table(path)
        missing = [f for f in GEO3K_FIELDS if f not in table.column_names]
        if missing:
            raise ValueError(f"{path}: missing geo3k columns {missing} (has {table.column_names})")
        for i, record in enumerate(table.to_pylist(), 1):
            files = []
            for image in record["images"] or []:
                data = image.get("bytes") if isinstance(image, dict) else image
                if data is None:
                    raise ValueError(f"row {i} of {Path(path).name}: image without bytes")
                files.append(_save_image(Image.open(io.BytesIO(data)), images_dir, len(rows) * 4 + len(files)))
            problem = record["problem"]
            if problem.count("<image>") != len(files):
                raise ValueError(
                    f"row {i} of {Path(path).name}: {problem.count('<image>')} <image> placeholders "
                    f"but {len(files)} images"
                )
            rows.append({"problem": problem, "answer": str(record["answer"]), "images": files})
    return rows


def _canvas():
    image = Image.new("RGB", (224, 224), "white")
    return image, ImageDraw.Draw(image)


def _right_triangle(rng: random.Random):
    a, b, c = rng.choice([(3, 4, 5), (5, 12, 13), (6, 8, 10), (8, 15, 17), (9, 12, 15), (7, 24, 25)])
    image, d = _canvas()
    A, B, C = (30, 190), (30 + 150 * b // max(a, b), 190), (30, 190 - 150 * a // max(a, b))
    d.polygon([A, B, C], outline="black", width=2)
    d.rectangle([A[0], A[1] - 12, A[0] + 12, A[1]], outline="black")
    d.text(((A[0] + B[0]) // 2, A[1] + 8), str(b), fill="black")
    d.text((A[0] - 22, (A[1] + C[1]) // 2), str(a), fill="black")
    d.text(((B[0] + C[0]) // 2 + 8, (B[1] + C[1]) // 2 - 8), "x", fill="black")
    return image, "<image>Find x.", str(c)


def _triangle_angles(rng: random.Random):
    p, q = rng.randint(30, 80), rng.randint(30, 80)
    image, d = _canvas()
    d.polygon([(20, 200), (200, 200), (90, 30)], outline="black", width=2)
    d.text((30, 180), f"{p}°", fill="black")
    d.text((170, 180), f"{q}°", fill="black")
    d.text((88, 50), "x°", fill="black")
    return image, "<image>Find x.", str(180 - p - q)


def _circle(rng: random.Random):
    r = rng.randint(2, 12)
    image, d = _canvas()
    d.ellipse([32, 32, 192, 192], outline="black", width=2)
    d.line([(112, 112), (192, 112)], fill="black", width=2)
    d.text((140, 96), str(r), fill="black")
    return image, "<image>Find the circumference of the circle. Round to the nearest tenth.", f"{2 * math.pi * r:.1f}"


def _rectangle(rng: random.Random):
    w, h = rng.randint(3, 15), rng.randint(3, 15)
    image, d = _canvas()
    d.rectangle([30, 60, 194, 164], outline="black", width=2)
    d.text((105, 168), str(w), fill="black")
    d.text((8, 105), str(h), fill="black")
    return image, "<image>Find the area of the rectangle.", str(w * h)


GENERATORS = (_right_triangle, _triangle_angles, _circle, _rectangle)


def synthetic_rows(n: int, out: Path, seed: int = 0) -> list[dict]:
    """``n`` geo3k-style problems drawn with PIL; answers hold by construction."""
    rng = random.Random(seed)
    images_dir = out / "images"
    images_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        image, problem, answer = GENERATORS[i % len(GENERATORS)](rng)
        rows.append({"problem": problem, "answer": answer, "images": [_save_image(image, images_dir, i)]})
    return rows


def prepare(
    out: str | Path,
    parquet: list[str] | None = None,
    synthetic: int | None = None,
    seed: int = 0,
    test_fraction: float = 0.1,
) -> str:
    """Write train/test jsonl from parquet files or ``synthetic`` drawn problems -> a summary line."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if bool(parquet) == bool(synthetic):
        raise ValueError("give exactly one of --parquet FILES or --synthetic N")
    rows = convert_parquet(parquet, out) if parquet else synthetic_rows(synthetic, out, seed)
    rows = [_with_chat(r) for r in rows]
    rng = random.Random(seed)
    order = list(range(len(rows)))
    rng.shuffle(order)
    n_test = max(1, int(len(rows) * test_fraction)) if len(rows) > 1 else 0
    test = [rows[i] for i in order[:n_test]]
    train = [rows[i] for i in order[n_test:]]
    _write_jsonl(out / "train.jsonl", train)
    _write_jsonl(out / "test.jsonl", test)
    return f"wrote {len(train)} train and {len(test)} test rows to {out}"
