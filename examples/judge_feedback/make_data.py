"""Write short questions with reference answers for the judge-feedback example:
``python examples/judge_feedback/make_data.py OUT_DIR [--seed 0]`` -> OUT_DIR/train.jsonl (``prompt``,
``label``: the reference the judge compares with). The same seed gives the same order."""

import argparse
import random
from pathlib import Path

from slime_mt.data import write_jsonl

SYSTEM_PROMPT = (
    "Answer in one short sentence. A grader reviews each answer; if it finds a problem, improve your answer."
)
FACTS = [
    ("What is the capital of France?", "Paris"),
    ("What is the capital of Japan?", "Tokyo"),
    ("What is the capital of Italy?", "Rome"),
    ("How many days are in a week?", "Seven"),
    ("How many legs does a spider have?", "Eight"),
    ("What color is the sky on a clear day?", "Blue"),
    ("What gas do plants take in from the air?", "Carbon dioxide"),
    ("What is frozen water called?", "Ice"),
    ("What is 12 plus 30?", "42"),
    ("What is 9 times 7?", "63"),
    ("Which planet is closest to the Sun?", "Mercury"),
    ("What is the largest ocean on Earth?", "The Pacific Ocean"),
    ("Who wrote Romeo and Juliet?", "William Shakespeare"),
    ("What is the boiling point of water at sea level in Celsius?", "100 degrees"),
    ("How many minutes are in an hour?", "Sixty"),
    ("What animal is known as the king of the jungle?", "The lion"),
]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    given = parser.parse_args(argv)
    facts = list(FACTS)
    random.Random(given.seed).shuffle(facts)
    rows = [
        {"prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}], "label": a}
        for q, a in facts
    ]
    path = write_jsonl(given.out / "train.jsonl", rows)
    print(f"wrote {len(rows)} questions to {path}")


if __name__ == "__main__":
    main()
