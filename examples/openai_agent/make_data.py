"""Write the addition task's prompts: ``python examples/openai_agent/make_data.py OUT_DIR`` ->
OUT_DIR/train.jsonl (200 rows) with ``prompt`` and ``label``; the same seed gives the same file."""

import json
import random
import sys
from pathlib import Path


def main(out: Path, rows: int = 200, seed: int = 0) -> None:
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    lines = []
    for _ in range(rows):
        a, b = rng.randint(1, 9), rng.randint(1, 9)  # one digit: SmolLM2-135M gets some right from the start
        lines.append(json.dumps({"prompt": f"What is {a} + {b}?", "label": a + b}))
    (out / "train.jsonl").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
