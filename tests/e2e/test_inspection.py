"""Inspecting a run: rollout dumps (saved, loaded with and without slime_mt, replayed), rollout-only
runs, turn records, the trace, and ``slime-mt inspect`` (its text summary, and its HTML page driven
in the operating system's Chromium through Playwright).

Two real runs are shared by the module: a rollout-only run of the tiny Qwen2.5-VL on geo3k (step-wise,
the ``window:1`` context policy, an environment whose first step of every episode fails once), and a
two-step run of the demo recipe that a train-only run replays."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from inspection_helpers import (
    SAMPLE_FIELDS,
    SEQUENCE_FIELDS,
    TRAIN_FIELDS,
    TURN_FIELDS,
    assert_dumped_train_log_probs,
    assert_nested,
    dump_template,
    lanes_by_name,
    open_page,
)
from train_helpers import PLUGINS, REPO, STOPS, TWO_SMALL_STEPS, demo_train_cmd, geo3k_train_cmd, make_geo3k, repo_env

from slime_mt.config.checkpoint import dump_path
from slime_mt.inspection.dumps import load_dump, samples_of, train_batch_of
from slime_mt.inspection.report import write_report
from slime_mt.timeline import load_trace
from slime_mt.types import Status

FLAKY_GEO3K = '''
from envs import geo3k
from envs.base import RetryableEnvError


class FlakyGeo3k(geo3k.Geo3kEnv):
    """geo3k whose first step of every episode fails once (a retryable fault)."""

    failed = False

    def step(self, response_text):
        if not self.failed:
            self.failed = True
            raise RetryableEnvError("the first step of every episode fails once")
        return super().step(response_text)


def build_env(sample=None, args=None, **kw):
    env = geo3k.build_env(sample=sample, args=args)
    env.__class__ = FlakyGeo3k
    return env
'''
# runs the CLI, then says which packages the process imported
IMPORTS_AFTER = (
    "import sys; from slime_mt.cli import main; rc = main(sys.argv[1:]); "
    "import json; print('IMPORTED', json.dumps(sorted({m.split('.')[0] for m in sys.modules} | "
    "{m for m in sys.modules if m.startswith('slime_mt.engine')}))); sys.exit(rc)"
)


def imported(stdout: str) -> list[str]:
    # JSON, not ast.literal_eval: CPython 3.11.7's AST constructor can raise "recursion depth
    # mismatch" when another thread of the test process builds an AST at the same time
    return json.loads(stdout.split("IMPORTED ", 1)[1].splitlines()[0])


def run_cli(args: list[str], timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", IMPORTS_AFTER, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=repo_env(),
        cwd=REPO,
    )


@pytest.fixture(scope="module")
def rollout_only(tmp_path_factory):
    """Two steps of ``--debug-rollout-only`` on the tiny VLM: step-wise with merging, ``window:1``,
    a flaky environment, dumps saved."""
    root = tmp_path_factory.mktemp("rollout_only")
    geo3k = make_geo3k(root / "geo3k")
    (root / "flaky_geo3k.py").write_text(FLAKY_GEO3K)
    run_dir = root / "run"
    cmd = geo3k_train_cmd(
        geo3k,
        run_dir,
        "--debug-rollout-only",
        "--save-debug-rollout-data",
        dump_template(run_dir),
        "--rollout-interaction-env-path",
        str(root / "flaky_geo3k.py"),
        "--context-policy",
        "window:1",
        "--sample-format",
        "step_wise",
        "--merge-step-wise",
    )
    proc = run_cli(cmd[3:])  # the flags after "python -m slime_mt.cli"
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir, imported(proc.stdout)


def dumps_of(run_dir: Path) -> list[dict]:
    return [load_dump(dump_path(dump_template(run_dir), k)) for k in range(2)]


def test_rollout_only_writes_dumps_and_builds_no_model(rollout_only):
    run_dir, modules = rollout_only
    assert "megatron" not in modules  # no Megatron model was built: megatron was never imported
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert all("rollout/reward_mean" in r and not any(k.startswith("train/loss") for k in r) for r in rows)
    assert not (run_dir / "ckpt").exists()
    data = dumps_of(run_dir)
    assert [d["rollout_id"] for d in data] == [0, 1]


def test_dumps_hold_every_field_and_load_without_slime_mt(rollout_only):
    run_dir, _ = rollout_only
    path = dump_path(dump_template(run_dir), 0)
    # plain data and tensors: torch alone reads it, slime_mt is never imported
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json, sys, torch; d = torch.load(sys.argv[1], weights_only=True); r = json.loads(d['records']); "
            "print(len(r['samples']), d['format'], d['version'], min(d['tensors']), 'slime_mt' in sys.modules)",
            str(path),
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd="/",
    )
    data = load_dump(path)
    first_tensor = "samples/0/multimodal_train_inputs/image_grid_thw"
    assert probe.stdout.split() == [str(len(data["samples"])), "slime_mt.rollout_dump", "1", first_tensor, "False"]
    assert set(data["train"]) == TRAIN_FIELDS
    for record in data["samples"]:
        assert set(record) == SAMPLE_FIELDS
        assert all(set(t) == TURN_FIELDS for t in record["turns"])
        # the prompt's image, as a PNG file beside the dump, and its tensors
        assert len(record["images"]) == 1
        with open(path.parent / record["images"][0], "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        grid = record["multimodal_train_inputs"]["image_grid_thw"]
        assert record["multimodal_train_inputs"]["pixel_values"].shape[0] == int(grid.prod(dim=-1).sum())
    for record in data["train"]["samples"]:
        assert set(record) == SEQUENCE_FIELDS
        assert record["train_log_probs"] is None  # a rollout-only run trains nothing
    # and with the project's types: valid Samples, and the batch that trained
    for sample, record in zip(samples_of(data), data["samples"]):
        sample.validate()
        assert sample.tokens == record["tokens"] and sample.status == Status(record["status"])
        assert sample.metadata["dump_images"] == record["images"]
    batch = train_batch_of(data)
    assert batch.advantages == data["train"]["advantages"] and len(batch.samples) == len(batch.advantages)
    assert batch.samples[0].turns == data["train"]["samples"][0]["turns"]


def test_turn_records_agree_with_the_samples(rollout_only):
    run_dir, _ = rollout_only
    lines = [json.loads(line) for line in (run_dir / "turns.jsonl").read_text().splitlines()]
    expected = []
    for data in dumps_of(run_dir):
        for s in data["samples"]:
            for k, t in enumerate(s["turns"]):
                rewritten = t["context_ids"] is not None
                expected.append(
                    {
                        "step": data["rollout_id"],
                        "sample": s["index"],
                        "group": s["group_index"],
                        "turn": k,
                        "context_tokens": len(t["context_ids"]) if rewritten else t["output_start"],
                        "generated_tokens": t["output_end"] - t["output_start"],
                        "observation_tokens": t["observation_end"] - t["output_end"],
                        "finish_reason": t["finish_reason"],
                        "retries": t["env_retries"],
                        "invalid_action": False,
                        "reward": t["reward"],
                        "weight_version": t["weight_version"],
                        "context_rewritten": rewritten,
                        "status": s["status"],
                        "termination": s["metadata"].get("termination"),
                    }
                )
    assert [{k: line[k] for k in expected[0]} for line in lines] == expected
    # the run exercised what the records are for: retried env steps and rewritten contexts
    assert sum(line["retries"] for line in lines) >= 1
    assert any(line["context_rewritten"] for line in lines)
    assert all(line["engine_seconds"] > 0 for line in lines)


def test_trace_holds_every_engine_call_and_env_step_nested_in_its_trajectory(rollout_only):
    run_dir, _ = rollout_only
    events = load_trace(run_dir / "trace.json")
    json.loads((run_dir / "trace.json").read_text())  # a finished run's trace is plain JSON
    assert_nested(events)
    lanes = lanes_by_name(events)
    for data in dumps_of(run_dir):
        for s in data["samples"]:
            spans = lanes[("rollout side", f"sample {s['group_index']}/{s['index']}")]
            assert [e["name"] for e in spans if e["name"] == "sample"] == ["sample"]
            calls = [e for e in spans if e["name"] == "generate"]
            assert [c["args"]["finish_reason"] for c in calls] == [t["finish_reason"] for t in s["turns"]]
            steps = [e for e in spans if e["name"] == "env.step"]
            assert sum(e["args"]["retries"] for e in steps) == sum(t["env_retries"] for t in s["turns"])
    assert [e["args"]["step"] for e in lanes[("rollout side", "steps")] if e["name"] == "take batch"] == [0, 1]


def test_inspect_text_lists_every_sample_of_the_step(rollout_only):
    run_dir, _ = rollout_only
    data = dumps_of(run_dir)[1]
    proc = subprocess.run(
        [sys.executable, "-m", "slime_mt.cli", "inspect", str(run_dir), "--text", "--step", "1"],
        capture_output=True,
        text=True,
        env=repo_env(),
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    turns = sum(len(s["turns"]) for s in data["samples"])
    assert f"step 1: {len(data['samples'])} samples in 2 groups, {turns} turns" in proc.stdout
    for s in data["samples"]:
        assert f"  sample {s['index']} (group {s['group_index']}): {s['status']}" in proc.stdout
    missing = subprocess.run(
        [sys.executable, "-m", "slime_mt.cli", "inspect", str(run_dir), "--step", "7"],
        capture_output=True,
        text=True,
        env=repo_env(),
        cwd=REPO,
    )
    assert missing.returncode == 2 and "--step 7: no dump of that step" in missing.stderr


def test_the_page_is_self_contained(rollout_only, tmp_path):
    run_dir, _ = rollout_only
    html = write_report(run_dir, tmp_path / "report.html").read_text()
    assert re.search(r"https?://|//[a-z0-9.-]+\.[a-z]{2,}/", html, re.IGNORECASE) is None
    assert re.findall(r"""\b(?:src|href)\s*=\s*["'](?!data:)""", html) == []
    assert "<link" not in html and "@import" not in html


# ---------------------------------------------------------------- unit-level: what the page and records are made of


# ---------------------------------------------------------------- replay


def dump_and_replay(root: Path, model: Path, *extra: str) -> tuple[Path, Path]:
    """Two steps of the demo recipe (a quarter of its samples) with dumps, then the same flags trained
    again from the dumps against an --engine-url where nothing listens -> (run folder, replay folder)."""
    subprocess.run([sys.executable, str(REPO / "examples/demo/make_data.py"), str(root / "data")], check=True, cwd=REPO)
    (root / "plugins.py").write_text(PLUGINS)  # varied rewards: every group has an advantage
    flags = [*TWO_SMALL_STEPS, "--eval-interval", "100", "--custom-rm-path", f"{root}/plugins.py:rm", *extra]
    original, replay = root / "original", root / "replay"
    for run_dir, more in (
        (original, ["--save-debug-rollout-data", dump_template(original)]),
        (replay, ["--engine-url", "http://127.0.0.1:9", "--load-debug-rollout-data", dump_template(original)]),
    ):
        cmd = demo_train_cmd(model, root / "data/train.jsonl", run_dir, *flags, *more)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=repo_env(), cwd=REPO)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return original, replay


# The dump and replay checks are plumbing: the tiny random Qwen2 (its turns end early at STOPS) runs them
# in bf16 in ~85 s where SmolLM2-135M took 520-630 s (bf16 matmuls on CPUs without bf16 instructions);
# SmolLM2 runs them on a GPU (test_a_replayed_dump_trains_alike_on_cuda_in_bf16).
TINY_BF16 = ("--bf16", "--rollout-stop-token-ids", *STOPS)


@pytest.fixture(scope="module")
def demo_dumped(tmp_path_factory, tiny_paths):
    """The demo recipe in bf16 on the tiny Qwen2 (the run the bf16 test reads too), and its replay."""
    return dump_and_replay(tmp_path_factory.mktemp("demo_dumped"), tiny_paths["qwen2"], *TINY_BF16)


def test_the_demo_recipe_trains_in_bf16(demo_dumped):
    """The CPU demo's recipe (on the tiny Qwen2) for two steps with --bf16, at a quarter of its
    samples: bf16 parameters and activations, fp32 main parameters, gradients and log-softmax; the
    engine keeps serving the pushed weights, and the bf16-vs-engine log-prob gap is logged."""
    original, _ = demo_dumped
    rows = [json.loads(line) for line in (original / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        for key in ("train/loss", "train/grad_norm", "train/train_rollout_logprob_abs_diff", "rollout/reward_mean"):
            assert r[key] == r[key] and abs(r[key]) < 1e6, (key, r[key])  # finite
        assert r["train/grad_norm"] > 0
        assert 1e-4 < r["train/train_rollout_logprob_abs_diff"] < 0.5  # bf16 training vs the fp32 engine
    assert [r["rollout/weight_version"] for r in rows] == [1.0, 2.0]
    assert rows[1]["rollout/sample_weight_version_min"] == 1.0


def test_each_dump_holds_the_trainers_log_probs_and_their_gap_is_the_logged_one(demo_dumped):
    """Issue 44 item 14: after a step trains, its dump holds the trainer's log-prob of every response
    token of every training sequence (bf16 here); their gap to the engine's, reduced as the loss
    reduces it (seq_mean_token_mean), is the step's train/train_rollout_logprob_abs_diff (TP=2, under
    torchrun and on Ray: tests/e2e/test_launchers.py)."""
    original, _ = demo_dumped
    assert len(assert_dumped_train_log_probs(original, "seq_mean_token_mean")) == 2


def assert_same_training(original: Path, replay: Path) -> None:
    a = [json.loads(line) for line in (original / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(line) for line in (replay / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in b] == [0, 1]
    assert all(r["train/grad_norm"] > 0 for r in a)  # the steps learned something to compare
    for key in ("train/loss", "train/pg_loss", "train/grad_norm", "train/entropy"):
        assert [r[key] for r in b] == pytest.approx([r[key] for r in a], rel=1e-6), key
    assert [r["rollout/reward_mean"] for r in b] == [r["rollout/reward_mean"] for r in a]


@pytest.mark.gpu
def test_a_replayed_dump_trains_alike_on_cuda_in_bf16(tmp_path, smollm2_path):
    """The replay check of the bf16 demo run below, on the GPU."""
    assert_same_training(*dump_and_replay(tmp_path, smollm2_path, "--bf16"))


def test_a_replayed_dump_trains_with_the_same_loss_and_gradients(demo_dumped):
    original, replay = demo_dumped
    assert_same_training(original, replay)
    # the replay's trace holds its train steps, and no engine call or weight update: it ran against
    # an --engine-url where nothing listens, and never went there
    lanes = lanes_by_name(load_trace(replay / "trace.json"))
    assert {lane for _, lane in lanes}.isdisjoint({"weights", "update gate"})
    assert not any(e["name"] == "generate" for spans in lanes.values() for e in spans)
    assert [e["args"]["step"] for e in lanes[("trainer rank 0", "train")] if e["name"] == "train step"] == [0, 1]


def test_a_replay_with_other_settings_or_no_dump_stops_naming_it(demo_dumped, tiny_paths, tmp_path):
    original, _ = demo_dumped
    prompts = original.parent / "data/train.jsonl"

    def replay(template: str, *extra: str) -> subprocess.CompletedProcess:
        cmd = demo_train_cmd(tiny_paths["qwen2"], prompts, tmp_path / "replay", *TWO_SMALL_STEPS, *extra)
        cmd += ["--load-debug-rollout-data", template]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=repo_env(), cwd=REPO)

    other = replay(dump_template(original), *TINY_BF16, "--advantage-estimator", "rloo")
    assert other.returncode == 2, other.stderr[-2000:]
    assert "advantage_estimator='grpo' (now 'rloo')" in other.stderr
    missing = replay(str(tmp_path / "x_{rollout_id}.pt"))
    assert missing.returncode == 2 and "no dump of step 0" in missing.stderr


# ---------------------------------------------------------------- the page in a real browser


def expected_classes(record: dict, sequences: list[dict]) -> list[str]:
    """From the dump alone: prompt, then per response token observation (mask 0), trained output
    (mask 1 and a sequence trained it) or masked."""
    trained = set()
    for seq in sequences:
        for k in seq["turns"] if seq["turns"] is not None else range(len(record["turns"])):
            t = record["turns"][k]
            if any(seq["loss_mask"]):
                trained.update(range(t["output_start"], t["output_end"]))
    classes = ["tok-p"] * record["prompt_length"]
    for j, m in enumerate(record["loss_mask"]):
        position = record["prompt_length"] + j
        classes.append("tok-b" if m == 0 else ("tok-o" if position in trained else "tok-x"))
    return classes


def test_the_page_shows_every_sample_turn_and_token_as_the_dump_has_them(rollout_only, browser, tmp_path):
    run_dir, _ = rollout_only
    path = write_report(run_dir, tmp_path / "report.html", step=1)
    data = dumps_of(run_dir)[1]
    page, errors = open_page(browser, path)
    counts = page.locator("#counts")
    assert int(counts.get_attribute("data-samples")) == len(data["samples"])
    assert int(counts.get_attribute("data-turns")) == sum(len(s["turns"]) for s in data["samples"])
    rows = page.locator("tr.sample-row")
    assert rows.count() == len(data["samples"])
    by_id: dict[str, list[dict]] = {}
    for seq in data["train"]["samples"]:
        by_id.setdefault(seq["trajectory_id"], []).append(seq)
    removed_seen = 0
    for i, record in enumerate(data["samples"]):
        rows.nth(i).click()
        detail = page.locator("tr.detail")
        assert detail.locator(".turn").count() == len(record["turns"])
        stream = detail.locator(f".tokens[data-sample='{record['index']}'] .tok")
        classes = stream.evaluate_all("nodes => nodes.map(n => n.className.split(' ')[1])")
        assert classes == expected_classes(record, by_id[f"{record['group_index']}/{record['index']}"])
        assert detail.locator(".images img").first.get_attribute("src").startswith("data:image/png;base64,")
        # hovering a generated token shows its id, log-prob and version
        k = classes.index("tok-o")
        stream.nth(k).hover()
        tip = page.locator("#tooltip").inner_text()
        r = k - record["prompt_length"]
        assert f"id {record['tokens'][k]}" in tip
        assert float(re.search(r"log-prob (\S+)", tip).group(1)) == pytest.approx(
            record["rollout_log_probs"][r], abs=1e-3
        )
        assert f"version {record['token_versions'][r]}" in tip
        # a rewritten context shows what the policy removed
        for n, t in enumerate(record["turns"]):
            if t["context_ids"] is None:
                continue
            turn = detail.locator(f".turn[data-turn='{n}']")
            turn.locator("summary").click()
            turn.locator(".context").wait_for()  # drawn by the details' toggle event, which comes after the click
            removed = sum(i2 - i1 for tag, i1, i2, _, _ in _ops(record, t) if tag in ("delete", "replace"))
            assert turn.locator(".context .tok-removed").count() == removed > 0
            removed_seen += 1
        rows.nth(i).click()  # closed again
    assert removed_seen > 0
    shot = tmp_path / "viewer.png"
    page.set_viewport_size({"width": 1300, "height": 1500})
    rows.nth(0).click()
    page.keyboard.press("Home")
    page.locator("tr.detail .tok-o").first.hover()
    page.screenshot(path=str(shot))
    assert shot.stat().st_size > 20_000
    if os.environ.get("SLIME_MT_SCREENSHOT"):  # the picture of the README and the docs' home is taken here
        shutil.copy(shot, os.environ["SLIME_MT_SCREENSHOT"])
    assert errors == []


def _ops(record: dict, turn: dict) -> list:
    from slime_mt.inspection.report import context_ops

    return context_ops(record["tokens"][: turn["output_start"]], turn["context_ids"])
