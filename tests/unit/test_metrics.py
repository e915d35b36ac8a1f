"""Metrics sinks and plots."""

import json


def test_plots_count_steps_in_integers_and_draw_async_only_for_async_runs(tmp_path):
    from slime_mt.metrics import PLOTS, figure, plot_run

    sync_rows = [
        {
            "step": k,
            "rollout/reward_mean": k / 4,
            "rollout/token_version_gap_max": 0.0,
            "rollout/token_version_gap_mean": 0.0,
        }
        for k in range(5)
    ]
    fig = figure(sync_rows, PLOTS["reward.png"])
    ticks = fig.axes[0].get_xticks()
    assert len(ticks) > 1 and all(float(t).is_integer() for t in ticks), ticks  # not 0.2, 0.4, ...
    for rows, folder, drawn in (
        (sync_rows, tmp_path / "sync", False),
        (
            [{**r, "rollout/token_version_gap_max": 1.0, "rollout/token_version_gap_mean": 0.5} for r in sync_rows],
            tmp_path / "async",
            True,
        ),
    ):
        folder.mkdir()
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        names = [p.name for p in plot_run(folder)]
        assert ("async.png" in names) == drawn and "reward.png" in names


def test_a_resumed_run_drops_the_steps_and_evaluations_it_writes_again(tmp_path):
    """Resumed at step 2 (two steps trained): metrics rows of steps 0-1 stay, the evaluations after 0, 1
    and 2 steps stay (the one after 2 steps evaluated the weights the run resumes from), later ones go."""
    from slime_mt.metrics import MetricsLogger, read_evals, read_metrics

    logger = MetricsLogger(tmp_path, use_tensorboard=False)
    for step in range(4):
        logger.log(step, {"rollout/reward_mean": step / 4})
    for steps_trained in (0, 2, 4):
        logger.log_eval(steps_trained, {"eval/a/reward_mean": steps_trained / 8})
    logger.truncate_after(2)
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1]
    assert [(e["step"], e["eval/a/reward_mean"]) for e in read_evals(tmp_path)] == [(0, 0.0), (2, 0.25)]
    logger.log_eval(4, {"eval/a/reward_mean": 0.75})  # the resumed run's own
    assert [e["step"] for e in read_evals(tmp_path)] == [0, 2, 4]
