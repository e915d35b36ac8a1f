"""Write the guessing game's prompts: ``python examples/custom_env/make_data.py OUT_DIR [--rows 64]
[--high 16] [--seed 0]`` -> OUT_DIR/guesses.jsonl (a prompt and its secret number per row; the same
seed gives the same file)."""

import argparse
import random
from pathlib import Path

from slime_mt.data import write_jsonl

PROMPT = "I picked a whole number from 1 to {high}. Guess it: answer with the number only."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--high", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    rows = [{"prompt": PROMPT.format(high=args.high), "secret": rng.randint(1, args.high)} for _ in range(args.rows)]
    print(write_jsonl(Path(args.out) / "guesses.jsonl", rows))


if __name__ == "__main__":
    main()
