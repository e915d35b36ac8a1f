"""Rollout dumps and the viewer at 10,000 trajectories.

    .venv/bin/python benchmarks/inspect_page.py [--trajectories 10000]

Builds a step of two-turn trajectories (60 prompt, 40 + 30 generated and 20 observation tokens each),
then prints, measured in this run:
  - the dump's write and load time, and its load time had the per-token lists been stored as Python
    lists in the ``torch.save`` file (what torch's safe loader, ``weights_only=True``, reads slowly)
    rather than as the JSON text the format keeps them in: the ratio is why the format is so;
  - ``slime-mt inspect``'s page: write time and size, and the time Chromium (the OS's, through
    Playwright; skipped without it) takes to open it, draw the first rows and open the last trajectory.
"""

import argparse
import io
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from slime_mt.inspection.dumps import load_dump, save_dump
from slime_mt.inspection.report import write_report
from slime_mt.rollout.finalize import finalize
from slime_mt.types import Sample, Status, TrainBatch

CHROMIUM_ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]


def step_of(trajectories: int) -> tuple[list[list[Sample]], TrainBatch]:
    groups = []
    for g in range(trajectories // 8):
        group = []
        for k in range(8):
            s = Sample(index=8 * g + k, group_index=g, prompt="p")
            s.set_prompt_tokens(list(range(100, 160)))
            s.append_turn(list(range(200, 240)), [-0.5] * 40, weight_version="3")
            s.append_observation(list(range(300, 320)))
            s.append_turn(list(range(240, 270)), [-0.25] * 30, weight_version="3")
            s.status, s.reward = Status.COMPLETED, float(k % 2)
            group.append(s)
        groups.append(group)
    sequences, _ = finalize([s for g in groups for s in g], "concat", False)
    return groups, TrainBatch(sequences, [1.0] * len(sequences), {}, {}, 0.0, 0.0, {}, list(range(len(groups))), "")


def timed(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trajectories", type=int, default=10_000)
    n = parser.parse_args().trajectories
    groups, batch = step_of(n)
    folder = Path(tempfile.mkdtemp(prefix="inspect-bench-"))
    try:
        path = folder / "dumps" / "rollout_0.pt"
        write = timed(lambda: save_dump(path, 0, groups, batch, {}), 1)
        load = timed(lambda: load_dump(path))
        as_lists = io.BytesIO()
        torch.save(load_dump(path), as_lists)  # the same data, token lists as pickled Python lists
        lists = timed(lambda: torch.load(io.BytesIO(as_lists.getvalue()), weights_only=True), 1)
        print(f"{n} trajectories: dump {path.stat().st_size / 1e6:.1f} MB written in {write:.2f} s")
        print(f"  load (records as JSON text): {load:.2f} s; as pickled lists through weights_only: {lists:.2f} s")
        print(f"  ratio lists / JSON: {lists / load:.1f}x")
        template = str(folder / "dumps" / "rollout_{rollout_id}.pt")
        page = folder / "report.html"
        written = timed(lambda: write_report(folder, page, dumps=template), 1)
        print(f"  page: {page.stat().st_size / 1e6:.1f} MB written in {written:.2f} s")
        chromium = shutil.which("chromium") or shutil.which("chromium-browser")
        if chromium is None:
            print("  no Chromium here: page open time not measured")
            return
        from playwright.sync_api import sync_playwright

        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
            opens = []
            for _ in range(3):
                tab = browser.new_page()
                started = time.perf_counter()
                tab.goto(page.as_uri())
                tab.wait_for_selector("body[data-ready='1']")
                tab.locator("tr.sample-row").nth(199).click()
                tab.locator("tr.detail .tok").first.wait_for()
                opens.append(time.perf_counter() - started)
                tab.close()
            browser.close()
        print(f"  page open to the first 200 rows and one trajectory's tokens drawn: {statistics.median(opens):.2f} s")
    finally:
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
