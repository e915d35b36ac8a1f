"""Megatron checks run in their own processes (one process per rank, launched by the tests with
``torchrun`` or plain python for world size 1). Each check writes its numbers to ``--out`` as JSON /
.pt; the pytest side asserts on them. One launch runs many checks: importing megatron +
transformers costs ~10 s per process, so tests share launches.

    python megatron_worker.py --tp 1 --checks families,matrix --out DIR

Every check drives the actor through its own code paths (``accumulate_gradients`` /
``apply_gradients`` / ``train``), never a copy of them.
"""

import argparse
import dataclasses
import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from megatron_worlds import DENSE_FAMILIES, FAMILIES, MOE_FAMILIES, REFUSED_ROPE, ROPE_CASES

from slime_mt.algo.batching import reduction_weights
from slime_mt.algo.losses import LossInputs, policy_loss
from slime_mt.assets import smollm2_dir, tiny_model_dir
from slime_mt.backends.megatron.actor import MegatronActor
from slime_mt.backends.megatron.checkpoint import _inner_optimizers
from slime_mt.backends.megatron.memory_plan import rank_parameters, vision_parameters
from slime_mt.backends.megatron.parallel import destroy_parallel, init_parallel
from slime_mt.config import AlgoConfig, TrainConfig
from slime_mt.safetensors_files import CheckpointReader, load_hf_state
from slime_mt.types import TrainingSample

SELECTED = FAMILIES  # the families this launch's checks run (--families)
SEQUENCE_PARALLEL = False  # --sp: the matrix and load-balancing checks train with --sequence-parallel
ALGO = AlgoConfig(eps_clip=0.2, eps_clip_high=0.28, entropy_coef=0.01, use_tis=True, tis_clip=2.0)
TEMPERATURE = 0.8


def images():
    from PIL import Image, ImageDraw

    first = Image.new("RGB", (96, 64), (200, 30, 30))
    ImageDraw.Draw(first).line([(0, 0), (90, 60)], fill=(255, 255, 255), width=3)
    return [first, Image.new("RGB", (64, 112), (20, 90, 200))]


def sequences(path: Path, kind: str) -> list[TrainingSample]:
    """Two sequences per model: a text chat and (VLMs) a prompt with two images."""
    from slime_mt.processing import load_tokenizer_or_processor

    processor = load_tokenizer_or_processor(path)
    tokenizer = getattr(processor, "tokenizer", processor)
    out = []
    chat = (
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "What is 12 times 7? Think briefly."}],
            tokenize=False,
            add_generation_prompt=True,
        )
        + "12 times 7 is 84."
    )
    ids = tokenizer(chat, add_special_tokens=False)["input_ids"]
    out.append(TrainingSample(ids[:-8], ids[-8:], [1] * 8, [-1.0] * 8, 1.0, "0/0", 0, True))
    if kind.endswith("-vl"):
        text = processor.apply_chat_template(
            [
                {
                    "role": "user",
                    "content": [{"type": "image"}, {"type": "text", "text": "Compare with"}, {"type": "image"}],
                }
            ],
            add_generation_prompt=True,
        )
        inputs = processor(text=text + "The first is red.", images=images())
        ids = inputs["input_ids"][0].tolist()
        mm = {"pixel_values": inputs["pixel_values"], "image_grid_thw": inputs["image_grid_thw"]}
        out.append(
            TrainingSample(ids[:-5], ids[-5:], [1] * 5, [-1.0] * 5, 0.0, "0/1", 0, True, multimodal_train_inputs=mm)
        )
    return out


def hf_model(path: Path, dtype=torch.float32, attn="eager"):
    """transformers' model of ``path``; MoE experts run one by one (its grouped GEMM takes no fp64)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    cls = AutoModelForImageTextToText if "vl" in Path(path).name else AutoModelForCausalLM
    moe = {"experts_implementation": "eager"} if "moe" in Path(path).name else {}
    return cls.from_pretrained(str(path), dtype=dtype, attn_implementation=attn, **moe).eval()


def hf_logits(model, sample: TrainingSample) -> torch.Tensor:
    """``[len, V]`` logits of transformers on one sequence (on the model's device)."""
    device = next(model.parameters()).device
    ids = torch.tensor([sample.prompt_ids + sample.response_ids], device=device)
    extra = {}
    if sample.multimodal_train_inputs:
        extra = {k: v.to(device) for k, v in sample.multimodal_train_inputs.items()}
        extra["mm_token_type_ids"] = (ids == model.config.image_token_id).long()
    return model(input_ids=ids, attention_mask=torch.ones_like(ids), **extra).logits[0]


def megatron_logits(actor, sample: TrainingSample) -> torch.Tensor:
    row = actor.pack([sample], [0])
    extra = {"pixel_values": row.pixel_values, "image_grid_thw": row.image_grid_thw} if actor._mrope else {}
    with torch.no_grad():
        return actor.policy(row.tokens, row.position_ids, row.attention_mask, **extra)[0][:, : actor.spec.vocab_size]


def is_main(info) -> bool:
    return info.rank == 0


# ---------------------------------------------------------------- HF parity per family


def check_families(args, info, out):
    """Megatron logits vs transformers (its SDPA attention: the same fp32 arithmetic as the fused core
    attention; eager; and an fp64 reference, against which transformers' own fp32 errors, eager and
    SDPA, are the bound), and Megatron -> HF export equal to the checkpoint."""
    dense = {"smollm2": smollm2_dir()} if "llama" in SELECTED else {}
    paths = {**dense, **{k: tiny_model_dir(k) for k in SELECTED}}
    result = {}
    for kind, path in paths.items():
        actor = MegatronActor(str(path), TrainConfig(lr=1e-5), AlgoConfig(), info)
        eager, sdpa, fp64 = hf_model(path), hf_model(path, attn="sdpa"), hf_model(path, torch.float64)
        rows = []
        for sample in sequences(path, kind):
            with torch.no_grad():
                mg, e, s, r = (
                    megatron_logits(actor, sample),
                    hf_logits(eager, sample),
                    hf_logits(sdpa, sample),
                    hf_logits(fp64, sample),
                )
            rows.append(
                {
                    "vs_eager": float((mg - e).abs().max()),
                    "vs_sdpa": float((mg - s).abs().max()),
                    "vs_fp64": float((mg.double() - r).abs().max()),
                    "hf_fp32_vs_fp64": float((e.double() - r).abs().max()),
                    "hf_sdpa_fp32_vs_fp64": float((s.double() - r).abs().max()),
                    "hf_eager_vs_sdpa": float((e - s).abs().max()),
                    "max_abs_logit": float(r.abs().max()),
                }
            )
        exported = actor.export_hf()
        source = load_hf_state(path)
        mismatched = [k for k in source if k not in exported or not torch.equal(source[k], exported[k])]
        extra = sorted(set(exported) - set(source))
        result[kind] = {"sequences": rows, "export_mismatched": mismatched, "export_extra": extra}
    out["families"] = result


# ---------------------------------------------------------------- the TP matrix


def matrix_batch(path: Path, kind: str) -> list[TrainingSample]:
    """Four random text sequences of two prompt groups (+ the image sequence for VLMs)."""
    vocab = json.loads((Path(path) / "config.json").read_text())
    vocab = vocab.get("text_config", vocab)["vocab_size"]
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(4):
        prompt = torch.randint(100, vocab - 100, (6 + 3 * i,), generator=g).tolist()
        response = torch.randint(100, vocab - 100, (5,), generator=g).tolist()
        mask = [1, 1, 0, 1, 1]
        samples.append(TrainingSample(prompt, response, mask, [-11.9] * 5, float(i % 2), f"{i // 2}/{i}", i // 2, True))
    if kind.endswith("-vl"):
        image = [s for s in sequences(path, kind) if s.multimodal_train_inputs][0]
        image.group_id, image.trajectory_id = 1, "1/9"
        samples = samples[:3] + [image]
    return samples


ADVANTAGES = [1.0, -1.0, 0.5, -0.5]


def replicated_spread(actor) -> float:
    """Largest difference between the TP ranks' copies of parameters that are replicated (norms)."""
    if actor.info.tp_size == 1:
        return 0.0
    spread = 0.0
    group = actor._tp_group()
    for p in actor.policy.parameters():
        if getattr(p, "tensor_model_parallel", False):
            continue
        copies = [torch.empty_like(p) for _ in range(actor.info.tp_size)]
        dist.all_gather(copies, p.detach().contiguous(), group=group)
        spread = max(spread, max(float((c - copies[0]).abs().max()) for c in copies))
    return spread


def layout_tag(info) -> str:
    """``tp2``, or ``tp2_ep2`` in an expert-parallel world (``tp2_ep2_etp1`` when experts are not split
    like the TP), ``_pp2`` added under pipeline parallelism, ``_cp2`` under context parallelism, ``_sp``
    under sequence parallelism."""
    tag = f"tp{info.tp_size}" + (f"_ep{info.ep_size}" if info.ep_size > 1 else "")
    tag += f"_etp{info.etp_size}" if info.etp_size != info.tp_size else ""
    tag += f"_pp{info.pp_size}" if info.pp_size > 1 else ""
    return tag + (f"_cp{info.cp_size}" if info.cp_size > 1 else "") + ("_sp" if SEQUENCE_PARALLEL else "")


def planned_parameters(actor, path) -> dict:
    """This rank's parameter elements, trained and frozen, as built and as the memory plan counts them."""
    count = rank_parameters(
        actor.spec, actor.info.tp_size, actor.moe, vision_parameters(CheckpointReader(path)), vision_frozen=True
    )
    params = list(actor.policy.parameters())
    return {
        "built": [
            sum(p.numel() for p in params if p.requires_grad),
            sum(p.numel() for p in params if not p.requires_grad),
        ],
        "plan": [count.trained, count.frozen],
    }


def check_matrix(args, info, out):
    """Per family: log-probs, entropies, loss, gradients (HF layout), grad norm, replicated copies
    after a step and the weights after a step, for TP=1 vs TP=2 vs transformers (the MoE families
    only in an expert-parallel world); MoE families once more replaying random routes (R3,
    ``matrix_TAG_KIND_r3.pt``), which every layout must replay alike."""
    for kind, suffix, batch, actor in matrix_actors(MOE_FAMILIES if info.ep_size > 1 else SELECTED, info):
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
                sequence_parallel=SEQUENCE_PARALLEL,
            )
            yield kind, suffix, batch, MegatronActor(str(path), train, ALGO, info, temperature=TEMPERATURE)


def check_aux_loss(args, info, out):
    """The load-balancing loss on (coefficient 0.01), the Qwen3-MoE batch: this layout's gradients (HF
    layout) and router metrics, which every layout must give alike (a TP or CP rank's loss is its
    tokens' share of the row's) -> ``aux_TAG.pt``."""
    path = tiny_model_dir("qwen3-moe")
    samples = matrix_batch(path, "qwen3-moe")
    train = TrainConfig(lr=1e-5, micro_batch_size=2, moe_aux_loss_coef=0.01, sequence_parallel=SEQUENCE_PARALLEL)
    actor = MegatronActor(str(path), train, ALGO, info, temperature=TEMPERATURE)
    sums = actor.accumulate_gradients(actor.share_of(samples, ADVANTAGES, len(samples)))
    decoder = {n[len("gpt.") :]: p for n, p in actor.policy.named_parameters() if n.startswith("gpt.")}
    grads = dict(actor.iter_hf_weights(tensors={n: p.main_grad for n, p in decoder.items()}))
    if is_main(info):
        metrics = {k: v for k, v in sums.items() if k.startswith("moe/")}
        torch.save({"grads": grads, "metrics": metrics}, Path(args.out) / f"aux_{layout_tag(info)}.pt")
    out["aux_loss"] = "saved"


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
            row = actor.pack(samples, [i])
            lp, ent = actor._logprobs(actor.policy, row, True, TEMPERATURE)
            logprobs.append(lp.tolist())
            entropies.append(ent.tolist())
            pads.append(row.pad)
    sums = actor.accumulate_gradients(actor.share_of(samples, ADVANTAGES, len(samples)))
    decoder = {n[len("gpt.") :]: p for n, p in actor.policy.named_parameters() if n.startswith("gpt.")}
    grads = dict(actor.iter_hf_weights(tensors={n: p.main_grad for n, p in decoder.items()}))
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
        "sequence_parallel": bool(actor.policy.config.sequence_parallel),
        "row_pads": pads,  # tokens sequence parallelism padded each one-sample row with
    }


# activation recompute cases (Megatron's flags), each against none: whole layers by chunk and by block,
# the core attention (Megatron's selective default), the dense MLP, and the MoE layer (MoE families)
RECOMPUTE_CASES = {
    "none": {},
    "full_uniform": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full_block": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    "selective": dict(recompute_granularity="selective"),
    "selective_mlp": dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"]),
    "selective_moe": dict(recompute_granularity="selective", recompute_modules=["core_attn", "moe"]),
}
RECOMPUTE_KINDS = ("qwen3", "qwen2.5-vl", "qwen3-moe", "qwen3-vl-moe")  # a text and a VLM of each kind


def random_routes(path, samples) -> list[TrainingSample]:
    """``samples`` with random engine routes for every token but the last (R3), as uint8 rows."""
    from slime_mt.routes import RouteLayout

    layout = RouteLayout.of(json.loads((Path(path) / "config.json").read_text()))
    g = torch.Generator().manual_seed(3)
    out = []
    for s in samples:
        rows = (len(s.prompt_ids) + len(s.response_ids) - 1) * len(layout.moe_layers)
        picks = torch.stack([torch.randperm(layout.num_experts, generator=g)[: layout.top_k] for _ in range(rows)])
        out.append(dataclasses.replace(s, routed_experts=picks.reshape(-1, len(layout.moe_layers), layout.top_k)))
    return [dataclasses.replace(r, routed_experts=r.routed_experts.to(layout.dtype)) for r in out]


def check_recompute(args, info, out):
    """Per family this launch runs (a text and a VLM of each kind): one step of every recompute case
    against none, on fresh actors -> the largest differences of log-probs, entropies, loss, gradients
    and grad norm, whether the step's metrics match, and the bytes each forward kept for its backward
    (fewer with recompute). MoE replays random routes (R3): the recomputed layers must replay them
    too, or the gradients move."""
    from slime_mt.backends.megatron.families import have_transformer_engine
    from slime_mt.backends.megatron.recompute import in_backward
    from slime_mt.errors import ModelConfigError

    results = {}
    for kind in [k for k in RECOMPUTE_KINDS if k in (MOE_FAMILIES if info.ep_size > 1 else SELECTED)]:
        path, moe = tiny_model_dir(kind), kind in MOE_FAMILIES
        samples = matrix_batch(path, kind)
        samples = random_routes(path, samples) if moe else samples
        runs = {}
        for case, flags in RECOMPUTE_CASES.items():
            if case == "selective_moe" and not moe:
                continue
            train = TrainConfig(
                lr=1e-5,
                micro_batch_size=2,
                use_rollout_routing_replay=moe,
                sequence_parallel=SEQUENCE_PARALLEL,
                **flags,
            )
            actor = MegatronActor(str(path), train, ALGO, info, temperature=TEMPERATURE)
            with torch.no_grad():
                rows = [actor._logprobs(actor.policy, actor.pack(samples, [i]), True, TEMPERATURE) for i in range(4)]
            kept = [0]

            def pack(t, kept=kept):
                kept[0] += 0 if in_backward() else t.numel() * t.element_size()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                sums = actor.accumulate_gradients(actor.share_of(samples, ADVANTAGES, len(samples)))
            grads = {n: p.main_grad.clone() for n, p in actor.policy.named_parameters() if p.requires_grad}
            runs[case] = {
                "lp": torch.cat([lp for lp, _ in rows]),
                "ent": torch.cat([ent for _, ent in rows]),
                "sums": sums,
                "grads": grads,
                "grad_norm": actor.apply_gradients()["train/grad_norm"],
                "kept_bytes": kept[0],
            }
        base = runs["none"]
        results[kind] = {
            case: {
                "logprobs": float((r["lp"] - base["lp"]).abs().max()),
                "entropy": float((r["ent"] - base["ent"]).abs().max()),
                "loss": abs(r["sums"]["loss"] - base["sums"]["loss"]),
                "grads": max(float((g - base["grads"][n]).abs().max()) for n, g in r["grads"].items()),
                "grad_norm": abs(r["grad_norm"] - base["grad_norm"]),
                "metrics_equal": r["sums"] == base["sums"],
                "kept_bytes": r["kept_bytes"],
                "replayed_routes": r["sums"].get("routing_replay_routes", 0.0),
            }
            for case, r in runs.items()
        }
    out["recompute"] = results
    if not have_transformer_engine():  # what Megatron recomputes through Transformer Engine only
        try:
            MegatronActor(
                str(path), TrainConfig(recompute_granularity="selective", recompute_modules=["layernorm"]), ALGO, info
            )
        except ModelConfigError as e:
            out["recompute_refused"] = str(e)


def step_outputs(path, train: TrainConfig, samples, advantages, info) -> dict:
    """One packed forward (log-probs, entropies, the row's attention layout) and one gradient
    accumulation (loss, this rank's gradient shards) of a fresh actor on ``samples`` in one row."""
    from slime_mt.backends.megatron.layouts import Segments

    everything = list(range(len(samples)))
    actor = MegatronActor(str(path), train, ALGO, info, temperature=TEMPERATURE)
    row = actor.pack(samples, everything)
    with torch.no_grad():
        lp, ent = actor._logprobs(actor.policy, row, True, TEMPERATURE)
    sums = actor.accumulate_gradients(actor.share_of(samples, advantages, len(samples)))
    grads = {n: p.main_grad.detach().clone() for n, p in actor.policy.named_parameters() if p.requires_grad}
    return {
        "lp": lp,
        "ent": ent,
        "loss": sums["loss"],
        "grads": grads,
        "sums": sums,
        "row_tokens": row.num_real_tokens,
        "segments": isinstance(row.attention_mask, Segments),
        "images": 0 if row.image_grid_thw is None else int(row.image_grid_thw.shape[0]),
    }


def compare(a: dict, b: dict, info) -> dict:
    """Largest differences of two ``step_outputs`` over the TP ranks (and b's scale)."""
    diffs = torch.tensor(
        [
            float((a["lp"] - b["lp"]).abs().max()),
            float((a["ent"] - b["ent"]).abs().max()),
            abs(a["loss"] - b["loss"]),
            max(float((a["grads"][n] - g).abs().max()) for n, g in b["grads"].items()),
            max(float(g.abs().max()) for g in b["grads"].values()),
            float(b["ent"].abs().max()),
        ]
    )
    if info.world_size > 1:
        dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
    return {
        "logprobs": float(diffs[0]),
        "entropy": float(diffs[1]),
        "loss": float(diffs[2]),
        "grads": float(diffs[3]),
        "max_grad": float(diffs[4]),
        "max_entropy": float(diffs[5]),
    }


def check_attention(args, info, out):
    """Per family: the fused core attention vs Megatron's DotProductAttention on one packed row of the
    matrix batch (every sequence in it): log-probs, entropies, loss and this rank's gradient shards
    (largest differences over the TP ranks), and the layout each packs with."""
    result = {}
    for kind in SELECTED:
        path = tiny_model_dir(kind)
        samples = matrix_batch(path, kind)
        got = {
            attention: step_outputs(
                path,
                TrainConfig(lr=1e-5, micro_batch_size=len(samples), local_attention=attention),
                samples,
                ADVANTAGES,
                info,
            )
            for attention in ("fused", "megatron")
        }
        result[kind] = {
            **compare(got["fused"], got["megatron"], info),
            "sequences": len(samples),
            "fused_packs_segments": got["fused"]["segments"],
            "reference_packs_segments": got["megatron"]["segments"],
        }
    out["attention"] = result


def tree_batches(vocab: int) -> dict[str, list[TrainingSample]]:
    """(a) a GRPO group: 8 responses to one 40-token prompt; (b) step-wise strip_thinking steps: step k's
    prompt is the prompt and the earlier answers and observations (their thinking stripped), its
    response this turn's thinking and answer."""
    g = torch.Generator().manual_seed(3)
    ids = lambda n: torch.randint(100, vocab - 100, (n,), generator=g).tolist()  # noqa: E731
    prompt = ids(40)
    group = [
        TrainingSample(prompt, r, [1] * 12, [-11.9] * 12, float(i % 3), f"0/{i}", 0, True)
        for i, r in enumerate(ids(12) for _ in range(8))
    ]
    steps, history = [], list(prompt)
    for k in range(4):
        thinking, answer, observation = ids(10), ids(4), ids(6)
        steps.append(
            TrainingSample(list(history), thinking + answer, [1] * 14, [-11.9] * 14, float(k == 3), "1/0", 1, k == 3)
        )
        history += answer + observation
    return {"grpo": group, "strip_thinking": steps}


def vlm_tree_batches(path: Path) -> dict[str, list[TrainingSample]]:
    """(a) two GRPO groups of 4 responses, to one prompt with image A and to the same text with image B;
    (b) three step-wise steps whose history grows by an image each turn (B, then A again) and whose
    thinking is stripped: the images they share are computed once, A's second showing included."""
    from slime_mt.processing import load_tokenizer_or_processor

    processor = load_tokenizer_or_processor(path)
    vocab = json.loads((Path(path) / "config.json").read_text())
    vocab = vocab.get("text_config", vocab)["vocab_size"]
    g = torch.Generator().manual_seed(4)
    ids = lambda n: torch.randint(100, min(vocab, 150000) - 100, (n,), generator=g).tolist()  # noqa: E731
    a, b = images()
    pad = "<|vision_start|><|image_pad|><|vision_end|>"

    def piece(text, image):
        inputs = processor(text=text, images=[image])
        return inputs["input_ids"][0].tolist(), inputs["pixel_values"], inputs["image_grid_thw"]

    def sample(prompt, parts, response, tid, group):
        mm = {"pixel_values": torch.cat([p[1] for p in parts]), "image_grid_thw": torch.cat([p[2] for p in parts])}
        return TrainingSample(
            list(prompt),
            response,
            [1] * len(response),
            [-11.9] * len(response),
            float(group),
            tid,
            group,
            True,
            multimodal_train_inputs=mm,
        )

    question = f"<|im_start|>user\n{pad}What is drawn?<|im_end|>\n<|im_start|>assistant\n"
    observation = f"<|im_end|>\n<|im_start|>user\n{pad}And now?<|im_end|>\n<|im_start|>assistant\n"
    prompt_a, prompt_b = piece(question, a), piece(question, b)
    group = [sample(p[0], [p], ids(6), f"{k}/{i}", k) for k, p in enumerate((prompt_a, prompt_b)) for i in range(4)]
    steps, history, parts = [], list(prompt_a[0]), [prompt_a]
    for image in (b, a, None):
        thinking, answer = ids(5), ids(3)
        steps.append(sample(history, list(parts), thinking + answer, "2/0", 2))
        if image is not None:
            obs = piece(observation, image)
            history += answer + obs[0]
            parts.append(obs)
    return {"vlm_grpo": group, "vlm_steps": steps}


def check_tree(args, info, out):
    """Per family and batch: prefix-tree packing vs the flat row: log-probs, entropies, loss and
    gradients, the tokens each forwards and the images each runs through the vision tower."""
    result = {}
    for kind in SELECTED:
        path = tiny_model_dir(kind)
        vocab = json.loads((Path(path) / "config.json").read_text()).get("vocab_size", 151936)
        batches = vlm_tree_batches(path) if "-vl" in kind else tree_batches(vocab)
        for name, samples in batches.items():
            advantages = [0.5 - i / len(samples) for i in range(len(samples))]
            got = {
                tree: step_outputs(
                    path,
                    TrainConfig(lr=1e-5, micro_batch_size=len(samples), shared_prefix_training=tree),
                    samples,
                    advantages,
                    info,
                )
                for tree in (True, False)
            }
            result[f"{kind}/{name}"] = {
                **compare(got[True], got[False], info),
                "flat_tokens": got[False]["row_tokens"],
                "tree_tokens": got[True]["row_tokens"],
                "sums_before": got[True]["sums"]["tokens_before_sharing"],
                "sums_after": got[True]["sums"]["tokens_after_sharing"],
                "flat_images": got[False]["images"],
                "tree_images": got[True]["images"],
            }
    out["tree"] = result
    if "qwen3" not in SELECTED:
        return
    # a token budget counts tree tokens: 40 + 12 k <= 100 puts five responses in a row (flat: one)
    group = tree_batches(1000)["grpo"]
    budget = {
        tree: MegatronActor(
            str(tiny_model_dir("qwen3")),
            TrainConfig(shared_prefix_training=tree, max_tokens_per_micro_batch=100),
            ALGO,
            info,
        )._rows(group, list(range(8)))
        for tree in (True, False)
    }
    out["tree_rows"] = {"tree": [len(r) for r in budget[True]], "flat": [len(r) for r in budget[False]]}
    from slime_mt.errors import ModelConfigError

    refused = {}
    for kind, train in (("qwen3", TrainConfig(shared_prefix_training=True, local_attention="megatron")),):
        try:
            MegatronActor(str(tiny_model_dir(kind)), train, ALGO, info)
            refused[kind] = ""
        except ModelConfigError as e:
            refused[kind] = str(e)
    out["tree_refused"] = refused


def check_hf_reference(args, info, out):
    """transformers on the matrix batch: the same loss (policy_loss on the same inputs), its
    gradients and their norm (the frozen vision tower excluded, as in the actor)."""
    for kind in SELECTED:
        path = tiny_model_dir(kind)
        model = hf_model(path)
        model.train()
        if hasattr(model.model, "visual"):
            for p in model.model.visual.parameters():
                p.requires_grad_(False)
        samples = matrix_batch(path, kind)
        weights = reduction_weights(samples, "token_mean")
        lps, ents = [], []
        for s in samples:
            logits = hf_logits(model, s).float()[len(s.prompt_ids) - 1 : -1] / TEMPERATURE
            logp = torch.log_softmax(logits, -1)
            lps.append(logp.gather(1, torch.tensor(s.response_ids)[:, None])[:, 0])
            ents.append(-(logp.exp() * logp).sum(-1))
        lp = torch.cat(lps)
        cat = lambda xs: torch.cat([torch.as_tensor(x, dtype=torch.float32) for x in xs])  # noqa: E731
        inputs = LossInputs(
            lp,
            lp.detach(),
            cat([s.rollout_log_probs for s in samples]),
            cat([[a * m for m in s.loss_mask] for a, s in zip(ADVANTAGES, samples)]),
            cat(weights),
            torch.cat([torch.full((len(s.response_ids),), k) for k, s in enumerate(samples)]),
            entropy=torch.cat(ents),
        )
        loss, _ = policy_loss(inputs, ALGO)
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())))
        torch.save(
            {
                "logprobs": [x.tolist() for x in lps],
                "entropy": [x.tolist() for x in ents],
                "loss": float(loss.detach()),
                "grads": _checkpoint_names(grads, path),
                "grad_norm": norm,
            },
            Path(args.out) / f"matrix_hf_{kind}.pt",
        )
    out["hf_reference"] = "saved"


def _checkpoint_names(named: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    """transformers' module names -> the checkpoint's names (VLMs keep ``model.language_model.``), and
    its in-memory fused experts (``[E, 2I, H]``, ``[E, H, I]``) -> the checkpoint's expert layout
    (per-expert tensors, or the published fused ``[E, H, 2I]``, ``[E, I, H]``)."""
    names = set(load_hf_state(path))
    out = {}
    for name, t in list(named.items()):
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            mlp, which = name.rsplit("experts.", 1)
            mlp = next(
                m
                for m in (mlp, mlp.replace("model.language_model.", "model.", 1))
                if f"{m}experts.0.down_proj.weight" in names or f"{m}experts.{which}" in names
            )
            if f"{mlp}experts.{which}" in names:  # fused in the checkpoint: the published layout
                out[f"{mlp}experts.{which}"] = t.transpose(1, 2)
            else:
                for e, expert in enumerate(t.unbind(0)):
                    if which == "down_proj":
                        out[f"{mlp}experts.{e}.down_proj.weight"] = expert
                    else:
                        gate, up = expert.chunk(2, dim=0)
                        out[f"{mlp}experts.{e}.gate_proj.weight"] = gate
                        out[f"{mlp}experts.{e}.up_proj.weight"] = up
            continue
        candidates = [
            name,
            name.replace("model.language_model.", "model.", 1),
            name.replace("model.", "model.language_model.", 1),
        ]
        out[next((c for c in candidates if c in names), name)] = t
    return out


# ---------------------------------------------------------------- data parallel


def dp_batch() -> list[TrainingSample]:
    """Four prompt groups of very different lengths and loss-mask counts (per-rank normalisation
    would weigh them differently from the global one)."""
    g = torch.Generator().manual_seed(1)
    samples = []
    for group, (prompt, response) in enumerate([(5, 3), (40, 30), (8, 12), (25, 4)]):
        for k in range(2):
            mask = [1] * response if group % 2 else [1, 0] * (response // 2) + [1] * (response % 2)
            samples.append(
                TrainingSample(
                    torch.randint(100, 150000, (prompt + k,), generator=g).tolist(),
                    torch.randint(100, 150000, (response,), generator=g).tolist(),
                    mask,
                    [-11.0] * response,
                    float(k),
                    f"{group}/{k}",
                    group,
                    True,
                )
            )
    return samples


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
                    for inner in _inner_optimizers(actor.optimizer)
                    for s in inner.optimizer.state.values()
                    for t in s.values()
                ]
                mains = [
                    p
                    for inner in _inner_optimizers(actor.optimizer)
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


def check_distopt_reshard(args, info, out):
    """--use-distributed-optimizer at this layout: load the TP=1 checkpoint (reshard/a, replicated Adam),
    save it again (reshard/d: the shards gathered), and take tp1's extra step from it."""
    root = Path(args.out) / "reshard"
    train = dataclasses.replace(RESHARD_CFG, use_distributed_optimizer=True)
    actor = MegatronActor(str(tiny_model_dir("qwen3")), train, AlgoConfig(), info)
    extra = actor.load(root / "a")
    actor.save(root / "d", extra)
    reshard_step(actor, args, info, f"reshard_continued_distopt_dp{info.dp_size}.pt")
    out["distopt_reshard"] = {"step": actor.step, "extra": extra}


# ---------------------------------------------------------------- bf16


def check_bf16(args, info, out):
    """bf16 parameters and activations with fp32 main parameters and gradients; the fp32 vs bf16
    log-prob difference per family; three training steps stay finite and move the weights."""
    result = {}
    for kind in SELECTED:
        path = tiny_model_dir(kind)
        samples = matrix_batch(path, kind)
        fp32 = MegatronActor(str(path), TrainConfig(lr=1e-4), ALGO, info, temperature=TEMPERATURE)
        ref = torch.cat(fp32.compute_logprobs(samples))
        del fp32
        actor = MegatronActor(str(path), TrainConfig(lr=1e-4, bf16=True), ALGO, info, temperature=TEMPERATURE)
        lp = torch.cat(actor.compute_logprobs(samples))
        decoder = [p for n, p in actor.policy.named_parameters() if n.startswith("gpt.")]
        before = [p.main_param.clone() for p in decoder]
        steps = [actor.train(actor.share_of(samples, ADVANTAGES, 2), on_policy=False) for _ in range(3)]
        moved = sum(int(not torch.equal(b, p.main_param)) for b, p in zip(before, decoder))
        result[kind] = {
            "param_dtypes": sorted({str(p.dtype) for p in decoder}),
            "main_param_dtypes": sorted({str(p.main_param.dtype) for p in decoder}),
            "main_grad_dtypes": sorted({str(p.main_grad.dtype) for p in decoder}),
            "logprob_dtype": str(lp.dtype),
            "logprob_mean_abs_diff": float((lp - ref).abs().mean()),
            "logprob_max_abs_diff": float((lp - ref).abs().max()),
            "losses": [s["train/loss"] for s in steps],
            "grad_norms": [s["train/grad_norm"] for s in steps],
            "main_params_moved": moved,
            "main_params": len(decoder),
        }
    out["bf16"] = result


# ---------------------------------------------------------------- RoPE scaling


def rope_model(root: Path, name: str, kind: str, rope: dict) -> Path:
    """A copy of a tiny model whose config declares ``rope`` (the weights do not depend on it)."""
    folder = root / name
    shutil.copytree(tiny_model_dir(kind), folder, dirs_exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    theta = (config.get("rope_parameters") or {}).get("rope_theta") or config.get("rope_theta", 10000.0)
    config["rope_parameters"] = {**rope, "rope_theta": theta}
    config["max_position_embeddings"] = 512
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def check_rope(args, info, out):
    """Megatron vs transformers on a 300-token sequence, past the original 64-token context, per
    supported rope type; the refused types raise naming the key."""
    from slime_mt.errors import ModelConfigError

    root = Path(args.out) / "rope"
    result = {}
    for name, (kind, rope) in ROPE_CASES.items():
        path = rope_model(root, name, kind, rope)
        default = rope_model(root, name + "-default", kind, {"rope_type": "default"})
        vocab = 49152 if kind == "llama" else 151936
        ids = torch.randint(100, vocab - 100, (300,), generator=torch.Generator().manual_seed(3)).tolist()
        sample = TrainingSample(ids[:-1], ids[-1:], [1], [0.0], 0.0, "0/0", 0, True)
        actor = MegatronActor(str(path), TrainConfig(), AlgoConfig(), info)
        with torch.no_grad():
            mg = megatron_logits(actor, sample)
            hf, unscaled = hf_logits(hf_model(path), sample), hf_logits(hf_model(default), sample)
        result[name] = {
            "max_abs_diff": float((mg - hf).abs().max()),
            "scaling_effect": float((hf - unscaled).abs().max()),
            "attention_factor": actor.spec.attention_factor,
        }
    for name, (kind, rope) in REFUSED_ROPE.items():
        path = rope_model(root, name, kind, rope)
        try:
            MegatronActor(str(path), TrainConfig(), AlgoConfig(), info)
            result[name] = {"error": None}
        except ModelConfigError as e:
            result[name] = {"error": str(e)}
    out["rope"] = result


# ---------------------------------------------------------------- SFT


def check_sft(args, info, out):
    """The SFT loss is the NLL at temperature 1, whatever the rollout temperature."""
    path = tiny_model_dir("qwen2")
    samples = matrix_batch(path, "qwen2")
    actor = MegatronActor(str(path), TrainConfig(lr=1e-5, sft=True), AlgoConfig(), info, temperature=0.5)
    loss = actor.accumulate_gradients(actor.share_of(samples, [0.0] * len(samples), len(samples)))["loss"]
    model = hf_model(path)
    weights = reduction_weights(samples, "token_mean")
    expected = {}
    for temperature in (1.0, 0.5):
        total = 0.0
        for s, w in zip(samples, weights):
            with torch.no_grad():
                logp = torch.log_softmax(hf_logits(model, s)[len(s.prompt_ids) - 1 : -1] / temperature, -1)
            total -= float((logp.gather(1, torch.tensor(s.response_ids)[:, None])[:, 0] * torch.tensor(w)).sum())
        expected[temperature] = total
    out["sft"] = {"loss": loss, "nll_t1": expected[1.0], "nll_t05": expected[0.5]}


# ---------------------------------------------------------------- engine fidelity


def check_engine_fidelity(args, info, out):
    """Log-probs the embedded engine sampled vs Megatron's recomputation of the same tokens."""
    import asyncio

    from slime_mt.engine.clients.sglang import EngineClient
    from slime_mt.engine.embedded.server import LocalEngine
    from slime_mt.engine.images import encode_image
    from slime_mt.engine.protocol import collapse_image_pads
    from slime_mt.processing import load_tokenizer_or_processor

    result = {}
    for kind, path in (("smollm2", smollm2_dir()), ("qwen2.5-vl", tiny_model_dir("qwen2.5-vl"))):
        processor = load_tokenizer_or_processor(path)
        tokenizer = getattr(processor, "tokenizer", processor)
        prompts, image_data, mm = [], [], []
        for q in ("Name three fruits.", "What is the capital of Italy?"):
            if kind.endswith("-vl"):
                text = processor.apply_chat_template(
                    [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]}],
                    add_generation_prompt=True,
                )
                inputs = processor(text=text, images=images()[:1])
                prompts.append(inputs["input_ids"][0].tolist())
                image_data.append([encode_image(images()[0])])
                mm.append({"pixel_values": inputs["pixel_values"], "image_grid_thw": inputs["image_grid_thw"]})
            else:
                text = tokenizer.apply_chat_template(
                    [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
                )
                prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
                image_data.append(None)
                mm.append(None)
        with LocalEngine(path, seed=5) as engine:

            async def go(prompts, image_data, processor):
                async with EngineClient(engine.url) as client:
                    reqs = []
                    for ids, imgs in zip(prompts, image_data):
                        engine_ids = collapse_image_pads(ids, processor.image_token_id)[0] if imgs else ids
                        reqs.append(
                            client.generate(
                                engine_ids,
                                {"max_new_tokens": 24, "temperature": 0.8, "ignore_eos": True},
                                image_data=imgs,
                            )
                        )
                    return await asyncio.gather(*reqs)

            responses = asyncio.run(go(prompts, image_data, processor))
        actor = MegatronActor(str(path), TrainConfig(), AlgoConfig(), info, temperature=0.8)
        samples = [
            TrainingSample(
                p,
                r["output_ids"],
                [1] * len(r["output_ids"]),
                [x[0] for x in r["meta_info"]["output_token_logprobs"]],
                0.0,
                f"0/{i}",
                0,
                True,
                multimodal_train_inputs=m,
            )
            for i, (p, r, m) in enumerate(zip(prompts, responses, mm))
        ]
        recomputed = actor.compute_logprobs(samples)
        diffs = torch.cat([(lp.cpu() - torch.tensor(s.rollout_log_probs)).abs() for lp, s in zip(recomputed, samples)])
        result[kind] = {"mean_abs_diff": float(diffs.mean()), "max_abs_diff": float(diffs.max())}
    out["engine_fidelity"] = result


# ---------------------------------------------------------------- checkpoints


def train_steps(actor, steps, start=0):
    from slime_mt.algo.advantages import compute_advantages

    for step in range(start, steps):
        samples = matrix_batch(tiny_model_dir("qwen2"), "qwen2")
        for s in samples:
            s.reward = float((step + s.group_id) % 2)
        actor.train(actor.share_of(samples, compute_advantages(samples, "grpo"), 1), on_policy=False)


def check_checkpoint(args, info, out):
    """4 steps straight vs 2 steps + save + resume + 2 steps: bitwise-equal weights; a save that dies
    midway leaves the previous checkpoint loadable; the checkpoint folder is an HF model folder."""
    path = str(tiny_model_dir("qwen2"))
    cfg = TrainConfig(lr=1e-3, micro_batch_size=2)
    straight = MegatronActor(path, cfg, AlgoConfig(), info)
    torch.manual_seed(0)
    train_steps(straight, 4)
    reference = {k: v.clone() for k, v in straight.policy.state_dict().items() if isinstance(v, torch.Tensor)}
    del straight
    save_dir = Path(args.out) / "ckpt"
    first = MegatronActor(path, cfg, AlgoConfig(), info)
    torch.manual_seed(0)
    train_steps(first, 2)
    saved = first.save(save_dir, {"data_cursor": 2})
    exported = first.export_hf()
    del first
    resumed = MegatronActor(path, cfg, AlgoConfig(), info)
    extra = resumed.load(save_dir)
    train_steps(resumed, 4, start=2)
    state = {k: v for k, v in resumed.policy.state_dict().items() if isinstance(v, torch.Tensor)}
    bitwise = all(torch.equal(reference[k], state[k]) for k in reference)
    from transformers import AutoModelForCausalLM

    as_hf = AutoModelForCausalLM.from_pretrained(str(saved))  # the checkpoint is an HF model folder
    hf_equal = all(torch.equal(exported[k], v) for k, v in load_hf_state(saved).items())
    # a save that dies after writing part of its temp folder: latest still names iter 2 and loads
    original_save = torch.save

    def dying_save(obj, f, *a, **kw):
        Path(f).write_bytes(b"partial")
        raise KeyboardInterrupt("killed while saving")

    torch.save = dying_save
    try:
        resumed.save(save_dir, {"data_cursor": 4})
    except KeyboardInterrupt:
        pass
    finally:
        torch.save = original_save
    again = MegatronActor(path, cfg, AlgoConfig(), info)
    again_extra = again.load(save_dir)
    out["checkpoint"] = {
        "bitwise_equal": bitwise,
        "extra": extra,
        "after_killed_save": again_extra,
        "latest": (save_dir / "latest").read_text(),
        "step": again.step,
        "hf_loadable": type(as_hf).__name__,
        "hf_weights_equal_export": hf_equal,
    }


def check_checkpoint_bf16(args, info, out):
    """Under bf16 a checkpoint restores the fp32 main parameters and the optimizer state exactly (the
    bf16 weights are their rounding), and training continues identically."""
    path = str(tiny_model_dir("qwen3-vl"))
    cfg = TrainConfig(lr=1e-3, bf16=True, freeze_vision_tower=False)
    first = MegatronActor(path, cfg, AlgoConfig(), info)
    samples = matrix_batch(tiny_model_dir("qwen3-vl"), "qwen3-vl")
    first.train(first.share_of(samples, ADVANTAGES, 2), on_policy=False)
    first.save(Path(args.out) / "ckpt_bf16", {})
    second = MegatronActor(path, cfg, AlgoConfig(), info)
    second.load(Path(args.out) / "ckpt_bf16")
    params = lambda a: dict(a.policy.named_parameters())  # noqa: E731
    main_equal = all(torch.equal(p.main_param, params(second)[n].main_param) for n, p in params(first).items())
    model_equal = all(torch.equal(p, params(second)[n]) for n, p in params(first).items())
    state_equal = True
    for inner_a, inner_b in zip(first.optimizer.chained_optimizers, second.optimizer.chained_optimizers):
        for n, p in params(first).items():
            a, b = inner_a.optimizer.state.get(p.main_param), inner_b.optimizer.state.get(params(second)[n].main_param)
            if a is not None:
                state_equal &= all(torch.equal(a[k], b[k]) for k in ("exp_avg", "exp_avg_sq", "step"))
    for actor in (first, second):
        actor.train(actor.share_of(samples, ADVANTAGES, 2), on_policy=False)
    continued_equal = all(torch.equal(p.main_param, params(second)[n].main_param) for n, p in params(first).items())
    out["checkpoint_bf16"] = {
        "main_params_equal": main_equal,
        "params_equal": model_equal,
        "optimizer_state_equal": state_equal,
        "continued_equal": continued_equal,
        "vision_trainable": any(p.requires_grad for p in first.policy.visual.parameters()),
    }


RESHARD_CFG = TrainConfig(lr=1e-3, micro_batch_size=2)


def reshard_step(actor, args, info, continued: str, kind: str = "qwen3") -> None:
    """One more optimizer step on a fixed batch after a resume; rank 0 keeps the exported weights in
    ``continued`` (a file under ``--out``)."""
    samples = matrix_batch(tiny_model_dir(kind), kind)
    actor.train(actor.share_of(samples, ADVANTAGES, 2), on_policy=False)
    weights = actor.export_hf()
    if is_main(info):
        torch.save(weights, Path(args.out) / continued)


def train_save_continue(args, info, kind: str, folder: str, extra: dict, continued: str) -> None:
    """Two steps on ``kind``, a checkpoint in ``folder/a`` with ``extra``, then one more step from there
    (its weights in ``continued``)."""
    actor = MegatronActor(str(tiny_model_dir(kind)), RESHARD_CFG, AlgoConfig(), info)
    samples = matrix_batch(tiny_model_dir(kind), kind)
    for _ in range(2):
        actor.train(actor.share_of(samples, ADVANTAGES, 2), on_policy=False)
    actor.save(Path(args.out) / folder / "a", extra)
    reshard_step(actor, args, info, continued, kind)


def check_reshard_save(args, info, out):
    """TP=1: two steps on Qwen3 (replicated q/k norms), save; then one more step from there."""
    train_save_continue(args, info, "qwen3", "reshard", {"layout": "tp1"}, f"reshard_continued_tp{info.tp_size}.pt")
    out["reshard_save"] = "saved"


def check_reshard_load(args, info, out):
    """Load the checkpoint saved at the other layout, save it again at this one (folder b at TP=2,
    c at TP=1), and (TP=2) take the same extra step."""
    root = Path(args.out) / "reshard"
    source, target = ("a", "b") if info.tp_size == 2 else ("b", "c")
    actor = MegatronActor(str(tiny_model_dir("qwen3")), RESHARD_CFG, AlgoConfig(), info)
    extra = actor.load(root / source)
    actor.save(root / target, extra)
    if info.tp_size == 2:
        reshard_step(actor, args, info, f"reshard_continued_tp{info.tp_size}.pt")
    out[f"reshard_load_tp{info.tp_size}"] = {"step": actor.step, "extra": extra}


def check_moe_reshard_save(args, info, out):
    """EP=2: two steps on Qwen3-MoE, save (folder a); then one more step from there."""
    tag = layout_tag(info)
    train_save_continue(args, info, "qwen3-moe", "reshard_moe", {"layout": tag}, f"reshard_moe_continued_{tag}.pt")
    out["moe_reshard_save"] = "saved"


def check_moe_reshard_load(args, info, out):
    """EP=1: load the checkpoint EP=2 saved, save it again (folder b), and take the same extra step."""
    root = Path(args.out) / "reshard_moe"
    actor = MegatronActor(str(tiny_model_dir("qwen3-moe")), RESHARD_CFG, AlgoConfig(), info)
    extra = actor.load(root / "a")
    actor.save(root / "b", extra)
    reshard_step(actor, args, info, f"reshard_moe_continued_{layout_tag(info)}.pt", "qwen3-moe")
    out["moe_reshard_load"] = {"step": actor.step, "extra": extra}


def check_ep_rows(args, info, out):
    """Qwen3-MoE, one optimizer step on ``dp_batch`` with a 48-token budget per micro-batch: at DP=2
    the ranks pack different numbers of rows (every MoE layer's exchange is collective, so the rank with
    fewer runs idle passes). -> rows per rank, loss, grad norm and the weights after the step (rank 0),
    for the same step at EP=1 on one rank to equal."""
    path = tiny_model_dir("qwen3-moe")
    actor = MegatronActor(str(path), TrainConfig(lr=1e-5, max_tokens_per_micro_batch=48), ALGO, info)
    samples = dp_batch()
    share = actor.share_of(samples, [1.0, -1.0] * 4, 4)
    rows = len(actor._rows(share.samples, share.of_mini_batch(0)))
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
                    sequence_parallel=SEQUENCE_PARALLEL,
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


def check_export_ranks(args, info, out):
    """Export gathers to global rank 0 only: the other ranks never hold a full tensor (an MoE model
    in an expert-parallel world, where every rank lends its experts)."""
    kind = "qwen3-moe" if info.ep_size > 1 else "qwen2"
    actor = MegatronActor(str(tiny_model_dir(kind)), TrainConfig(), AlgoConfig(), info)
    counts = {"full": 0, "none": 0}
    for _, tensor in actor.iter_hf_weights():
        counts["full" if tensor is not None else "none"] += 1
    everyone = [None] * info.world_size
    dist.all_gather_object(everyone, counts)
    out["export_ranks"] = everyone


def check_logprob_chunks(args, info, out):
    """Chunked log-probs and entropy (one autograd function per chunk, analytic backward) equal plain
    autograd through Megatron's output layer on the gathered logits, in values and in the gradients
    of the hidden rows and of the output weight; autograd never keeps a logits-sized tensor; a
    metric-only entropy has no graph and leaves the gradients as without it."""
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from slime_mt.backends.megatron.logprobs import hidden_logprobs

    actor = MegatronActor(str(tiny_model_dir("qwen2")), TrainConfig(), AlgoConfig(), info)
    weight, vocab = actor.policy.output_weight(), actor.spec.vocab_size
    g = torch.Generator().manual_seed(5)
    rows = 160  # chunks of 64, 64 and 32 rows
    hidden = torch.randn(rows, actor.spec.hidden_size, generator=g).requires_grad_(True)
    targets = torch.randint(0, vocab, (rows,), generator=g)
    scale = torch.rand(rows, generator=g)  # d loss / d log p per token

    def gradients(run):
        hidden.grad = None
        actor.model.zero_grad_buffer()  # the DDP hook moves the weight's gradient into main_grad
        lp, ent = run()
        loss = (lp * scale).sum() + (0.1 * ent.sum() if ent is not None and ent.requires_grad else 0.0)
        loss.backward()
        return (
            lp.detach().double(),
            None if ent is None else ent.detach().double(),
            hidden.grad.clone(),
            weight.main_grad.clone(),
        )

    def reference():
        logits = gather_from_tensor_model_parallel_region(actor.policy.output_logits(hidden))[:, :vocab] / 0.7
        log_p = torch.log_softmax(logits.double(), dim=-1)  # float64: the reference's own rounding is not measured
        return log_p.gather(-1, targets[:, None])[:, 0], -(log_p.exp() * log_p).sum(-1)

    saved = []

    def pack(t):
        if t.data_ptr() != weight.data_ptr():  # the parameter itself costs nothing
            saved.append(t.numel())
        return t

    want = gradients(reference)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        got = gradients(lambda: hidden_logprobs(hidden, weight, targets, vocab, 0.7, True, chunk=64))
    metric = gradients(lambda: hidden_logprobs(hidden, weight, targets, vocab, 0.7, True, chunk=64, entropy_grad=False))
    with_metric_ent = hidden_logprobs(hidden, weight, targets, vocab, 0.7, True, chunk=64, entropy_grad=False)[1]
    none = gradients(lambda: hidden_logprobs(hidden, weight, targets, vocab, 0.7, False, chunk=64))
    # a padded vocabulary (the last 1000 rows of the weight are padding; at TP=2 in rank 1's slice)
    vocab -= 1000
    targets.clamp_(max=vocab - 1)
    padded = (
        gradients(reference),
        gradients(lambda: hidden_logprobs(hidden, weight, targets, vocab, 0.7, True, chunk=64)),
    )
    local_vocab = weight.shape[0]
    out[f"logprob_chunks_tp{info.tp_size}"] = {
        **{
            f"{name}{suffix}": float((b[k] - a[k]).abs().max())
            for suffix, (a, b) in (("", (want, got)), ("_padded", padded))
            for k, name in enumerate(("logprob_diff", "entropy_diff", "hidden_grad_diff", "weight_grad_diff"))
        },
        "weight_grad_max": float(want[3].abs().max()),
        "largest_saved": max(saved),
        "chunk_logits": 64 * local_vocab,
        "all_logits": rows * local_vocab,
        "metric_entropy_diff": float((metric[1] - want[1]).abs().max()),
        "metric_entropy_requires_grad": bool(with_metric_ent.requires_grad),
        "metric_grad_diff": max(float((metric[k] - none[k]).abs().max()) for k in (2, 3)),
        "no_entropy_is_none": none[1] is None,
    }


def check_gpu(args, info, out):
    """On CUDA (world size 1, NCCL): every parameter on the GPU, the CPU patches not applied, logits
    vs transformers on the same GPU, one train step and a weight export, in fp32 and bf16."""
    from slime_mt.backends.megatron import cpu_patches
    from slime_mt.backends.megatron.parallel import current_device

    result = {
        "cpu_patches_applied": cpu_patches._APPLIED,
        "device": str(current_device()),
        "backend": dist.get_backend(),
    }
    for kind, path in (("smollm2", smollm2_dir()), *((k, tiny_model_dir(k)) for k in FAMILIES)):
        for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            actor = MegatronActor(
                str(path), TrainConfig(lr=1e-5, bf16=precision == "bf16"), ALGO, info, temperature=TEMPERATURE
            )
            model = hf_model(path, dtype, attn="sdpa").to(current_device())
            diffs = []
            for sample in sequences(path, kind):
                with torch.no_grad():
                    diffs.append(
                        float((megatron_logits(actor, sample).float() - hf_logits(model, sample).float()).abs().max())
                    )
            del model
            samples = matrix_batch(path, kind)
            metrics = actor.train(actor.share_of(samples, ADVANTAGES, 2), on_policy=False)
            exported = actor.export_hf()
            result[f"{kind}-{precision}"] = {
                "param_devices": sorted({str(p.device) for p in actor.policy.parameters()}),
                "param_dtypes": sorted(
                    {str(p.dtype) for n, p in actor.policy.named_parameters() if n.startswith("gpt.")}
                ),
                "logit_max_abs_diff": diffs,
                "loss": metrics["train/loss"],
                "grad_norm": metrics["train/grad_norm"],
                "exported": len(exported),
                "exported_devices": sorted({str(t.device) for t in exported.values()}),
            }
            del actor
            torch.cuda.empty_cache()
    out["gpu"] = result


def check_long_micro_batch(args, info, out):
    """On CUDA without Transformer Engine, bf16: one micro-batch of 16,384 tokens (two GRPO groups of 8
    responses of 512 tokens to a 512-token prompt) trains through the fused attention, as a flat
    packed row and as a prefix tree (flex_attention); Megatron's own attention is tried on the same
    micro-batch. Per variant: the row's tokens, loss, gradient norm, seconds and peak GPU memory."""
    import gc
    import time

    path = smollm2_dir()
    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(5)
    samples = []
    for group in range(2):
        prompt = torch.randint(100, vocab - 100, (512,), generator=g).tolist()
        for i in range(8):
            response = torch.randint(100, vocab - 100, (512,), generator=g).tolist()
            samples.append(
                TrainingSample(prompt, response, [1] * 512, [-10.0] * 512, float(i % 2), f"{group}/{i}", group, True)
            )
    advantages = [1.0 if i % 2 else -1.0 for i in range(len(samples))]
    variants = {
        "fused": TrainConfig(lr=1e-6, bf16=True, max_tokens_per_micro_batch=16384),
        "tree": TrainConfig(lr=1e-6, bf16=True, max_tokens_per_micro_batch=16384, shared_prefix_training=True),
        "megatron": TrainConfig(lr=1e-6, bf16=True, max_tokens_per_micro_batch=16384, local_attention="megatron"),
    }
    result = {}
    for name, train in variants.items():
        actor = None
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        try:
            actor = MegatronActor(str(path), train, ALGO, info, temperature=TEMPERATURE)
            rows = actor._rows(samples, list(range(len(samples))))
            row = actor.pack(samples, rows[0])
            started = time.perf_counter()
            metrics = actor.train(actor.share_of(samples, advantages, 2))
            torch.cuda.synchronize()
            result[name] = {
                "rows": len(rows),
                "row_tokens": row.num_real_tokens,
                "layout": type(row.attention_mask).__name__,
                "loss": metrics["train/loss"],
                "grad_norm": metrics["train/grad_norm"],
                "seconds": time.perf_counter() - started,
                "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
            }
        except torch.cuda.OutOfMemoryError as e:
            result[name] = {"oom": str(e).splitlines()[0], "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
        del actor
    out["long_micro_batch"] = result


def check_offload(args, info, out):
    """--offload: two train steps with the trainer's state offloaded and onloaded around the second
    (bf16 with fp32 main parameters, a KL reference model; the replicated and the distributed
    optimizer) against the same two steps without: the
    device holds none of it while offloaded, and the losses, grad norms and weights are identical."""
    result = {}
    for kind, sharded in (("qwen2", False), ("qwen2.5-vl", False), ("qwen2", True)):
        path = tiny_model_dir(kind)
        samples = matrix_batch(path, kind)
        algo = dataclasses.replace(ALGO, use_kl_loss=True, kl_loss_coef=0.01)
        train = TrainConfig(lr=1e-4, bf16=True, use_distributed_optimizer=sharded)
        runs = {}
        for offloaded in (False, True):
            torch.manual_seed(0)
            actor = MegatronActor(str(path), train, algo, info, temperature=TEMPERATURE)
            steps = [actor.train(actor.share_of(samples, ADVANTAGES, 2), on_policy=False)]
            held = actor.device_bytes()
            if offloaded:
                actor.offload()
                runs["while_offloaded"] = actor.device_bytes()
                actor.offload()  # twice: a no-op
                actor.onload()
                runs["after_onload"] = actor.device_bytes()
                runs["held"] = held
            steps.append(actor.train(actor.share_of(samples, ADVANTAGES, 2), on_policy=False))
            runs[offloaded] = {
                "losses": [m["train/loss"] for m in steps],
                "grad_norms": [m["train/grad_norm"] for m in steps],
                "weights": actor.export_hf(),
            }
            del actor
        same_weights = runs[False]["weights"].keys() == runs[True]["weights"].keys() and all(
            torch.equal(w, runs[True]["weights"][n]) for n, w in runs[False]["weights"].items()
        )
        result[kind + ("_distributed_optimizer" if sharded else "")] = {
            "held_bytes": runs["held"],
            "offloaded_bytes": runs["while_offloaded"],
            "onloaded_bytes": runs["after_onload"],
            "losses": [runs[False]["losses"], runs[True]["losses"]],
            "grad_norms": [runs[False]["grad_norms"], runs[True]["grad_norms"]],
            "same_weights": same_weights,
        }
    out["offload"] = result


CHECKS = {
    "offload": check_offload,
    "attention": check_attention,
    "long_micro_batch": check_long_micro_batch,
    "tree": check_tree,
    "families": check_families,
    "gpu": check_gpu,
    "logprob_chunks": check_logprob_chunks,
    "matrix": check_matrix,
    "aux_loss": check_aux_loss,
    "recompute": check_recompute,
    "hf_reference": check_hf_reference,
    "dp": check_dp,
    "bf16": check_bf16,
    "rope": check_rope,
    "sft": check_sft,
    "engine_fidelity": check_engine_fidelity,
    "checkpoint": check_checkpoint,
    "checkpoint_bf16": check_checkpoint_bf16,
    "reshard_save": check_reshard_save,
    "reshard_load": check_reshard_load,
    "distopt_reshard": check_distopt_reshard,
    "export_ranks": check_export_ranks,
    "moe_reshard_save": check_moe_reshard_save,
    "dispatchers": check_dispatchers,
    "ep_rows": check_ep_rows,
    "moe_reshard_load": check_moe_reshard_load,
}


def check_train_file(args, info, out):
    """One train step on samples a test saved (``--samples``: {"path", "samples", "advantages"}, and
    optionally "algo" (AlgoConfig fields over ALGO's) and "prompts_per_step" (default: all groups))."""
    saved = torch.load(args.samples, weights_only=False)
    samples = saved["samples"]
    algo = dataclasses.replace(ALGO, **saved.get("algo", {}))
    actor = MegatronActor(saved["path"], TrainConfig(lr=1e-4, micro_batch_size=2), algo, info)
    prompts_per_step = saved.get("prompts_per_step", len({s.group_id for s in samples}))
    metrics = actor.train(actor.share_of(samples, saved["advantages"], prompts_per_step))
    out["train_file"] = {
        "sequences": len(samples),
        "grad_norm": metrics["train/grad_norm"],
        "optimizer_steps": metrics["train/optimizer_steps"],
        "metrics": sorted(metrics),
        "finite": all(torch.isfinite(torch.tensor(v)) for v in metrics.values()),
    }


CHECKS["train_file"] = check_train_file


def _replayed(actor, sample) -> tuple[torch.Tensor, torch.Tensor]:
    """One sample's log-probs and the experts every MoE layer's router used ``[tokens, moe_layers, k]``."""
    from slime_mt.backends.megatron.moe import moe_layers

    layers = moe_layers(actor.policy)
    for layer in layers:
        layer.router.router_replay.chosen = []
    with torch.no_grad():
        lp, _ = actor._logprobs(actor.policy, actor.pack([sample], [0]), False, TEMPERATURE)
    chosen = torch.stack([torch.cat(layer.router.router_replay.chosen) for layer in layers], 1)
    for layer in layers:
        layer.router.router_replay.chosen = None
    return lp, chosen


def check_replay_file(args, info, out):
    """R3 on samples a test saved (``--samples``: {"path", "samples"} with the engine's routes): for
    each, the experts the trainer's routers used against the engine's rows, the routes where its own
    router differs, and the same with random routes (the replay takes them, and the log-probs move)."""
    import dataclasses as dc

    saved = torch.load(args.samples, weights_only=False)
    actor = MegatronActor(saved["path"], TrainConfig(use_rollout_routing_replay=True), ALGO, info, TEMPERATURE)
    g = torch.Generator().manual_seed(0)
    results = []
    for sample in saved["samples"]:
        routes = sample.routed_experts
        lp, chosen = _replayed(actor, sample)
        rows = len(routes)
        picked = chosen[:rows].sort(-1).values
        engine = routes.long().sort(-1).values
        e, k = actor.spec.moe.num_experts, actor.spec.moe.topk
        shuffled = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(rows * routes.shape[1])])
        shuffled = shuffled.reshape(routes.shape).to(routes.dtype)
        random_lp, random_chosen = _replayed(actor, dc.replace(sample, routed_experts=shuffled))
        _, own = _replayed(actor, dc.replace(sample, routed_experts=None))
        results.append(
            {
                "tokens": len(sample.tokens),
                "rows": rows,
                "rows_equal": int((picked == engine).all(-1).all(-1).sum()),
                "own_differs": int((own[:rows].sort(-1).values != engine).any(-1).sum()),
                "random_taken": bool(
                    torch.equal(random_chosen[:rows].sort(-1).values, shuffled.long().sort(-1).values)
                ),
                "random_logprob_shift": float((random_lp - lp).abs().max()),
            }
        )
    out["replay_file"] = results


CHECKS["replay_file"] = check_replay_file


def check_replay_gap(args, info, out):
    """bf16 on both sides, samples a bf16 engine generated with their routes (``--samples``): the
    train-vs-rollout log-prob gap on the generated tokens with the engine's routes replayed and with the
    trainer routing itself, and the (token, layer) routes where its router differs from the engine's."""
    import dataclasses as dc

    saved = torch.load(args.samples, weights_only=False)
    train = TrainConfig(bf16=True, use_rollout_routing_replay=True, log_routing_replay_gap=True)
    actor = MegatronActor(saved["path"], train, ALGO, info, saved.get("temperature", TEMPERATURE))
    gaps = {"replay": [], "own": []}
    differs = routes = 0
    for sample in saved["samples"]:
        rollout = torch.tensor(sample.rollout_log_probs)
        mask = torch.tensor(sample.loss_mask, dtype=torch.bool)
        replayed, _ = _replayed(actor, sample)
        own_lp, own = _replayed(actor, dc.replace(sample, routed_experts=None))
        gaps["replay"].append((replayed.float().cpu() - rollout)[mask].abs())
        gaps["own"].append((own_lp.float().cpu() - rollout)[mask].abs())
        rows = len(sample.routed_experts)
        engine = sample.routed_experts.long().sort(-1).values
        differs += int((own[:rows].sort(-1).values != engine).any(-1).sum())
        routes += engine.shape[0] * engine.shape[1]
    out["replay_gap"] = {
        **{f"{k}_max": float(torch.cat(v).max()) for k, v in gaps.items()},
        **{f"{k}_mean": float(torch.cat(v).mean()) for k, v in gaps.items()},
        "routes": routes,
        "own_router_differs": differs,
    }
    # a training step logs both gaps (token-mean weights: the mean gaps) and the routes that differ
    samples = saved["samples"]
    step = actor.train(actor.share_of(samples, [1.0, -1.0] * (len(samples) // 2), len(samples)))
    out["replay_gap"]["step"] = {k: v for k, v in step.items() if "rollout_logprob" in k or "routing_replay" in k}


CHECKS["replay_gap"] = check_replay_gap


# ---------------------------------------------------------------- pipeline parallelism

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
    kinds = [k for k in (*PIPELINE_KINDS, *UNTIED_KINDS) if k.split("-untied")[0] in SELECTED]
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


CHECKS["pipeline"] = check_pipeline


def check_pp_matrix(args, info, out):
    """The matrix run of the text families and Qwen2.5-VL (images through the vision tower on the first
    stage) through the actor at this world's pipeline size: log-probs
    (``compute_logprobs``), loss, gradients (HF layout, every stage's sent to rank 0), grad norm and
    the weights after a step, which must be the same TP's without PP (``matrix_tp1_KIND.pt``,
    ``matrix_tp2_sp_KIND.pt``); Qwen3-MoE once more replaying random routes (R3: each stage's MoE layers
    take their own columns of the routes)."""
    for kind, suffix, batch, actor in matrix_actors([k for k in PP_MATRIX_KINDS if k in SELECTED], info):
        if not suffix:  # each stage's parameters as built and as the memory plan counts them
            plan = rank_parameters(actor.spec, info.tp_size, actor.moe, stage=actor.stage).trained
            built = sum(p.numel() for p in actor.policy.parameters() if p.requires_grad)
            counts = [None] * info.world_size
            dist.all_gather_object(counts, (built, plan))
            out.setdefault("pp_parameters", {})[kind] = counts
        logprobs = [lp.tolist() for lp in actor.compute_logprobs(batch)]
        sums = actor.accumulate_gradients(actor.share_of(batch, ADVANTAGES, len(batch)))
        decoder = {n[len("gpt.") :]: p for n, p in actor.policy.named_parameters() if n.startswith("gpt.")}
        grads = dict(actor.iter_hf_weights(tensors={n: p.main_grad for n, p in decoder.items()}))
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


CHECKS["pp_matrix"] = check_pp_matrix


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


CHECKS["pp_refusals"] = check_pp_refusals


def check_pp_reshard(args, info, out):
    """Load the checkpoint TP=1 saved (reshard/a) into this world's pipeline stages, save it again
    (folder ``TAG``), and take TP=1's extra step."""
    root, tag = Path(args.out) / "reshard", layout_tag(info)
    train = dataclasses.replace(RESHARD_CFG, sequence_parallel=SEQUENCE_PARALLEL)
    actor = MegatronActor(str(tiny_model_dir("qwen3")), train, AlgoConfig(), info)
    extra = actor.load(root / "a")
    actor.save(root / tag, extra)
    reshard_step(actor, args, info, f"reshard_continued_{tag}.pt")
    out["pp_reshard"] = {"step": actor.step, "extra": extra}


CHECKS["pp_reshard"] = check_pp_reshard


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--etp", type=int, default=None)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--sp", action="store_true", help="sequence parallelism in the matrix and aux-loss checks")
    parser.add_argument("--families", choices=["all", "dense", "moe"], default="all")
    parser.add_argument("--checks", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--samples", help="train_file: a torch-saved dict of samples written by a test")
    parser.add_argument("--name", help="results_NAME.json (default: results_tpTP_worldWORLD.json)")
    args = parser.parse_args()
    global SELECTED, SEQUENCE_PARALLEL
    SELECTED = {"all": FAMILIES, "dense": DENSE_FAMILIES, "moe": MOE_FAMILIES}[args.families]
    SEQUENCE_PARALLEL = args.sp
    info = init_parallel(args.tp, seed=1234, ep_size=args.ep, etp_size=args.etp, cp_size=args.cp, pp_size=args.pp)
    out = {}
    for name in args.checks.split(","):
        CHECKS[name](args, info, out)
    if is_main(info):
        name = args.name or f"tp{args.tp}_world{info.world_size}"
        (Path(args.out) / f"results_{name}.json").write_text(json.dumps(out, indent=1))
    # gloo's threads torn down by interpreter exit can abort a rank ("terminate called without an active
    # exception") after the work is done; a destroyed process group exits cleanly
    destroy_parallel()


if __name__ == "__main__":
    main()
