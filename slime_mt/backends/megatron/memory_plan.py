"""The memory one train rank needs, planned before the run (``--dry-run``; ``--gpu-memory-gb`` refuses a
plan that cannot fit): parameters, gradients, optimizer state and activations, from the model's
config, the layout (TP, CP, EP) and the tokens of one micro-batch.

Static memory is exact: Megatron's DDP keeps fp32 gradient buffers (``grad_reduce_in_fp32``), Adam
keeps two fp32 moments and, under ``--bf16``, fp32 main parameters (sharded over DP x CP, experts over
their own DP group, with ``--use-distributed-optimizer``); a frozen vision tower has neither (its
weights only), the KL reference model its weights only. Parameters per rank follow the sharding:
vocabulary rows (padded) and the attention and MLP projections split over TP, experts over EP (and
their own TP), norms and routers replicated; the vision tower replicated.

Activations are what this project's layers keep for the backward pass, counted per token and layer
with ``torch.autograd.graph.saved_tensors_hooks`` on the fused attention's path (Llama, Qwen2, Qwen3,
Qwen3-MoE), for a layer of hidden size h, q/kv heads nq/nkv of size d and MLP width f (TP splits the
heads and f; CP splits the tokens, and each CP rank keeps its row's gathered keys and values whole):

    attention  6h + 4d + (4 nq d + 2 nkv d + nq) / tp + 2    (+ 3 (nq + nkv) d + nq + nkv with q/k norms)
               sequence parallelism: (6h + 2) / tp, and each recomputed chunk's input h / tp
    dense MLP  5f / tp                                       MoE: k (2h + 5 f_expert / etp) + 4 E
    recompute  full: h per recomputed chunk's input, and one chunk's whole activations while its
               backward runs; selective core_attn: 2d + nq / tp fewer; mlp/moe: the MLP's terms
    outside    h per token (the final norm's output), h + 57 per scored token (its hidden state picked
               out, its log-prob's bookkeeping)

The scored tokens are the response tokens, whose log-probs are computed (every token at most: the plan
of ``--dry-run``; fewer when prompts are long). The peak adds the larger of two working sets on top of
what is kept: the log-probs' backward (2.5 chunks of fp32 logits, a chunk at most the scored rows')
and a layer's backward (its activations, recomputed under full recompute, and
the gradients of them, about 0.3 of a layer's).

Pipeline stages (``--pipeline-model-parallel-size P``): each stage holds its layers (Megatron's even
split), the first the embedding, the last the final norm and the output layer (with tied embeddings,
its own copy of the embedding); under the 1F1B schedule stage s keeps the activations of up to P - s
micro-batches in flight (P when the step has at least P micro-batches, as planned), and only the last
stage projects logits. The plan is the busiest stage's. Measured on CPU, glibc's malloc told to map each
tensor on its own (``MALLOC_MMAP_THRESHOLD_``), what is not a tensor adds about 64 MiB. Beyond the
plan a device needs its CUDA context and the allocator's slack (``--gpu-memory-gb`` keeps 2 GiB for
them). The vision tower's activations (frozen: none kept) and the engines' memory (colocated engines
release theirs while the trainer trains) are not in the plan. Checked against measured peaks:
``benchmarks/memory_plan.py``."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from slime_mt.backends.megatron.families import DecoderSpec, MoeOptions, padded_vocab
from slime_mt.backends.megatron.logprobs import LOGIT_CHUNK_BYTES
from slime_mt.backends.megatron.lora import LoraOptions, rank_elements
from slime_mt.backends.megatron.parallel import PipelineSplit, Stage
from slime_mt.backends.megatron.vlm import checkpoint_vision_prefix

GIB = 2**30
# fp32 logit chunks alive at once while the log-probs' backward runs (logits, softmax, their gradient)
LOGIT_PHASE_CHUNKS = 2.5
# a layer's backward working set (the gradients of its activations), in layers' activations
LAYER_BACKWARD = 0.3
# what is not a tensor: module and optimizer objects, the allocator's bookkeeping (measured on CPU)
RUNTIME_BYTES = 64 * 2**20


@dataclass(frozen=True)
class RankMemory:
    """Bytes one train rank holds at its peak, by part."""

    params: int
    grads: int
    optimizer: int
    reference: int
    activations: int  # kept for the backward pass at the end of the forward
    working: int  # the backward's working set or the logit chunks (the larger), on top of the activations
    runtime: int  # what is not a tensor
    tokens: int  # of one micro-batch on this rank

    @property
    def total(self) -> int:
        parts = (self.params, self.grads, self.optimizer, self.reference, self.activations, self.working, self.runtime)
        return sum(parts)

    def lines(self) -> list[str]:
        gib = lambda n: f"{n / GIB:.2f} GiB"  # noqa: E731
        return [
            f"parameters {gib(self.params)}, gradients {gib(self.grads)}, optimizer {gib(self.optimizer)}"
            + (f", KL reference {gib(self.reference)}" if self.reference else ""),
            f"activations {gib(self.activations)} for {self.tokens} tokens per micro-batch on this rank, "
            f"backward working set {gib(self.working)}",
            f"peak {gib(self.total)}",
        ]


@dataclass(frozen=True)
class ParameterCount:
    """Elements on one rank: ``trained`` get gradients and optimizer state, ``frozen`` only weights."""

    trained: int
    frozen: int
    experts: int = 0  # of ``trained``: expert weights (their optimizer shards over the expert-DP group)


def _sparse_layers(spec: DecoderSpec) -> list[bool]:
    """Per decoder layer: an MoE layer."""
    return spec.moe.sparse_layers if spec.moe else [False] * spec.num_layers


def rank_parameters(
    spec: DecoderSpec, tp: int, moe: MoeOptions, vision: int = 0, vision_frozen=True, stage: Stage | None = None
):
    """-> ParameterCount of one rank of the decoder (and the replicated vision tower, ``vision`` elements);
    ``stage``: its pipeline stage's part (the vision tower with the first)."""
    stage = stage or Stage.whole(spec.num_layers)
    h, d, nq, nkv = spec.hidden_size, spec.head_dim, spec.num_heads, spec.num_kv_heads
    embedding = padded_vocab(spec.vocab_size, tp) // tp * h
    # the embedding on the first stage; the final norm and the output layer (or the tied embedding's
    # copy, on a later stage) on the last
    n = embedding * stage.first + (h + embedding * (not (spec.tie_embeddings and stage.first))) * stage.last
    vision = vision if stage.first else 0
    qkv = (nq + 2 * nkv) * d
    attention = 2 * h + (qkv * h + nq * d * h + (qkv if spec.qkv_bias else 0)) // tp + (2 * d if spec.qk_norm else 0)
    experts = 0
    for sparse in [_sparse_layers(spec)[i] for i in stage.layers]:
        if sparse:
            m = spec.moe
            n += attention + m.num_experts * h
            experts += m.num_experts // moe.expert_parallel * 3 * h * m.ffn_hidden_size // moe.expert_tp(tp)
        else:
            n += attention + 3 * h * spec.ffn_hidden_size // tp
    trained = n + experts + (0 if vision_frozen else vision)
    return ParameterCount(trained=trained, frozen=vision if vision_frozen else 0, experts=experts)


def lora_parameters(spec: DecoderSpec, train, tp: int, stage: Stage | None = None) -> int:
    """Elements of one rank's LoRA adapters on its pipeline stage's layers (``--lora-rank``; 0 without)."""
    options = LoraOptions.of(train)
    if options is None:
        return 0
    return rank_elements(spec, options, tp, (stage or Stage.whole(spec.num_layers)).layers)


def layer_activations(
    spec: DecoderSpec,
    tp: int,
    moe: MoeOptions,
    sparse: bool,
    modules: frozenset = frozenset(),
    sequence_parallel: bool = False,
):
    """Elements one layer keeps per token of this rank (``modules``: what selective recompute recomputes;
    ``sequence_parallel``: the norms' and the projections' inputs are this TP rank's slice of the row)
    -> (per local token, per token of the whole row: the gathered keys and values under CP)."""
    h, d, nq, nkv = spec.hidden_size, spec.head_dim, spec.num_heads, spec.num_kv_heads
    local = (6 * h + 2) / (tp if sequence_parallel else 1) + 4 * d + (4 * nq * d + nq) / tp
    if spec.qk_norm:
        local += (3 * (nq + nkv) * d + nq + nkv) / tp
    if "core_attn" in modules:
        local -= 2 * d + nq / tp
    if sparse:
        m = spec.moe
        mlp = m.topk * (2 * h + 5 * m.ffn_hidden_size / moe.expert_tp(tp)) + 4 * m.num_experts
    else:
        mlp = 5 * spec.ffn_hidden_size / tp
    if not ({"moe"} if sparse else {"mlp"}) & modules:
        local += mlp
    return local, 2 * nkv * d / tp


def plan_rank(
    spec: DecoderSpec,
    train,
    tokens: int,
    vision: int = 0,
    use_reference: bool = False,
    data_parallel: int = 1,
    scored: int | None = None,
) -> RankMemory:
    """The peak of one train rank of ``train`` (a ``TrainConfig``) on micro-batches of ``tokens``, among
    ``data_parallel`` DP ranks (they share the optimizer's state under ``--use-distributed-optimizer``);
    under pipeline parallelism, the busiest stage's. ``scored``: the micro-batch's tokens whose log-prob
    is computed (its response tokens); None: every token, the most there can be."""
    stages = plan_stages(spec, train, tokens, vision, use_reference, data_parallel, scored)
    return max(stages, key=lambda plan: plan.total)


def plan_stages(
    spec: DecoderSpec,
    train,
    tokens: int,
    vision: int = 0,
    use_reference: bool = False,
    data_parallel: int = 1,
    scored: int | None = None,
) -> list[RankMemory]:
    """``plan_rank`` of a rank of each pipeline stage, in stage order (one without PP)."""
    split = PipelineSplit.of(train)
    scored = tokens if scored is None else min(scored, tokens)
    return [
        _plan_stage(spec, train, tokens, vision, use_reference, data_parallel, stage, split.size - s, scored)
        for s, stage in enumerate(split.stages(spec.num_layers))
    ]


def _plan_stage(
    spec: DecoderSpec,
    train,
    tokens: int,
    vision: int,
    use_reference: bool,
    data_parallel: int,
    stage,
    in_flight: int,
    scored: int,
) -> RankMemory:
    tp, cp = train.tensor_model_parallel_size, train.context_parallel_size
    sp = train.sequence_parallel and tp > 1
    moe = MoeOptions.of(train)
    b = 2 if train.bf16 else 4
    count = rank_parameters(spec, tp, moe, vision, train.freeze_vision_tower, stage)
    adapters = lora_parameters(spec, train, tp, stage)
    if adapters:  # --lora-rank: the adapters alone are trained; the base is frozen and has no gradient
        base = count.trained + count.frozen
        count = dataclasses.replace(count, trained=adapters, frozen=base, experts=0)
    weights = count.trained + count.frozen
    optimized = count.trained  # elements of main weights and moments on this rank
    if train.use_distributed_optimizer:  # sharded over DP x CP; experts over their own DP group
        expert_dp = max(1, tp * cp * data_parallel // (moe.expert_parallel * moe.expert_tp(tp)))
        dense = math.ceil((count.trained - count.experts) / (data_parallel * cp))
        optimized = dense + math.ceil(count.experts / expert_dp)
    local = math.ceil(tokens / (2 * cp)) * 2 if cp > 1 else tokens  # the zigzag pads to 2 cp chunks
    row = local * cp
    modules = (
        frozenset(train.recompute_modules or ["core_attn"])
        if train.recompute_granularity == "selective"
        else frozenset()
    )
    sparse_layers = [_sparse_layers(spec)[i] for i in stage.layers]
    per_layer = [layer_activations(spec, tp, moe, s, modules, sp) for s in sparse_layers]
    whole = [a * local + kv * row for a, kv in per_layer]  # elements a layer keeps without full recompute
    h = spec.hidden_size / tp if sp else spec.hidden_size  # a layer's input: this TP rank's slice under SP
    if train.recompute_granularity == "full":
        n = train.recompute_num_layers or 1
        layers = len(stage.layers)
        if train.recompute_method == "block":  # the first n layers keep their input only
            kept = h * local * min(n, layers) + sum(whole[n:])
            recomputed = max(whole[:n], default=0)
        else:  # uniform: every chunk of n layers keeps its input only
            kept = h * local * math.ceil(layers / n)
            recomputed = max(sum(whole[i : i + n]) for i in range(0, layers, n))
    else:
        kept, recomputed = sum(whole), 0
    rows = math.ceil(scored / cp)  # this rank's scored tokens: each CP rank scores its own positions
    # the final norm's output for every local token (the gathered rows under SP); the scored rows' hidden
    # states, log-probs and their bookkeeping
    outside = (spec.hidden_size * local + (spec.hidden_size + 57) * rows) * stage.last
    kept *= in_flight  # 1F1B: the micro-batches whose backward has not run yet
    vocab = padded_vocab(spec.vocab_size, tp) // tp
    logits = LOGIT_PHASE_CHUNKS * min(LOGIT_CHUNK_BYTES, 4 * vocab * rows) * stage.last
    layer = (recomputed + LAYER_BACKWARD * max(whole)) * b
    return RankMemory(
        params=weights * b,
        grads=count.trained * 4,
        optimizer=optimized * (12 if train.bf16 else 8),
        reference=weights * b if use_reference else 0,
        activations=int((kept + outside) * b),
        working=int(max(logits, layer)),
        runtime=RUNTIME_BYTES,
        tokens=local,
    )


def vision_parameters(reader) -> int:
    """Elements of the vision tower in a checkpoint (a ``CheckpointReader``); 0 for a text model."""
    names = reader.names()
    prefix = checkpoint_vision_prefix(names)
    return sum(math.prod(reader.shape(name)) for name in names if name.startswith(prefix))


def _full_recompute(on: bool) -> dict:
    """The recompute settings of ``FULL_RECOMPUTE`` (on) or none."""
    return dict(
        recompute_granularity="full" if on else None,
        recompute_method="uniform" if on else None,
        recompute_num_layers=1 if on else None,
    )


def fitting_layout(spec: DecoderSpec, train, tokens: int, budget: int, **kw) -> str | None:
    """The first of: sequence parallelism (under TP, when off), full recompute, CP doubled (up to 8
    times the given) without and with it, then (without CP) 2, 4 or 8 pipeline stages that split the
    layers evenly, without and with full recompute, whose plan fits ``budget`` bytes -> the flags that
    change, or None."""
    cp, first = train.context_parallel_size, []
    if train.tensor_model_parallel_size > 1 and not train.sequence_parallel:
        train, first = dataclasses.replace(train, sequence_parallel=True), ["--sequence-parallel"]
        if plan_rank(spec, train, tokens, **kw).total <= budget:
            return first[0]
    tries = [(dict(context_parallel_size=cp), True)]
    tries += [(dict(context_parallel_size=cp * k), full) for k in (2, 4, 8) for full in (False, True)]
    if cp == 1 and train.pipeline_model_parallel_size == 1:
        stages = [p for p in (2, 4, 8) if spec.num_layers % p == 0]
        tries += [(dict(pipeline_model_parallel_size=p), full) for p in stages for full in (False, True)]
    for layout, full in tries:
        if plan_rank(spec, dataclasses.replace(train, **layout, **_full_recompute(full)), tokens, **kw).total <= budget:
            named = list(first)
            if layout.get("context_parallel_size", cp) != cp:
                named.append(f"--context-parallel-size {layout['context_parallel_size']}")
            if "pipeline_model_parallel_size" in layout:
                named.append(f"--pipeline-model-parallel-size {layout['pipeline_model_parallel_size']}")
            return " ".join(named + ([FULL_RECOMPUTE] if full else []))
    return None


FULL_RECOMPUTE = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
