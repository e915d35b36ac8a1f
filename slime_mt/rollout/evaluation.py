"""Evaluation on the held-out datasets (``config/evaluation.py`` resolves them): each dataset's rows in
file order, each row a group of ``n_samples_per_eval_prompt`` trajectories through the same multi-turn
rollout as training, with the dataset's sampling, reward, generate function, environment and turns. Its
metrics (``eval_metrics``) are named ``eval/<dataset>/...``: the mean reward, pass@k for k = 1, 2, 4, ...
up to the samples per prompt (and that number itself), the truncated and failed shares and the response
length. A sample passes when its reward is 1 (slime's ``compute_pass_rate``); a failed sample counts as
reward 0. Nothing evaluated reaches a training batch: the groups go to the metrics and are dropped."""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import statistics

from slime_mt.config import EvalDataset, eval_datasets
from slime_mt.data import PromptDataset, load_rows
from slime_mt.errors import DatasetError
from slime_mt.rollout.group_rollout import rollout_groups, rollout_output
from slime_mt.types import Sample, Status


@dataclasses.dataclass
class EvalSet:
    """A held-out dataset and its rows."""

    dataset: EvalDataset
    rows: PromptDataset


def load_eval_sets(cfg) -> list[EvalSet]:
    """Every held-out dataset's rows (checked as training rows are; a bad row names its dataset); a
    dataset's ``rm_type`` goes into each row's metadata, as slime's ``inject_metadata`` puts it."""
    sets = []
    for d in eval_datasets(cfg):
        if not os.path.isfile(d.path):  # read here, not when the flags are: --dry-run needs no data
            raise DatasetError(f"eval dataset {d.name!r}: {d.path}: no such file")
        try:
            rows = load_rows(d.path, d.data_config(cfg.data))
        except DatasetError as err:
            raise DatasetError(f"eval dataset {d.name!r}: {err}") from None
        if d.rm_type:
            for row in rows:
                row.metadata = {**row.metadata, "rm_type": d.rm_type}
        sets.append(EvalSet(d, PromptDataset(rows, d.n_samples_per_eval_prompt)))
    return sets


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from ``n`` samples of which ``c`` passed (Chen et al., 2021):
    1 - C(n - c, k) / C(n, k)."""
    if not 0 < k <= n:
        raise ValueError(f"pass@{k} needs 0 < k <= n = {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def ks_for(n: int) -> list[int]:
    """The k reported for ``n`` samples per prompt: powers of two up to ``n``, and ``n``."""
    ks = [2**i for i in range(n.bit_length()) if 2**i <= n]
    return ks if ks[-1] == n else [*ks, n]


def eval_metrics(name: str, groups: list[list[Sample]], n: int) -> dict[str, float]:
    """One dataset's figures from its groups (each a prompt's ``n`` samples)."""
    samples = [s for g in groups for s in g]
    if not samples:
        return {f"eval/{name}/samples": 0.0}
    rewards = [float(s.reward or 0.0) if s.status != Status.FAILED else 0.0 for s in samples]
    prefix = f"eval/{name}/"
    out = {
        prefix + "reward_mean": statistics.fmean(rewards),
        prefix + "samples": float(len(samples)),
        prefix + "truncated_rate": sum(s.status == Status.TRUNCATED for s in samples) / len(samples),
        prefix + "failed_rate": sum(s.status == Status.FAILED for s in samples) / len(samples),
        prefix + "response_length_mean": statistics.fmean(s.response_length for s in samples),
    }
    passed = [sum(_passes(s) for s in g) for g in groups if len(g) == n]
    for k in ks_for(n) if passed else []:
        out[prefix + f"pass@{k}"] = statistics.fmean(pass_at_k(n, c, k) for c in passed)
    return out


def _passes(sample: Sample) -> bool:
    return sample.status != Status.FAILED and float(sample.reward or 0.0) == 1.0


def evaluate(ctx, sets: list[EvalSet], eval_fn, steps_trained: int) -> tuple[dict[str, float], list]:
    """Every dataset through ``eval_fn`` (None: the built-in group rollout) on the engines' current
    weights -> (the metrics of all datasets, each dataset's groups for the failure report)."""
    metrics: dict[str, float] = {}
    reports = []
    for es in sets:
        d = es.dataset
        rollout = dataclasses.replace(d.rollout_config(ctx.rollout), rollout_batch_size=len(es.rows.rows))
        env_changed = rollout.rollout_interaction_env_path != ctx.rollout.rollout_interaction_env_path
        dctx = dataclasses.replace(ctx, rollout=rollout, _env_module=None if env_changed else ctx._env_module)
        dctx.args = copy.copy(ctx.args)
        dctx.args.rollout_context = dctx
        es.rows.load_state_dict({"epoch": 0, "cursor": 0, "next_group": 0})
        rollout_id = 10_000_000 + steps_trained  # the samples' rollout_id: apart from every training step's
        if eval_fn is None:
            groups = ctx.run_sync(rollout_groups(dctx, es.rows, evaluation=True, rollout_id=rollout_id))
        else:
            groups, _ = rollout_output(eval_fn(dctx.args, rollout_id, es.rows, evaluation=True))
        metrics |= eval_metrics(d.name, groups, d.n_samples_per_eval_prompt)
        reports.append((d.name, groups))
    return metrics, reports
