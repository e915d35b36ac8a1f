"""Write a code agent's tasks: ``python examples/code_agent/make_data.py OUT_DIR [--rows 200] [--seed 0]``
-> OUT_DIR/train.jsonl. Each row asks for one small Python function; its hidden tests (asserts on
generated inputs, ``metadata["tests"]``) grade the submitted code in envs.python_sandbox. The same
seed gives the same file."""

import argparse
import random
from pathlib import Path

from slime_mt.data import write_jsonl

SYSTEM_PROMPT = (
    "You write Python. Put your code in a ```python block: it runs and you see its output. When the "
    "function is final, write <submit> after the block; hidden tests then check it."
)
# (name, its parameters, what it returns, the reference that computes the expected values, one input)
TASKS = [
    (
        "add",
        "a, b",
        "the sum of the integers a and b",
        lambda a, b: a + b,
        lambda r: (r.randint(-50, 50), r.randint(-50, 50)),
    ),
    (
        "product",
        "a, b",
        "the product of the integers a and b",
        lambda a, b: a * b,
        lambda r: (r.randint(-9, 9), r.randint(-9, 9)),
    ),
    (
        "largest",
        "xs",
        "the largest number in the non-empty list xs",
        max,
        lambda r: ([r.randint(-99, 99) for _ in range(r.randint(1, 6))],),
    ),
    (
        "reverse",
        "s",
        "the string s reversed",
        lambda s: s[::-1],
        lambda r: ("".join(r.choice("abcxyz") for _ in range(r.randint(0, 7))),),
    ),
    (
        "count_vowels",
        "s",
        "how many letters of the string s are vowels (a, e, i, o, u)",
        lambda s: sum(c in "aeiou" for c in s),
        lambda r: ("".join(r.choice("abeiouxyz") for _ in range(r.randint(0, 9))),),
    ),
    (
        "is_even",
        "n",
        "True if the integer n is even, else False",
        lambda n: n % 2 == 0,
        lambda r: (r.randint(-100, 100),),
    ),
]


def make(rows: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(rows):
        name, params, returns, reference, draw = rng.choice(TASKS)
        cases = [draw(rng) for _ in range(4)]
        tests = "\n".join(f"assert {name}({', '.join(map(repr, case))}) == {reference(*case)!r}" for case in cases)
        out.append(
            {
                "prompt": [
                    {"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": f"Write a Python function {name}({params}) that returns {returns}."},
                ],
                "label": name,
                "metadata": {"tests": tests},
            }
        )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    given = parser.parse_args(argv)
    path = write_jsonl(given.out / "train.jsonl", make(given.rows, given.seed))
    print(f"wrote {given.rows} tasks to {path}")


if __name__ == "__main__":
    main()
