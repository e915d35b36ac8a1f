"""Pipeline parallelism, the first part of it (integration tier; the world pp2, 2 ranks, ~40 s): the
decoder split over two stages by Megatron's rules, each stage converted from the HF checkpoint with its
own layers, two packed rows of different lengths through Megatron's 1F1B schedule (``run_pipeline``,
CPU-patched): the last stage's log-probs equal the whole decoder's in one process, forward only and with
the backward, and every stage's gradients equal the same layers' of the whole decoder, for the text
families (dense and MoE) and an untied model; tied embeddings' two copies get the summed gradient. The
train step on the schedule, the vision tower and `--pipeline-model-parallel-size` are not built yet."""

import pytest

# log-probs and every untied gradient exact; the tied embedding is the sum of two stages' gradients,
# another order of the same sum (4.8e-7 on this machine): the 1e-6
TOLERANCE = 1e-6

KINDS = ["llama", "qwen2", "qwen3", "qwen3-moe", "llama-untied"]


@pytest.mark.parametrize("kind", KINDS)
def test_two_pipeline_stages_score_and_train_as_the_whole_decoder(megatron_pp2, kind):
    result = megatron_pp2["pipeline"][kind]
    assert result["pp_size"] == 2
    layers = 4 if kind == "llama-untied" else 2
    assert result["stages"] == [[0, layers // 2], [layers // 2, layers]]  # Megatron's even split
    assert result["rows_scored_per_rank"] == [0, 2]  # forward only: the last stage scores both rows
    assert result["logprob_max_diff"] == 0.0
    assert result["grad_max_diff"] == 0.0
    assert result["tied"] == (kind != "llama-untied")
    assert result["tied_grad_max_diff"] <= TOLERANCE
    first, last = result["parameters_per_rank"]
    # every parameter is on one stage, but the tied embedding's copy on the last one
    extra = last + first - result["whole_parameters"]
    assert extra == 0 if not result["tied"] else extra > 0
