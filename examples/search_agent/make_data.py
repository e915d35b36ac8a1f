"""Write a search agent's corpus and questions, offline, from generated facts:
``python examples/search_agent/make_data.py OUT_DIR [--countries 40] [--seed 0]`` ->

  OUT_DIR/corpus.jsonl   passages about invented countries: each country's capital and export, each
                         capital's founder and year (``{"id", "title", "text"}``; envs.search indexes it)
  OUT_DIR/train.jsonl    questions: the capital of a country (one search), and who founded it (two
                         searches: the capital, then its founder); ``label`` is the answer, and
                         ``metadata["corpus"]`` points at the corpus

The names are invented, so no model knows them: the answers are found only by searching. The same
seed gives the same files."""

import argparse
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from envs.search import SYSTEM_PROMPT  # noqa: E402
from slime_mt.data import write_jsonl  # noqa: E402

SYLLABLES = ["zor", "va", "nia", "quel", "mar", "o", "tes", "sin", "bre", "lan", "du", "ka", "ri", "fen", "tho", "pel"]
GOODS = ["salt", "wool", "copper", "tea", "amber", "glass", "timber", "silk", "rice", "tin"]
FIRST_NAMES = ["Ada", "Bram", "Cora", "Dov", "Esme", "Fyn", "Gala", "Hugo", "Ines", "Joss"]


def _name(rng: random.Random, used: set[str]) -> str:
    while True:
        name = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()
        if name not in used and len(name) > 3:
            used.add(name)
            return name


def make(countries: int, seed: int) -> tuple[list[dict], list[dict]]:
    """-> (passages, questions without the corpus path)."""
    rng = random.Random(seed)
    used: set[str] = set()
    passages, questions = [], []
    for k in range(countries):
        country, capital, surname = _name(rng, used), _name(rng, used), _name(rng, used)
        founder = f"{rng.choice(FIRST_NAMES)} {surname}"
        year, good = rng.randint(1200, 1900), rng.choice(GOODS)
        passages += [
            {"id": f"c{k}", "title": country, "text": f"{country} is a small country. Its capital is {capital}."},
            {"id": f"t{k}", "title": capital, "text": f"{capital} was founded in {year} by {founder}."},
            {"id": f"g{k}", "title": country, "text": f"The people of {country} trade in {good}."},
        ]
        questions += [
            {"question": f"What is the capital of {country}?", "label": capital},
            {"question": f"Who founded the capital of {country}?", "label": founder},
        ]
    rng.shuffle(questions)
    return passages, questions


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--countries", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    given = parser.parse_args(argv)
    passages, questions = make(given.countries, given.seed)
    corpus = (given.out / "corpus.jsonl").resolve()
    rows = [
        {
            "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q["question"]}],
            "label": q["label"],
            "metadata": {"corpus": str(corpus)},
        }
        for q in questions
    ]
    write_jsonl(corpus, passages)
    write_jsonl(given.out / "train.jsonl", rows)
    print(f"wrote {len(passages)} passages to {corpus} and {len(rows)} questions to {given.out / 'train.jsonl'}")


if __name__ == "__main__":
    main()
