"""Inspecting a run: rollout dumps (saved, loaded with and without slime_mt, replayed), rollout-only
runs, turn records, the trace, and ``slime-mt inspect`` (its text summary, and its HTML page driven
in the operating system's Chromium through Playwright).

Two real runs are shared by the module: a rollout-only run of the tiny Qwen2.5-VL on geo3k (step-wise,
the ``window:1`` context policy, an environment whose first step of every episode fails once), and a
two-step run of the demo recipe that a train-only run replays."""

import time

from inspection_helpers import open_page
from train_helpers import REPO

from slime_mt.inspection.dumps import dump_path, save_dump
from slime_mt.inspection.report import write_report
from slime_mt.plugins import load_module


def test_a_10000_trajectory_step_opens_within_seconds(browser, tmp_path):
    """A step of 10,000 two-turn trajectories: the page is written, opens and answers within a few
    seconds (rows drawn a page at a time, tokens only when a trajectory is opened)."""
    groups, batch = load_module(str(REPO / "benchmarks/inspect_page.py")).step_of(10_000)
    save_dump(dump_path(str(tmp_path / "dumps/rollout_{rollout_id}.pt"), 0), 0, groups, batch, {})
    started = time.perf_counter()
    path = write_report(tmp_path, tmp_path / "big.html", dumps=str(tmp_path / "dumps/rollout_{rollout_id}.pt"))
    written = time.perf_counter() - started
    started = time.perf_counter()
    page, errors = open_page(browser, path)
    opened = time.perf_counter() - started
    assert int(page.locator("#counts").get_attribute("data-samples")) == 10_000
    assert page.locator("tr.sample-row").count() == 200  # the first page of rows
    page.locator("#more").scroll_into_view_if_needed()
    deadline = time.time() + 10  # the page's CSP allows no eval, so no wait_for_function: poll
    while page.locator("tr.sample-row").count() < 400 and time.time() < deadline:
        time.sleep(0.05)
    page.locator("tr.sample-row").nth(399).click()
    assert page.locator("tr.detail .tok").count() == 60 + 40 + 20 + 30
    size = path.stat().st_size / 1e6
    print(f"10,000 trajectories: page written in {written:.1f} s ({size:.0f} MB), opened in {opened:.1f} s")
    assert opened < 10.0 and written < 60.0
    assert errors == []
