"""Write the demo's prompt files: OUT/train.jsonl and OUT/eval.jsonl (one secret word per row)."""

import json
import sys
from pathlib import Path

WORDS = [
    "apple",
    "river",
    "garden",
    "silver",
    "candle",
    "forest",
    "window",
    "planet",
    "rabbit",
    "guitar",
    "orange",
    "bridge",
    "pencil",
    "rocket",
    "castle",
    "butter",
    "dragon",
    "island",
    "mirror",
    "violin",
]
PROMPT = "Let's play a game. I have a secret word. Guess it: reply with one word."


def main(out: str) -> None:
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    for name, words in (("train.jsonl", WORDS[:16]), ("eval.jsonl", WORDS[16:])):
        rows = "".join(json.dumps({"prompt": PROMPT, "secret": w}) + "\n" for w in words)
        (folder / f".{name}.tmp").write_text(rows)
        (folder / f".{name}.tmp").replace(folder / name)


if __name__ == "__main__":
    main(sys.argv[1])
