"""The memory plan (backends/megatron/memory_plan.py) and ``--gpu-memory-gb`` (unit tier; no model built,
checkpoint headers only; under 2 s). The plan's parameters per rank against built Megatron models at
TP/EP/CP = 2, and its peaks against measured ones, are in tests/integration/backends/test_memory_plan.py."""

import dataclasses
import math

import pytest
from train_helpers import REPO

from slime_mt.assets import SIZED_MODELS
from slime_mt.backends.megatron.families import MoeOptions, decoder_spec, read_hf_config
from slime_mt.backends.megatron.logprobs import LOGIT_CHUNK_BYTES
from slime_mt.backends.megatron.memory_plan import (
    GIB,
    fitting_layout,
    plan_rank,
    plan_stages,
    rank_parameters,
    vision_parameters,
)
from slime_mt.backends.megatron.parallel import PipelineSplit, Stage
from slime_mt.config import TrainConfig
from slime_mt.config_parsing import parse_config
from slime_mt.errors import ConfigError
from slime_mt.plugins import load_module
from slime_mt.preflight import DEVICE_RESERVE_BYTES, memory_plan
from slime_mt.safetensors_files import CheckpointReader


def sized_spec(name: str, model_type: str):
    return decoder_spec({"model_type": model_type, **SIZED_MODELS[name][1]})


def test_every_familys_parameters_are_what_its_checkpoint_holds(tiny_paths):
    """At TP=1 a rank holds the whole model: the plan's count equals the checkpoint's elements (the vision
    tower frozen, the rest trained)."""
    for kind, path in tiny_paths.items():
        reader = CheckpointReader(path)
        held = sum(math.prod(reader.shape(name)) for name in reader.names())
        vision = vision_parameters(reader)
        count = rank_parameters(decoder_spec(read_hf_config(path)), 1, MoeOptions(), vision)
        assert (count.trained + count.frozen, count.frozen) == (held, vision), kind
        assert (vision > 0) == ("vl" in kind), kind


def test_a_published_model_has_its_published_size_and_tp_splits_all_but_norms():
    spec = sized_spec("qwen3-0.6b", "qwen3")  # the model card: 0.6B parameters, 0.44B without the embedding
    one = rank_parameters(spec, 1, MoeOptions()).trained
    embedding = spec.vocab_size * spec.hidden_size
    assert (round(one / 1e6), round((one - embedding) / 1e6)) == (596, 440)
    two = rank_parameters(spec, 2, MoeOptions()).trained
    norms = spec.num_layers * (2 * spec.hidden_size + 2 * spec.head_dim) + spec.hidden_size  # replicated
    assert two == (one - norms) // 2 + norms


def test_cp_splits_the_tokens_but_each_rank_keeps_the_rows_keys_and_values():
    spec, tokens = sized_spec("qwen3-0.6b", "qwen3"), 32768
    one = plan_rank(spec, TrainConfig(), tokens)
    two = plan_rank(spec, TrainConfig(context_parallel_size=2), tokens)
    assert (one.tokens, two.tokens) == (tokens, tokens // 2)
    assert (two.params, two.grads, two.optimizer) == (one.params, one.grads, one.optimizer)
    # without the keys and values every kept element halves; each rank keeps the whole row's
    kv = spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * tokens * 4
    assert one.activations - 2 * two.activations == pytest.approx(-kv, abs=16)
    assert two.total < 0.6 * one.total


def test_pipeline_stages_split_the_layers_and_the_first_keeps_every_micro_batch_in_flight():
    """Qwen3-0.6B (28 layers, tied) over 2 and 4 stages: each stage's parameters are its layers', the
    embedding on the first and its copy on the last; under 1F1B stage s keeps P - s micro-batches' worth
    of its layers' activations, so the first stage keeps as much as one rank without PP (but for the
    final norm's and the log-probs' rows, on the last stage only), and only the last projects logits."""
    spec, tokens = sized_spec("qwen3-0.6b", "qwen3"), 8192
    one = plan_rank(spec, TrainConfig(), tokens)
    whole = rank_parameters(spec, 1, MoeOptions()).trained
    embedding = spec.vocab_size * spec.hidden_size
    for pp in (2, 4):
        parts = PipelineSplit(pp).stages(spec.num_layers)
        assert [list(s.layers)[0] for s in parts] == list(range(0, 28, 28 // pp)) and parts[0].first and parts[-1].last
        counts = [rank_parameters(spec, 1, MoeOptions(), stage=s).trained for s in parts]
        assert sum(counts) == whole + embedding  # every layer once, the tied embedding twice
        plans = plan_stages(spec, TrainConfig(pipeline_model_parallel_size=pp), tokens)
        outside = (2 * spec.hidden_size + 57) * tokens * 4
        assert plans[0].activations == one.activations - outside
        assert [p.activations for p in plans[1:]] == [
            pytest.approx((pp - s) / pp * (one.activations - outside) + outside * (s == pp - 1), abs=8)
            for s in range(1, pp)
        ]
        assert plans[0].working == plans[-1].working == one.working  # a layer's backward: the larger here
        short = plan_stages(spec, TrainConfig(pipeline_model_parallel_size=pp), 512)  # the logits' chunks the larger
        assert short[0].working < short[-1].working == plan_rank(spec, TrainConfig(), 512).working
        assert plan_rank(spec, TrainConfig(pipeline_model_parallel_size=pp), tokens) == max(
            plans, key=lambda p: p.total
        )
    with pytest.raises(ValueError, match="28 layers leave 28 for 3 stages, which do not split evenly"):
        PipelineSplit(3).stages(28)


def test_an_uneven_split_gives_the_first_and_last_stages_their_layers_and_the_rest_evenly():
    """Megatron's uneven split (``--decoder-first/last-pipeline-num-layers``): the given stages hold their
    layers, the stages between split the rest evenly; a split that leaves layers over or short is refused
    naming the flags (Megatron would build a missing or a doubled layer without a word); the plan's
    stages follow the split (Qwen3-0.6B, 28 layers: 2 + 13 + 13 at PP=3)."""
    assert PipelineSplit(3, first=2).layer_counts(28) == [2, 13, 13]
    assert PipelineSplit(4, first=4, last=2).layer_counts(28) == [4, 11, 11, 2]
    assert PipelineSplit(2, last=27).layer_counts(28) == [1, 27]
    parts = PipelineSplit(4, first=4, last=2).stages(28)
    assert [(s.layers.start, s.layers.stop, s.first, s.last) for s in parts] == [
        (0, 4, True, False),
        (4, 15, False, False),
        (15, 26, False, False),
        (26, 28, False, True),
    ]
    refusals = {
        PipelineSplit(3, first=3): "--pipeline-model-parallel-size 3 --decoder-first-pipeline-num-layers 3: 28 "
        "layers leave 25 for the other 2 stages, which do not split evenly",
        PipelineSplit(2, first=2, last=2): "--decoder-last-pipeline-num-layers 2: 28 layers leave 24 for no stage",
        PipelineSplit(2, first=0): "every pipeline stage holds at least one layer",
        PipelineSplit(1, last=4): "an uneven split needs two or more pipeline stages",
        PipelineSplit(3, first=14, last=14): "28 layers leave 0 for the other 1 stage, at least one each",
    }
    for split, message in refusals.items():
        with pytest.raises(ValueError, match=message):
            split.layer_counts(28)
    spec = sized_spec("qwen3-0.6b", "qwen3")
    train = TrainConfig(pipeline_model_parallel_size=3, decoder_first_pipeline_num_layers=2)
    plans = plan_stages(spec, train, 8192)
    layer = rank_parameters(spec, 1, MoeOptions(), stage=Stage(range(1), first=False, last=False)).trained
    bytes_per = 2 if train.bf16 else 4
    # the middle stage's 13 layers against the first's 2 and the embedding
    assert plans[1].params - plans[0].params == (11 * layer - spec.vocab_size * spec.hidden_size) * bytes_per


def test_when_the_weights_do_not_fit_the_plan_names_pipeline_stages():
    """Qwen3-0.6B's short rows at TP=1: recompute and CP leave the weights and Adam's state whole; two
    stages halve them."""
    spec, tokens = sized_spec("qwen3-0.6b", "qwen3"), 512
    two = plan_rank(spec, TrainConfig(pipeline_model_parallel_size=2), tokens).total
    assert two < 0.75 * plan_rank(spec, TrainConfig(), tokens).total
    assert fitting_layout(spec, TrainConfig(), tokens, two) == "--pipeline-model-parallel-size 2"
    assert fitting_layout(spec, TrainConfig(context_parallel_size=2), tokens, two) is None  # PP with CP: not yet


@pytest.mark.parametrize("tokens, measured_gib", [(4096, 18.53), (8192, 26.33), (16384, 41.93)])
def test_the_plan_of_qwen3_0_6b_in_bf16_is_within_15_percent_of_its_peak_on_an_h200(tokens, measured_gib):
    """The peaks ``benchmarks/micro_batch_memory.py --model qwen3-0.6b --bf16`` measured on an H200
    (docs/performance.md: one micro-batch of T tokens, Adam's state made by a warm-up step)."""
    plan = plan_rank(sized_spec("qwen3-0.6b", "qwen3"), TrainConfig(bf16=True), tokens)
    assert 0.85 < plan.total / GIB / measured_gib < 1.15


def test_full_recompute_keeps_each_chunks_input_and_bf16_halves_weights_and_activations():
    spec, tokens = sized_spec("qwen2.5-1.5b", "qwen2"), 8192
    h, layers = spec.hidden_size, spec.num_layers
    none = plan_rank(spec, TrainConfig(), tokens)
    full = TrainConfig(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    uniform = plan_rank(spec, full, tokens)
    assert uniform.activations == (layers * h + 2 * h + 57) * tokens * 4  # each layer's input, the final norm's
    two = plan_rank(spec, dataclasses.replace(full, recompute_num_layers=2), tokens)
    assert two.activations == (layers // 2 * h + 2 * h + 57) * tokens * 4 and two.working > uniform.working
    block = plan_rank(spec, dataclasses.replace(full, recompute_method="block", recompute_num_layers=layers), tokens)
    assert block.activations == uniform.activations
    assert uniform.total < none.total / 2
    half = plan_rank(spec, TrainConfig(bf16=True), tokens)
    n = rank_parameters(spec, 1, MoeOptions()).trained
    assert (half.params, half.grads, half.optimizer) == (2 * n, 4 * n, 12 * n)  # fp32 main params and moments
    assert half.activations == none.activations // 2


def test_moe_experts_split_over_ep_and_their_tokens_count_top_k_times(tiny_paths):
    spec = decoder_spec(read_hf_config(tiny_paths["qwen3-moe"]))
    one, two = (rank_parameters(spec, 1, MoeOptions(expert_parallel=ep)).trained for ep in (1, 2))
    m, sparse = spec.moe, sum(spec.moe.sparse_layers)
    assert one - two == sparse * m.num_experts // 2 * 3 * spec.hidden_size * m.ffn_hidden_size
    dense = dataclasses.replace(spec, moe=None)
    assert plan_rank(spec, TrainConfig(), 4096).activations != plan_rank(dense, TrainConfig(), 4096).activations


def test_the_log_prob_working_set_counts_the_scored_tokens():
    """Only response tokens are projected to logits: with few of them (long prompts) the log-probs'
    working set is their chunk, not a full one; without a count the plan assumes every token scored."""
    bench = load_module(str(REPO / "benchmarks/memory_plan.py"))  # a small Llama with a 32k vocabulary
    spec, train = decoder_spec({"model_type": "llama", **bench.LLAMA}), bench.train_config(2, "full", 8192)
    every, same, few = (plan_rank(spec, train, 8192, scored=n) for n in (None, 8192, 128))
    assert every == same
    rows = 64  # each CP rank scores its own positions
    # 160 MiB of logit chunks for every token; for 64 rows 20 MiB, below a recomputed layer's backward
    assert every.working == int(2.5 * LOGIT_CHUNK_BYTES) > few.working > int(2.5 * 4 * 32768 * rows)
    assert every.activations - few.activations == (spec.hidden_size + 57) * (4096 - rows) * 4


def test_the_plans_data_parallel_size_comes_from_the_flags_not_a_hand_set_world(tiny_paths, monkeypatch):
    """slime's --actor-num-nodes x --actor-num-gpus-per-node give the trainer ranks in any launch (the
    dry run by hand plans the torchrun run); torchrun's WORLD_SIZE without them; they must agree."""
    base = ["--hf-checkpoint", str(tiny_paths["qwen3"]), "--use-distributed-optimizer"]
    spec = decoder_spec(read_hf_config(tiny_paths["qwen3"]))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    flags = memory_plan(parse_config([*base, "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "4"]), spec)
    assert "DP=8, distributed optimizer;" in flags[0]
    assert flags[4].startswith("  8 train ranks from --actor-num-nodes 2 x --actor-num-gpus-per-node 4; ")
    assert "DP=1, distributed optimizer;" in memory_plan(parse_config(base), spec)[0]
    monkeypatch.setenv("WORLD_SIZE", "2")
    torchrun = memory_plan(parse_config(base), spec)
    assert "DP=2" in torchrun[0] and torchrun[4].startswith("  2 train ranks from torchrun's WORLD_SIZE;")
    with pytest.raises(ConfigError, match=r"= 8 trainer ranks, but torchrun started 2 \(WORLD_SIZE\)"):
        memory_plan(parse_config([*base, "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "4"]), spec)


def test_gpu_memory_gb_refuses_a_plan_that_cannot_fit_and_names_what_fits(tiny_paths):
    model = ["--hf-checkpoint", str(tiny_paths["qwen3"]), "--max-tokens-per-micro-batch", "1048576"]
    spec = decoder_spec(read_hf_config(tiny_paths["qwen3"]))
    need = plan_rank(spec, parse_config(model).train, 1048576).total
    lines = memory_plan(parse_config(model), spec)
    assert lines[0] == (
        "memory plan of each train rank (TP=1 CP=1 EP=1 DP=1; 1048576 tokens per micro-batch from "
        "--max-tokens-per-micro-batch):"
    )
    assert lines[3] == f"  peak {need / GIB:.2f} GiB"
    just_short = (need + DEVICE_RESERVE_BYTES) / GIB - 0.01
    with pytest.raises(ConfigError) as refused:
        memory_plan(parse_config([*model, "--gpu-memory-gb", f"{just_short}"]), spec)
    assert str(refused.value) == (
        f"--gpu-memory-gb {just_short:g}: the memory plan needs {need / GIB:.2f} GiB per train rank (TP=1 CP=1 "
        "EP=1 DP=1, 1048576 tokens per micro-batch) and 2 GiB stays for the CUDA context and the allocator; "
        "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 fits"
    )
    recomputed = [*model, *"--recompute-granularity full --recompute-method uniform --recompute-num-layers 1".split()]
    short = (plan_rank(spec, parse_config(recomputed).train, 1048576).total + DEVICE_RESERVE_BYTES) / GIB - 0.01
    with pytest.raises(ConfigError, match=r"allocator; --context-parallel-size 2 fits$"):
        memory_plan(parse_config([*recomputed, "--gpu-memory-gb", f"{short}"]), spec)
    with pytest.raises(ConfigError, match=r"lower --max-tokens-per-micro-batch or add tensor or pipeline parallelism$"):
        memory_plan(parse_config([*model, "--gpu-memory-gb", "2.1"]), spec)
    fits = memory_plan(parse_config([*model, "--gpu-memory-gb", f"{just_short + 0.02}"]), spec)
    assert fits[-1].startswith(f"  fits --gpu-memory-gb {just_short + 0.02:g} (0.01 GiB to spare")
    default = memory_plan(parse_config(["--hf-checkpoint", str(tiny_paths["qwen3"])]), spec)[0]
    assert "(TP=1 CP=1 EP=1 DP=1; 4096 tokens per micro-batch from --micro-batch-size x --rollout-max-context-len)" in (
        default
    )
    # the distributed optimizer shards Adam's state over the DP ranks (Ray's placement gives their number)
    sharded = [*model, "--ray", "--actor-num-gpus-per-node", "4", "--use-distributed-optimizer"]
    lines = memory_plan(parse_config(sharded), spec)
    assert lines[0].startswith("memory plan of each train rank (TP=1 CP=1 EP=1 DP=4, distributed optimizer; ")
    plain, quarter = (plan_rank(spec, parse_config(sharded).train, 4096, data_parallel=dp) for dp in (1, 4))
    n = rank_parameters(spec, 1, MoeOptions()).trained
    assert (plain.optimizer, quarter.optimizer, quarter.grads) == (8 * n, 8 * math.ceil(n / 4), 4 * n)
    with pytest.raises(ConfigError, match=r"--gpu-memory-gb=0"):
        parse_config(["--gpu-memory-gb", "0"])


@pytest.mark.parametrize("sp, measured_gib", [(False, 1.41), (True, 1.22)])
def test_sequence_parallelism_splits_the_norms_activations_over_tp_as_measured(sp, measured_gib):
    """The peaks ``benchmarks/memory_plan.py --tokens 8192 --cp 1 --recompute off --tp 2 --sp off,on``
    measured on this machine (2 ranks; docs/performance.md): SP keeps 13% less, and the plan says so.
    The benchmark's model (a Llama of 8 layers, hidden 256, a tied 32k vocabulary, fp32) and flags."""
    bench = load_module(str(REPO / "benchmarks/memory_plan.py"))
    spec = decoder_spec({"model_type": "llama", **bench.LLAMA})
    train = bench.train_config(1, "off", 8192, tp=2, sp=sp)
    plan = plan_rank(spec, train, 8192)
    assert 0.97 < plan.total / GIB / measured_gib < 1.03, plan.total / GIB
    one = plan_rank(spec, dataclasses.replace(train, tensor_model_parallel_size=1), 8192)
    assert one.activations > plan.activations and one.params > plan.params


def test_under_tp_the_plan_names_sequence_parallelism_first_when_it_fits(tiny_paths):
    model = ["--hf-checkpoint", str(tiny_paths["qwen3"]), "--max-tokens-per-micro-batch", "1048576"]
    model += ["--tensor-model-parallel-size", "2"]
    spec = decoder_spec(read_hf_config(tiny_paths["qwen3"]))
    with_sp = plan_rank(spec, parse_config([*model, "--sequence-parallel"]).train, 1048576).total
    assert with_sp < plan_rank(spec, parse_config(model).train, 1048576).total
    enough = (with_sp + DEVICE_RESERVE_BYTES) / GIB + 0.01
    with pytest.raises(ConfigError, match=r"\(TP=2 CP=1 EP=1 DP=1, 1048576 .* allocator; --sequence-parallel fits$"):
        memory_plan(parse_config([*model, "--gpu-memory-gb", f"{enough}"]), spec)
    lines = memory_plan(parse_config([*model, "--sequence-parallel", "--gpu-memory-gb", f"{enough}"]), spec)
    assert lines[0].startswith("memory plan of each train rank (TP=2 (sequence parallel) CP=1 EP=1 DP=1; ")
    assert lines[-1].startswith(f"  fits --gpu-memory-gb {enough:g}")


# the text configs of Qwen3-VL-30B-A3B-Instruct and Qwen3-VL-32B-Instruct (their published config.json)
A3B = {
    "model_type": "qwen3_moe",
    **dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48),
    **dict(num_attention_heads=32, num_key_value_heads=4, head_dim=128, tie_word_embeddings=False),
    **dict(
        moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[]
    ),
}
DENSE_32B = {
    "model_type": "qwen3",
    **dict(vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64),
    **dict(num_attention_heads=64, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
}
RECOMPUTED = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


@pytest.mark.parametrize(
    "config, layout, ranks, sharded, gib",
    [
        (A3B, dict(expert_model_parallel_size=8, expert_tensor_parallel_size=1), 8, False, 94.1),
        (A3B, dict(expert_model_parallel_size=8, expert_tensor_parallel_size=1), 8, True, 79.0),
        (A3B, dict(expert_model_parallel_size=16, expert_tensor_parallel_size=1), 16, True, 47.5),
        (DENSE_32B, dict(tensor_model_parallel_size=8), 16, True, 58.3),
        (DENSE_32B, dict(tensor_model_parallel_size=8, sequence_parallel=True), 16, False, 71.4),
        (DENSE_32B, dict(tensor_model_parallel_size=8, sequence_parallel=True), 16, True, 48.5),
    ],
)
def test_the_gpu_recipes_big_shapes_plan_as_their_comments_say(config, layout, ranks, sharded, gib):
    """The figures examples/geo3k_vlm_multi_turn/run_geo3k_vlm_multi_turn.sh and the README give: bf16,
    full recompute, 16,384 tokens per micro-batch; the distributed optimizer shards the dense state over
    every DP rank and each expert's over the ranks that hold it."""
    train = TrainConfig(bf16=True, use_distributed_optimizer=sharded, **RECOMPUTED, **layout)
    dp = ranks // train.tensor_model_parallel_size
    assert round(plan_rank(decoder_spec(config), train, 16384, data_parallel=dp).total / GIB, 1) == gib
