"""The memory plan against real Megatron ranks (integration tier). Its parameters per rank equal the built
model's on every family at TP=1, TP=2, EP=2, TP=2 x EP=2 with ETP=1 and CP=2 (read from the matrix
worlds the other backend tests launch: no cost of its own). Its peak is within 15% of the measured peak
RSS of two train steps (``benchmarks/memory_plan.py``'s measurement: a small Llama, 4,096 tokens per
micro-batch, CP=1 without recompute and CP=2 with full recompute; ~15 s and ~25 s)."""

import pytest
from megatron_worlds import FAMILIES, MOE_FAMILIES
from train_helpers import REPO

from slime_mt.backends.megatron.families import decoder_spec, read_hf_config
from slime_mt.backends.megatron.memory_plan import plan_rank
from slime_mt.plugins import load_module


@pytest.mark.parametrize("which", ["tp1", "tp2", "ep2", "tp2ep2_etp1", "cp2", "tp2sp"])
def test_the_plan_counts_each_ranks_parameters_as_megatron_builds_them(world, which):
    kinds = MOE_FAMILIES if which.startswith(("ep2", "tp2ep2")) else FAMILIES
    for kind in kinds:
        counts = world(which, kind)["parameters"][kind]
        assert counts["built"] == counts["plan"], (which, kind, counts)
        assert counts["built"][1] > 0 if "vl" in kind else counts["built"][1] == 0  # the frozen vision tower


@pytest.mark.parametrize("cp, recompute", [(1, "off"), (2, "full")])
def test_the_planned_peak_is_within_15_percent_of_the_measured_one(cp, recompute):
    bench = load_module(str(REPO / "benchmarks/memory_plan.py"))
    spec = decoder_spec(read_hf_config(bench.model_dir()))
    plan = plan_rank(spec, bench.train_config(cp, recompute, 4096), 4096).total
    measured = bench.measure(cp, recompute, 4096)
    assert "failed" not in measured, measured
    assert 0.85 < plan / measured["peak"] < 1.15, (plan, measured)
