"""Inspecting a run: rollout dumps (saved, loaded with and without slime_mt, replayed), rollout-only
runs, turn records, the trace, and ``slime-mt inspect`` (its text summary, and its HTML page driven
in the operating system's Chromium through Playwright).

Two real runs are shared by the module: a rollout-only run of the tiny Qwen2.5-VL on geo3k (step-wise,
the ``window:1`` context policy, an environment whose first step of every episode fails once), and a
two-step run of the demo recipe that a train-only run replays."""

import time

import pytest
from inspection_helpers import open_page
from train_helpers import REPO

from slime_mt.config.checkpoint import dump_path
from slime_mt.inspection.dumps import add_train_log_probs, save_dump
from slime_mt.inspection.report import page_data, write_report
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


def mixed_step(run_dir):
    """A dumped step of 8 trajectories in 2 groups: completed ones with rewards and per-turn rewards, a
    truncated one, two FAILED ones; and its metrics row as the run logs it."""
    import json
    import math

    from slime_mt.rollout.finalize import finalize
    from slime_mt.rollout.metrics import rollout_metrics
    from slime_mt.types import Sample, Status, TrainBatch

    groups = []
    for g in range(2):
        group = []
        for k in range(4):
            s = Sample(index=4 * g + k, group_index=g, prompt="p")
            s.set_prompt_tokens(list(range(100, 110)))
            s.append_turn([200 + k, 201, 202, 203], [-0.05 * (k + 1), -1.5, -0.2 * k, -3.0], weight_version="1")
            s.turns[-1].reward = 0.25 * k
            s.append_observation([300, 301])
            s.append_turn([240 + g, 241, 242], [-0.01, -2.5, -0.7], weight_version="1")
            s.status, s.reward = Status.COMPLETED, float(k % 2)
            group.append(s)
        groups.append(group)
    groups[0][2].status, groups[0][2].metadata["termination"] = Status.TRUNCATED, "engine_length"
    for s in (groups[0][3], groups[1][1]):
        s.status, s.reward, s.metadata["error"] = Status.FAILED, 0.0, "env step raised ValueError: boom"
    samples = [s for g in groups for s in g]
    live = [s for s in samples if s.status != Status.FAILED]
    sequences, _ = finalize(live, "concat", False)
    batch = TrainBatch(sequences, [1.0] * len(sequences), {}, {}, 0.0, 0.0, {}, [0, 1], "")
    path = save_dump(dump_path(str(run_dir / "dumps/rollout_{rollout_id}.pt"), 0), 0, groups, batch, {})
    # the trainer's log-probs, as a trained step adds them: the engine's moved by a varied gap
    add_train_log_probs(
        path,
        {
            i: [lp - 0.03 * (j % 5) * (i + 1) for j, lp in enumerate(seq.rollout_log_probs)]
            for i, seq in enumerate(sequences)
        },
    )
    row = {"step": 0, **rollout_metrics(groups)}
    (run_dir / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    assert math.isclose(row["rollout/reward_mean"], 2 / 6)
    return samples, row


def test_the_page_filters_sorts_searches_and_draws_the_log_prob_heat_map_of_the_dump(browser, tmp_path):
    """Issue 44 item 14: filter to the FAILED rows (their reward shown as none), sort by reward, search
    tokens, per-turn rewards in the table, the truncation marked where the stream ends, each image once,
    labelled curve axes, and the heat maps' values (log-prob, and the train-vs-rollout gap) equal to
    the dump's; the text summary's
    reward mean is the metrics'."""
    from slime_mt.inspection.dumps import load_dump
    from slime_mt.inspection.report import text_summary

    samples, row = mixed_step(tmp_path)
    dump = load_dump(dump_path(str(tmp_path / "dumps/rollout_{rollout_id}.pt"), 0))
    path = write_report(tmp_path, tmp_path / "mixed.html", dumps=str(tmp_path / "dumps/rollout_{rollout_id}.pt"))
    page, errors = open_page(browser, path)
    rows = page.locator("tr.sample-row")
    assert rows.count() == 8
    page.select_option("#filter-status", "failed")
    failed = [s["index"] for s in dump["samples"] if s["status"] == "failed"]
    assert rows.count() == len(failed) == 2 and page.locator("#counts").get_attribute("data-shown") == "2"
    assert rows.locator("td:nth-child(1)").all_inner_texts() == [str(i) for i in failed]
    assert rows.locator("td.reward").all_inner_texts() == ["none", "none"]
    page.select_option("#filter-status", "")
    page.select_option("#sort", "reward-desc")
    rewards = rows.locator("td.reward").all_inner_texts()
    assert rewards == ["1", "1", "0", "0", "0", "0", "none", "none"]
    assert rows.first.locator("td.turn-rewards").inner_text() == "0.2500 \u2013"  # sample 1: turn 0 was given 0.25
    page.select_option("#sort", "index")
    # the heat map: every generated token's log-prob as the dump holds it (4 decimals), coloured by it
    page.select_option("#color", "lp")
    record = dump["samples"][1]
    rows.nth(1).click()
    heat = page.locator("tr.detail .tokens .tok.heat")
    values = [float(v) for v in heat.evaluate_all("nodes => nodes.map(n => n.dataset.lp)")]
    expected = [round(lp, 4) for lp, m in zip(record["rollout_log_probs"], record["loss_mask"]) if m]
    assert values == pytest.approx(expected, abs=1e-9) and len(values) == 7
    greens = heat.evaluate_all("nodes => nodes.map(n => Number(getComputedStyle(n).backgroundColor.split(',')[1]))")
    order = sorted(range(len(values)), key=lambda j: values[j])
    assert [greens[j] for j in order] == sorted(greens)  # the less likely, the redder
    rows.nth(1).click()
    # the train-vs-rollout gap: the trainer's log-prob (the dump's training sequence) minus the engine's
    page.select_option("#color", "gap")
    rows.nth(1).click()
    heat = page.locator("tr.detail .tokens .tok.heat")
    gaps = [float(v) for v in heat.evaluate_all("nodes => nodes.map(n => n.dataset.gap)")]
    (sequence,) = [t for t in dump["train"]["samples"] if t["trajectory_id"] == "0/1"]
    expected = [
        round(t - r, 4)
        for t, r, m in zip(sequence["train_log_probs"], record["rollout_log_probs"], record["loss_mask"])
        if m
    ]
    assert gaps == pytest.approx(expected, abs=1e-9) and len(set(gaps)) > 3
    greens = heat.evaluate_all("nodes => nodes.map(n => Number(getComputedStyle(n).backgroundColor.split(',')[1]))")
    order = sorted(range(len(gaps)), key=lambda j: abs(gaps[j]), reverse=True)
    assert [greens[j] for j in order] == sorted(greens)  # the wider the gap, the redder
    rows.nth(1).click()
    page.select_option("#color", "role")
    # the truncated trajectory ends in the mark; search keeps the samples holding a token
    rows.nth(2).click()
    assert page.locator("tr.detail .tokens .trunc").inner_text() == "\u27c2 truncated: engine_length"
    rows.nth(2).click()
    page.fill("#search", "\u27e8240\u27e9")  # no tokenizer here: pieces are shown by id; 240 is group 0's
    assert rows.locator("td:nth-child(2)").all_inner_texts() == ["0"] * 4
    rows.first.click()
    assert page.locator("tr.detail .tok.match").count() == 1
    rows.first.click()
    page.fill("#search", "")
    assert page.locator(".curve .x-label").first.text_content() == "step"  # an SVG text: not an HTMLElement
    assert errors == []
    summary = text_summary(tmp_path, dumps=str(tmp_path / "dumps/rollout_{rollout_id}.pt"), step=0)
    assert f"reward mean {row['rollout/reward_mean']:.4g}" in summary  # 0.3333, FAILED ones left out
    assert "sample 3 (group 0): failed, reward none" in summary


def test_an_evaluations_dump_is_shown_apart_naming_its_datasets(browser, tmp_path):
    """Issue 69 item 2: the dump of an evaluation (``eval_N`` in the template, as slime names it) is a
    button of its own after the training steps, its summary names each dataset and its trajectories,
    a trajectory says it was evaluated, not trained; the text summary gives each dataset's figures;
    it is no training step's dump (a replay reads those) and ``--step`` shows that step alone."""
    from slime_mt.inspection.dumps import save_eval_dump
    from slime_mt.inspection.report import dump_files, text_summary

    template = str(tmp_path / "dumps/rollout_{rollout_id}.pt")
    samples, _ = mixed_step(tmp_path)
    datasets = [("gsm8k", [samples[:4]]), ("math", [samples[4:]])]
    save_eval_dump(dump_path(template, "eval_2"), 2, datasets, {})
    assert list(dump_files(tmp_path, template)) == [0] and list(dump_files(tmp_path, template, evaluation=True)) == [2]
    page, errors = open_page(browser, write_report(tmp_path, tmp_path / "eval.html", dumps=template))
    buttons = page.locator("#steps button")
    assert buttons.all_inner_texts() == ["step 0", "eval after 2 steps"]
    buttons.nth(1).click()
    counts = page.locator("#counts")
    assert counts.get_attribute("data-samples") == "8"
    assert counts.inner_text().startswith("eval after 2 steps: 8 samples") and "gsm8k 4, math 4" in counts.inner_text()
    page.locator("tr.sample-row").nth(5).click()
    assert page.locator("tr.detail .meta").first.inner_text() == "evaluated on math (not trained)"
    assert errors == []
    summary = text_summary(tmp_path, dumps=template)
    # gsm8k: samples 0-3, one FAILED (reward none), one truncated; math: samples 4-7, one FAILED
    assert "eval after 2 steps: gsm8k 4 samples, 2 completed, 1 truncated, 1 failed, reward mean 0.3333; " in summary
    assert "math 4 samples, 3 completed, 1 failed, reward mean 0.3333" in summary
    assert "eval after" not in text_summary(tmp_path, dumps=template, step=0)
    assert len(page_data(tmp_path, step=0, dumps=template)["steps"]) == 1
