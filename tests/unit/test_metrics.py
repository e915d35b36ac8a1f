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
