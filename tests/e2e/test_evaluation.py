"""Issue 69: slime's example multi-task eval YAML (its text, with this machine's paths) evaluates three
datasets in a training run: the baseline before the first step and after every --eval-interval steps,
each dataset with its own samples per prompt and the defaults' sampling, the metric names slime users
read, the curves in the summary and the plot; no evaluated sample reaches a training batch (the dumps of
what each step trained), each evaluation is dumped apart (``eval_N``, as slime names it); ``slime-mt
eval`` on the run's final checkpoint reproduces its last evaluation (greedy: a sampled token may differ
where the engine's batches differ, as the weights pushed to an engine and the same weights loaded from
the checkpoint agree to 1e-5, tests/e2e/test_ray_faults.py). The demo's secret-word game (two turns, an
environment) on the tiny Qwen2, two steps of four samples, two evaluations of 16 + 2 + 1 trajectories (a
held-out word a dataset)."""

import json
import subprocess
import sys

import pytest
from eval_helpers import SLIME_MULTI_TASK
from inspection_helpers import dump_template
from train_helpers import PLUGINS, REPO, STOPS, TWO_SMALL_STEPS, demo_train_cmd, metrics, run

from slime_mt.config.checkpoint import dump_path
from slime_mt.inspection.dumps import load_dump
from slime_mt.inspection.report import dump_files, text_summary
from slime_mt.metrics import read_evals


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory, tiny_paths):
    """The run -> (its folder, the held-out secrets, the training secrets)."""
    root = tmp_path_factory.mktemp("evaluated")
    subprocess.run([sys.executable, str(REPO / "examples/demo/make_data.py"), str(root / "data")], check=True, cwd=REPO)
    held_out = (root / "data/eval.jsonl").read_text().splitlines()
    paths = {}
    for i, name in enumerate(("aime", "gpqa", "ifbench")):  # a held-out word each
        paths[name] = root / f"{name}.jsonl"
        paths[name].write_text(held_out[i] + "\n")
    (root / "multi_task.yaml").write_text(SLIME_MULTI_TASK.format(**paths))
    (root / "plugins.py").write_text(PLUGINS)  # the grader of all three (ifbench has none here)
    run_dir = root / "run"
    cmd = demo_train_cmd(
        tiny_paths["qwen2"],
        root / "data/train.jsonl",
        run_dir,
        *TWO_SMALL_STEPS,
        *("--eval-config", str(root / "multi_task.yaml"), "--eval-interval", "2"),
        *("--custom-rm-path", f"{root}/plugins.py:rm", "--rollout-stop-token-ids", *STOPS),
        *("--rollout-max-context-len", "128"),  # the turns of slime's max_response_len 16384 end there
        *("--eval-temperature", "0"),  # greedy: the offline evaluation's figures equal the run's (below)
        *("--save-debug-rollout-data", dump_template(run_dir), "--save", str(run_dir / "ckpt")),
    )
    proc = run(cmd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[eval after 0 steps] aime reward" in proc.stdout
    secrets = lambda path: {json.loads(line)["secret"] for line in path.read_text().splitlines()}  # noqa: E731
    return run_dir, secrets(root / "data/eval.jsonl"), secrets(root / "data/train.jsonl"), cmd


def test_slimes_multi_task_yaml_evaluates_three_datasets_before_and_after_each_step(evaluated):
    run_dir, _, _, _ = evaluated
    evals = read_evals(run_dir)
    assert [e["step"] for e in evals] == [0, 2]  # the baseline, then after every two steps
    assert [e["eval/weight_version"] for e in evals] == [0.0, 2.0]
    for e in evals:
        for name, n, ks in (("aime", 16, (1, 2, 4, 8, 16)), ("gpqa", 2, (1, 2)), ("ifbench", 1, (1,))):
            assert e[f"eval/{name}/samples"] == n  # one prompt, the dataset's samples per prompt
            figures = [e[f"eval/{name}/pass@{k}"] for k in ks]
            assert all(0.0 <= p <= 1.0 for p in figures) and figures == sorted(figures)  # pass@k grows with k
            assert 0.0 <= e[f"eval/{name}/reward_mean"] <= 1.1 and e[f"eval/{name}/failed_rate"] == 0.0
            assert 0.0 <= e[f"eval/{name}/truncated_rate"] <= 1.0 and e[f"eval/{name}/response_length_mean"] > 0
        assert f"eval/aime/pass@{32}" not in e
    assert not any(k.startswith("eval/") for r in metrics(run_dir) for k in r)  # the step rows: training only


def test_no_evaluated_sample_reaches_a_training_batch(evaluated):
    run_dir, held_out, train, _ = evaluated
    assert not held_out & train
    for step in (0, 1):
        dump = load_dump(dump_path(dump_template(run_dir), step))
        assert {s["metadata"]["rollout_id"] for s in dump["samples"]} == {step}
        assert {s["label"] for s in dump["samples"]} <= train
        assert len(dump["train"]["samples"]) == 4
    assert list(dump_files(run_dir)) == [0, 1]  # an evaluation's dump is no training step's (replay reads these)
    # each evaluation's own dump (slime's eval_N): the held-out rows only, nothing trained, its figures
    evals = read_evals(run_dir)
    assert list(dump_files(run_dir, evaluation=True)) == [e["step"] for e in evals] == [0, 2]
    for e in evals:
        dump = load_dump(dump_path(dump_template(run_dir), f"eval_{e['step']}"))
        assert dump["eval"] == {"after_steps": e["step"], "datasets": [["aime", 16], ["gpqa", 2], ["ifbench", 1]]}
        assert {s["label"] for s in dump["samples"]} <= held_out and dump["train"]["samples"] == []
        start = 0
        for name, count in dump["eval"]["datasets"]:
            rewards = [s["reward"] for s in dump["samples"][start : start + count]]
            start += count
            assert sum(rewards) / count == pytest.approx(e[f"eval/{name}/reward_mean"])


def test_the_summary_and_the_plot_show_each_datasets_curve(evaluated):
    run_dir, _, _, _ = evaluated
    summary = text_summary(run_dir)
    for name in ("aime", "gpqa", "ifbench"):
        assert f"eval/{name}/reward_mean: " in summary and "after 0 steps" in summary
    assert "eval after 2 steps: aime 16 samples, " in summary and "; ifbench 1 samples, 1 " in summary
    proc = run([sys.executable, "-m", "slime_mt.cli", "plot", str(run_dir)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (run_dir / "plots" / "reward.png").stat().st_size > 0


def test_slime_mt_eval_on_the_final_checkpoint_reproduces_the_runs_last_evaluation(evaluated, tmp_path):
    run_dir, _, _, cmd = evaluated
    flags = cmd[cmd.index("train") + 1 :]
    flags[flags.index("--log-dir") + 1] = str(tmp_path)
    flags[flags.index("--save-debug-rollout-data") + 1] = dump_template(tmp_path)
    proc = run([sys.executable, "-m", "slime_mt.cli", "eval", *flags, "--load", str(run_dir / "ckpt")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"the weights after 2 steps, evaluated into {tmp_path / 'eval.jsonl'}" in proc.stdout
    (offline,) = read_evals(tmp_path)
    timing = ("eval/seconds", "eval/update_wait_seconds")
    figures = lambda row: {k: v for k, v in row.items() if k not in timing}  # noqa: E731
    assert figures(offline) == figures(read_evals(run_dir)[-1])  # the weight version too: the checkpoint's
    ours, theirs = (load_dump(dump_path(dump_template(d), "eval_2")) for d in (tmp_path, run_dir))
    assert [s["tokens"] for s in ours["samples"]] == [s["tokens"] for s in theirs["samples"]]  # token for token
    # without held-out datasets there is nothing to evaluate: said before anything starts
    bare = flags[: flags.index("--eval-config")] + flags[flags.index("--eval-config") + 2 :]
    refused = run([sys.executable, "-m", "slime_mt.cli", "eval", *bare])
    assert refused.returncode == 2 and "needs held-out datasets" in refused.stderr, refused.stderr[-2000:]
