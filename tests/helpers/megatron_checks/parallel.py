"""Parallel layouts against one rank: the TP/EP/CP/SP matrix (log-probs, loss, gradients, grad norm, the
weights after two steps), DP with the global reduction weights, the distributed optimizer, ranks with
different row counts under EP, the MoE dispatchers, and pipeline stages (the schedule against the whole
decoder, the actor's matrix at PP=2, what PP refuses)."""

import dataclasses
import json
from pathlib import Path

import torch
import torch.distributed as dist
from megatron_worlds import MOE_FAMILIES

from megatron_checks.common import (
    ADVANTAGES,
    ALGO,
    LAUNCH,
    TEMPERATURE,
    compare,
    dp_batch,
    is_main,
    layout_tag,
    matrix_batch,
    random_routes,
    step_outputs,
)
from megatron_checks.model import planned_parameters
from slime_mt.assets import tiny_model_dir
from slime_mt.backends.megatron import export, scoring
from slime_mt.backends.megatron.actor import MegatronActor
from slime_mt.backends.megatron.checkpoint import _inner_optimizers
from slime_mt.backends.megatron.memory_plan import rank_parameters
from slime_mt.config import AlgoConfig, TrainConfig
from slime_mt.safetensors_files import CheckpointReader


def replicated_spread(actor) -> float:
    """Largest difference between the TP ranks' copies of parameters that are replicated (norms)."""
    if actor.info.tp_size == 1:
        return 0.0
    spread = 0.0
    group = actor.policy.tp_group()
    for p in actor.policy.module.parameters():
        if getattr(p, "tensor_model_parallel", False):
            continue
        copies = [torch.empty_like(p) for _ in range(actor.info.tp_size)]
        dist.all_gather(copies, p.detach().contiguous(), group=group)
        spread = max(spread, max(float((c - copies[0]).abs().max()) for c in copies))
    return spread


def check_matrix(args, info, out):
    """Per family: log-probs, entropies, loss, gradients (HF layout), grad norm, replicated copies
    after a step and the weights after a step, for TP=1 vs TP=2 vs transformers (the MoE families
    only in an expert-parallel world); MoE families once more replaying random routes (R3,
    ``matrix_TAG_KIND_r3.pt``), which every layout must replay alike."""
    for kind, suffix, batch, actor in matrix_actors(MOE_FAMILIES if info.ep_size > 1 else LAUNCH.families, info):
        if not suffix:  # the memory plan's parameters of this rank against the built model's
            out.setdefault("parameters", {})[kind] = planned_parameters(actor, tiny_model_dir(kind))
        result = _matrix_run(actor, batch)
        if is_main(info):
            torch.save(result, Path(args.out) / f"matrix_{layout_tag(info)}_{kind}{suffix}.pt")
    out["matrix"] = "saved"


def matrix_actors(kinds, info):
    """Per family of ``kinds``: (kind, suffix, batch, a new actor) of the matrix run, and for the MoE
    families once more replaying random routes (suffix ``_r3``)."""
    for kind in kinds:
        path = tiny_model_dir(kind)
        samples = matrix_batch(path, kind)
        runs = {"": (samples, False)}
        if kind in MOE_FAMILIES:
            runs["_r3"] = (random_routes(path, samples), True)
        for suffix, (batch, replay) in runs.items():
            # lr 1e-5 (RL scale): Adam turns near-zero gradients into lr-sized steps, so fp32 reduction-order
            # noise in them shows up in the weights in proportion to lr
            train = TrainConfig(
                lr=1e-5,
                clip_grad=1.0,
                micro_batch_size=2,
                use_rollout_routing_replay=replay,
                sequence_parallel=LAUNCH.sequence_parallel,
            )
            yield kind, suffix, batch, MegatronActor(str(path), train, ALGO, info, temperature=TEMPERATURE)


def _second_step(actor, samples) -> dict:
    """The batch once more on the updated weights (Adam's state from the first step): loss, grad norm
    and the weights after two steps."""
    sums = actor.accumulate_gradients(actor.share_of(samples, ADVANTAGES, len(samples)))
    step = actor.apply_gradients()
    return {"loss_2": sums["loss"], "grad_norm_2": step["train/grad_norm"], "weights_2": actor.export_hf()}


def _matrix_run(actor, samples) -> dict:
    """One sample at a time: log-probs and entropies; then one step of the whole batch."""
    logprobs, entropies, pads = [], [], []
    with torch.no_grad():
        for i in range(len(samples)):
            row = scoring.pack(actor.policy, samples, [i])
            lp, ent = scoring.row_outputs(actor.policy, row, scoring.LogProbs(TEMPERATURE, entropy=True))
            logprobs.append(lp.tolist())
            entropies.append(ent.tolist())
            pads.append(row.pad)
    sums = actor.accumulate_gradients(actor.share_of(samples, ADVANTAGES, len(samples)))
    decoder = {n[len("gpt.") :]: p for n, p in actor.policy.module.named_parameters() if n.startswith("gpt.")}
    grads = dict(export.iter_hf_weights(actor.policy, tensors={n: p.main_grad for n, p in decoder.items()}))
    step = actor.apply_gradients()
    return {
        "logprobs": logprobs,
        "entropy": entropies,
        "loss": sums["loss"],
        "grads": grads,
        "grad_norm": step["train/grad_norm"],
        "replicated_spread": replicated_spread(actor),
        "weights": actor.export_hf(),
        **_second_step(actor, samples),
        "replayed_routes": sums.get("routing_replay_routes", 0.0),
        "sequence_parallel": bool(actor.policy.module.config.sequence_parallel),
        "row_pads": pads,  # tokens sequence parallelism padded each one-sample row with
    }


DP_VARIANTS = {
    "token_mean": AlgoConfig(eps_clip=0.2, use_tis=True, tis_clip=2.0, loss_reduction="token_mean"),
    "seq_mean_token_mean": AlgoConfig(eps_clip=0.2, use_tis=True, tis_clip=2.0, loss_reduction="seq_mean_token_mean"),
    # the decoupled objective with M2PO: its cutoff is one for the whole step, over every DP rank's tokens
    "decoupled": AlgoConfig(eps_clip=0.2, use_decoupled_loss=True, m2po_threshold=0.1),
}


def check_dp(args, info, out):
    """One optimizer step on the whole batch, then ``train`` with two mini-batches off-policy; the
    grad norm, loss and weights must not depend on the DP (or TP) layout."""
    for reduction, algo in DP_VARIANTS.items():
        actor = MegatronActor(
            str(tiny_model_dir("qwen3")),
            TrainConfig(lr=1e-5, clip_grad=100.0, max_tokens_per_micro_batch=64),
            algo,
            info,
        )
        samples = dp_batch()
        if algo.use_decoupled_loss:  # behaviour log-probs of several versions: (log w)^2 from 0 to ~0.9
            for s in samples:
                s.rollout_log_probs = [-11.0 - 0.15 * (j % 7) for j in range(len(s.response_ids))]
        advantages = [0.5 * (-1) ** i * (1 + i % 3) for i in range(len(samples))]
        sums = actor.accumulate_gradients(actor.share_of(samples, advantages, len(samples)))
        step = actor.apply_gradients()
        trained = actor.train(actor.share_of(samples, advantages, 2), on_policy=False)
        weights = actor.export_hf()
        if is_main(info):
            torch.save(
                {
                    "loss": sums["loss"],
                    "tokens": sums["tokens"],
                    "grad_norm": step["train/grad_norm"],
                    "train": trained,
                    "weights": weights,
                },
                Path(args.out) / f"dp_{reduction}_tp{info.tp_size}_dp{info.dp_size}.pt",
            )
    out[f"dp_tp{info.tp_size}_dp{info.dp_size}"] = "saved"
    if info.dp_size > 1:
        distributed_optimizer(args, info, out)


def distributed_optimizer(args, info, out):
    """--use-distributed-optimizer against the replicated Adam at this layout, dense and MoE, fp32 and
    bf16: three steps (one on the whole batch, two off-policy mini-batches); this rank's optimizer
    bytes (main copies and moments) each way."""
    results = {}
    for kind in ("qwen3", "qwen3-moe"):
        for bf16 in (False, True):
            runs = {}
            for sharded in (False, True):
                train = TrainConfig(
                    lr=1e-5, clip_grad=1.0, max_tokens_per_micro_batch=64, bf16=bf16, use_distributed_optimizer=sharded
                )
                actor = MegatronActor(str(tiny_model_dir(kind)), train, AlgoConfig(eps_clip=0.2), info)
                samples = dp_batch()
                advantages = [0.5 * (-1) ** i * (1 + i % 3) for i in range(len(samples))]
                norms = [actor.train(actor.share_of(samples, advantages, len(samples)))["train/grad_norm"]]
                norms.append(actor.train(actor.share_of(samples, advantages, 2), on_policy=False)["train/grad_norm"])
                state = [
                    t
                    for inner in _inner_optimizers(actor.policy.optimizer)
                    for s in inner.optimizer.state.values()
                    for t in s.values()
                ]
                mains = [
                    p
                    for inner in _inner_optimizers(actor.policy.optimizer)
                    for g in inner.optimizer.param_groups
                    for p in g["params"]
                ]
                bytes_ = sum(t.numel() * t.element_size() for t in state if torch.is_tensor(t) and t.dim() > 0)
                if bf16:  # the fp32 main copies the optimizer updates (under fp32: the weights themselves)
                    bytes_ += sum(p.numel() * p.element_size() for p in mains)
                runs[sharded] = {"weights": actor.export_hf(), "norms": norms, "optimizer_bytes": bytes_}
            gathered = [None] * info.world_size
            dist.all_gather_object(gathered, [runs[False]["optimizer_bytes"], runs[True]["optimizer_bytes"]])
            plain, sharded = runs[False], runs[True]
            if is_main(info):
                pairs = [(sharded["weights"][n].float(), w.float()) for n, w in plain["weights"].items()]
                results[f"{kind}_{'bf16' if bf16 else 'fp32'}"] = {
                    "max_abs": max(float((a - b).abs().max()) for a, b in pairs),
                    # a bf16 weight rounds its fp32 main copy: a main copy 1e-9 away may round one step off
                    "within_a_rounding_step": all(bool(((a - b).abs() <= b.abs() * 2**-7).all()) for a, b in pairs),
                    "norms": [plain["norms"], sharded["norms"]],
                    "optimizer_bytes": gathered,
                }
    out[f"distributed_optimizer_tp{info.tp_size}_dp{info.dp_size}"] = results


def check_ep_rows(args, info, out):
    """Qwen3-MoE, one optimizer step on ``dp_batch`` with a 48-token budget per micro-batch: at DP=2
    the ranks pack different numbers of rows (every MoE layer's exchange is collective, so the rank with
    fewer runs idle passes). -> rows per rank, loss, grad norm and the weights after the step (rank 0),
    for the same step at EP=1 on one rank to equal."""
    path = tiny_model_dir("qwen3-moe")
    actor = MegatronActor(str(path), TrainConfig(lr=1e-5, max_tokens_per_micro_batch=48), ALGO, info)
    samples = dp_batch()
    share = actor.share_of(samples, [1.0, -1.0] * 4, 4)
    rows = len(scoring.micro_batches(actor.policy, share.samples, share.of_mini_batch(0)))
    everyone = [None] * info.world_size
    dist.all_gather_object(everyone, rows)
    metrics = actor.train(share, on_policy=False)
    weights = actor.export_hf()
    if is_main(info):
        torch.save(weights, Path(args.out) / f"ep_rows_{layout_tag(info)}.pt")
    loads = {k: v for k, v in metrics.items() if k.startswith("train/moe/load_max_over_mean")}
    out["ep_rows"] = {"rows": everyone, "loss": metrics["train/loss"], "grad_norm": metrics["train/grad_norm"], **loads}


def check_dispatchers(args, info, out):
    """MoE families: the all-gather token dispatcher against the all-to-all one on one packed row
    (log-probs, entropies, loss, this rank's gradient shards; largest differences over the ranks)."""
    result = {}
    for kind in MOE_FAMILIES:
        path = tiny_model_dir(kind)
        samples = matrix_batch(path, kind)
        got = {
            dispatcher: step_outputs(
                path,
                TrainConfig(
                    lr=1e-5,
                    micro_batch_size=len(samples),
                    moe_token_dispatcher_type=dispatcher,
                    moe_aux_loss_coef=0.01,
                    sequence_parallel=LAUNCH.sequence_parallel,
                ),
                samples,
                ADVANTAGES,
                info,
            )
            for dispatcher in ("allgather", "alltoall")
        }
        result[kind] = compare(got["allgather"], got["alltoall"], info)
        result[kind]["router"] = {d: {k: v for k, v in got[d]["sums"].items() if k.startswith("moe/")} for d in got}
    out["dispatchers"] = result


PIPELINE_KINDS = ("llama", "qwen2", "qwen3", "qwen3-moe")  # the text families, dense and MoE

# the actor's matrix under PP: those and a VLM (its vision tower on the first stage); Qwen3-VL's tiny
# models put deepstack features into both their layers, which one stage of two cannot hold (refused)
PP_MATRIX_KINDS = (*PIPELINE_KINDS, "qwen2.5-vl")


def untied_llama() -> Path:
    """The tiny llama's shape with four layers and its own output layer (the tiny families all tie
    theirs): random weights, built once."""
    from slime_mt.assets import random_model_dir

    config = json.loads((tiny_model_dir("llama") / "config.json").read_text())
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")
    shape = {k: config[k] for k in keep} | {"head_dim": config.get("head_dim"), "rms_norm_eps": config["rms_norm_eps"]}
    return random_model_dir("llama-untied-4l", "LlamaConfig", **shape, num_hidden_layers=4, tie_word_embeddings=False)


def check_pipeline(args, info, out):
    """Per text family: the matrix batch as two packed rows of different lengths through this world's
    pipeline (``run_pipeline``, Megatron's 1F1B schedule) against the whole decoder in this process:
    log-probs (forward only, then again with the backward), and every parameter's gradient of the
    loss -sum(advantage x log-prob), this stage's against the same layer of the whole decoder (tied
    embeddings: both copies' gradients summed over the embedding group)."""
    if info.rank == 0:
        untied_llama()  # transformers saves a model on rank 0 only
    dist.barrier()
    kinds = [k for k in (*PIPELINE_KINDS, *UNTIED_KINDS) if k.split("-untied")[0] in LAUNCH.families]
    out["pipeline"] = {kind: _pipeline_family(kind, info) for kind in kinds}


# the untied llama (4 layers) split evenly, and with one layer on the first stage (Megatron's uneven
# split, --decoder-first-pipeline-num-layers 1: the other three on the last)
UNTIED_KINDS = {"llama-untied": {}, "llama-untied-first1": {"first": 1}}


def _pipeline_family(kind: str, info) -> dict:
    from megatron.core import parallel_state

    from slime_mt.backends.megatron.convert import iter_hf_to_megatron, load_into
    from slime_mt.backends.megatron.families import TextPolicy, build_gpt, decoder_spec, read_hf_config, stage_of
    from slime_mt.backends.megatron.logprobs import hidden_logprobs
    from slime_mt.backends.megatron.packing import pack_row
    from slime_mt.backends.megatron.parallel import PipelineSplit
    from slime_mt.backends.megatron.pipeline import run_pipeline

    path = untied_llama() if kind in UNTIED_KINDS else tiny_model_dir(kind)
    spec = decoder_spec(read_hf_config(path), f"{path}/config.json")
    reader = CheckpointReader(path)
    samples = matrix_batch(path, kind)
    rows = [pack_row(samples, [0, 1]), pack_row(samples, [2, 3])]
    advantages = [torch.tensor(ADVANTAGES[0:2]), torch.tensor(ADVANTAGES[2:4])]

    def score(policy, row, hidden, advantage):
        lp, _ = hidden_logprobs(
            hidden[:, 0].index_select(0, row.logit_index), policy.output_weight(), row.targets, spec.vocab_size
        )
        per_sample = torch.zeros(len(row.lengths), dtype=lp.dtype).index_add(0, row.seq_ids, lp)
        return -(advantage * per_sample).sum(), lp.detach()

    whole = TextPolicy(build_gpt(spec, 1))
    load_into(whole.gpt, iter_hf_to_megatron(reader, spec, 0, 1))
    whole_lp = []
    for row, advantage in zip(rows, advantages):
        hidden = whole.hidden(row.tokens, row.position_ids, row.attention_mask, row.packed_seq_params)
        loss, lp = score(whole, row, hidden, advantage)
        loss.backward()
        whole_lp.append(lp)
    whole_grads = {n: p.grad for n, p in whole.gpt.named_parameters()}

    staged = TextPolicy(build_gpt(spec, 1, pp=PipelineSplit(info.pp_size, **UNTIED_KINDS.get(kind, {}))))
    stage = stage_of(staged.gpt)
    load_into(staged.gpt, iter_hf_to_megatron(reader, spec, 0, 1, stage=stage))

    def run(forward_only: bool) -> list:
        kept = iter(advantages)
        return run_pipeline(
            staged,
            rows,
            lambda row: staged.hidden(row.tokens, row.position_ids, row.attention_mask, row.packed_seq_params),
            lambda row, hidden: score(staged, row, hidden, next(kept)),
            forward_only,
        )

    with torch.no_grad():
        forward_lp = run(forward_only=True)
    trained_lp = run(forward_only=False)
    _sum_tied_embedding_grads(staged.gpt)

    def global_name(name: str) -> str:
        if name.startswith("decoder.layers."):
            local, rest = name[len("decoder.layers.") :].split(".", 1)
            return f"decoder.layers.{int(local) + stage.layers.start}.{rest}"
        if name == "output_layer.weight" and spec.tie_embeddings:  # the last stage's copy
            return "embedding.word_embeddings.weight"
        return name

    grad_diff, tied_diff, covered = 0.0, 0.0, 0
    for name, param in staged.gpt.named_parameters():
        diff = float((param.grad - whole_grads[global_name(name)]).abs().max())
        if spec.tie_embeddings and global_name(name) == "embedding.word_embeddings.weight":
            tied_diff = max(tied_diff, diff)  # two copies' gradients summed: another order of the sum
        else:
            grad_diff = max(grad_diff, diff)
        covered += param.numel()
    lp_diff = 0.0
    for got in (forward_lp, trained_lp):
        if stage.last:
            lp_diff = max(lp_diff, max(float((a - b).abs().max()) for a, b in zip(got, whole_lp)))
    numbers = torch.tensor([grad_diff, lp_diff, float(len(forward_lp)), float(covered), tied_diff], dtype=torch.float64)
    gathered = [torch.zeros_like(numbers) for _ in range(info.world_size)]
    dist.all_gather(gathered, numbers)
    return {
        "tied": spec.tie_embeddings,
        "stages": _all_stage_layers(stage, info),
        "grad_max_diff": max(float(g[0]) for g in gathered),
        "tied_grad_max_diff": max(float(g[4]) for g in gathered),
        "logprob_max_diff": max(float(g[1]) for g in gathered),
        "rows_scored_per_rank": [int(g[2]) for g in gathered],
        "parameters_per_rank": [int(g[3]) for g in gathered],
        "whole_parameters": sum(p.numel() for p in whole.gpt.parameters()),
        "pp_size": parallel_state.get_pipeline_model_parallel_world_size(),
    }


def _sum_tied_embedding_grads(gpt) -> None:
    """What ``finalize_model_grads`` does for the actor's DDP-wrapped model, on this bare one: under PP
    with tied embeddings the first stage's embedding gradient and the last stage's copy's, summed over
    the embedding group."""
    from megatron.core import parallel_state

    if gpt.share_embeddings_and_output_weights and (gpt.pre_process or gpt.post_process):
        grad = gpt.shared_embedding_or_output_weight().grad
        dist.all_reduce(grad, group=parallel_state.get_embedding_group())


def _all_stage_layers(stage, info) -> list[list[int]]:
    """Every rank's (first layer, last layer + 1) of its stage, in rank order."""
    mine = torch.tensor([stage.layers.start, stage.layers.stop], dtype=torch.int64)
    gathered = [torch.zeros_like(mine) for _ in range(info.world_size)]
    dist.all_gather(gathered, mine)
    return [g.tolist() for g in gathered]


def check_pp_matrix(args, info, out):
    """The matrix run of the text families and Qwen2.5-VL (images through the vision tower on the first
    stage) through the actor at this world's pipeline size: log-probs
    (``compute_logprobs``), loss, gradients (HF layout, every stage's sent to rank 0), grad norm and
    the weights after a step, which must be the same TP's without PP (``matrix_tp1_KIND.pt``,
    ``matrix_tp2_sp_KIND.pt``); Qwen3-MoE once more replaying random routes (R3: each stage's MoE layers
    take their own columns of the routes)."""
    for kind, suffix, batch, actor in matrix_actors([k for k in PP_MATRIX_KINDS if k in LAUNCH.families], info):
        if not suffix:  # each stage's parameters as built and as the memory plan counts them
            plan = rank_parameters(actor.spec, info.tp_size, actor.policy.moe, stage=actor.policy.stage).trained
            built = sum(p.numel() for p in actor.policy.module.parameters() if p.requires_grad)
            counts = [None] * info.world_size
            dist.all_gather_object(counts, (built, plan))
            out.setdefault("pp_parameters", {})[kind] = counts
        logprobs = [lp.tolist() for lp in actor.compute_logprobs(batch)]
        sums = actor.accumulate_gradients(actor.share_of(batch, ADVANTAGES, len(batch)))
        decoder = {n[len("gpt.") :]: p for n, p in actor.policy.module.named_parameters() if n.startswith("gpt.")}
        grads = dict(export.iter_hf_weights(actor.policy, tensors={n: p.main_grad for n, p in decoder.items()}))
        step = actor.apply_gradients()
        result = {
            "logprobs": logprobs,
            "loss": sums["loss"],
            "metric_keys": sorted(sums),
            "grads": grads,
            "grad_norm": step["train/grad_norm"],
            "weights": actor.export_hf(),
            "replayed_routes": sums.get("routing_replay_routes", 0.0),
            "layout": actor.layout_name,
            **_second_step(actor, batch),
        }
        if is_main(info):
            torch.save(result, Path(args.out) / f"matrix_{layout_tag(info)}_{kind}{suffix}.pt")
    out["pp_matrix"] = "saved"


def check_pp_refusals(args, info, out):
    """What pipeline parallelism does not run with yet: each refused by name, before anything is built
    (the CP and EP sizes are this world's with that size, as the actor reads them)."""
    cases = {
        "shared_prefix": ("llama", TrainConfig(shared_prefix_training=True), info),
        "context_parallel": ("llama", TrainConfig(), dataclasses.replace(info, cp_size=2)),
        "aux_loss_recomputed": (
            "qwen3-moe",
            TrainConfig(moe_aux_loss_coef=0.01, recompute_granularity="selective", recompute_modules=["moe"]),
            info,
        ),
        "deepstack": ("qwen3-vl", TrainConfig(), info),
        "replay_recomputed": (
            "qwen3-moe",
            TrainConfig(use_rollout_routing_replay=True, recompute_granularity="selective", recompute_modules=["moe"]),
            info,
        ),
    }
    refused = {}
    for name, (kind, train, layout) in cases.items():
        try:
            MegatronActor(str(tiny_model_dir(kind)), train, ALGO, layout)
        except Exception as e:  # noqa: BLE001 - the message is the result
            refused[name] = f"{type(e).__name__}: {e}"
    out["pp_refusals"] = refused


CHECKS = {
    "matrix": check_matrix,
    "dp": check_dp,
    "ep_rows": check_ep_rows,
    "dispatchers": check_dispatchers,
    "pipeline": check_pipeline,
    "pp_matrix": check_pp_matrix,
    "pp_refusals": check_pp_refusals,
}
