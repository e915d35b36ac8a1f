"""What the Megatron checks share: the batches (the matrix batch, the DP batch, a chat with images, random
routes), transformers' side of a comparison, one fresh actor's step outputs and their differences over the
ranks, and the launch's settings (``LAUNCH``: the families it runs, sequence parallelism)."""

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from megatron_worlds import FAMILIES

from slime_mt.backends.megatron import scoring
from slime_mt.backends.megatron.actor import MegatronActor
from slime_mt.config import AlgoConfig, TrainConfig
from slime_mt.types import TrainingSample


@dataclass
class Launch:
    """What this launch's checks run: the families (``--families``) and whether the matrix and
    load-balancing checks train with ``--sequence-parallel`` (``--sp``)."""

    families: tuple[str, ...] = FAMILIES
    sequence_parallel: bool = False


LAUNCH = Launch()


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
    row = scoring.pack(actor.policy, [sample], [0])
    extra = {"pixel_values": row.pixel_values, "image_grid_thw": row.image_grid_thw} if actor.policy.mrope else {}
    with torch.no_grad():
        return actor.policy.module(row.tokens, row.position_ids, row.attention_mask, **extra)[0][
            :, : actor.spec.vocab_size
        ]


def is_main(info) -> bool:
    return info.rank == 0


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


def layout_tag(info) -> str:
    """``tp2``, or ``tp2_ep2`` in an expert-parallel world (``tp2_ep2_etp1`` when experts are not split
    like the TP), ``_pp2`` added under pipeline parallelism, ``_cp2`` under context parallelism, ``_sp``
    under sequence parallelism."""
    tag = f"tp{info.tp_size}" + (f"_ep{info.ep_size}" if info.ep_size > 1 else "")
    tag += f"_etp{info.etp_size}" if info.etp_size != info.tp_size else ""
    tag += f"_pp{info.pp_size}" if info.pp_size > 1 else ""
    return tag + (f"_cp{info.cp_size}" if info.cp_size > 1 else "") + ("_sp" if LAUNCH.sequence_parallel else "")


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


def step_outputs(path, train: TrainConfig, samples, advantages, info) -> dict:
    """One packed forward (log-probs, entropies, the row's attention layout) and one gradient
    accumulation (loss, this rank's gradient shards) of a fresh actor on ``samples`` in one row."""
    from slime_mt.backends.megatron.layouts import Segments

    everything = list(range(len(samples)))
    actor = MegatronActor(str(path), train, ALGO, info, temperature=TEMPERATURE)
    row = scoring.pack(actor.policy, samples, everything)
    with torch.no_grad():
        lp, ent = scoring.row_outputs(actor.policy, row, scoring.LogProbs(TEMPERATURE, entropy=True))
    sums = actor.accumulate_gradients(actor.share_of(samples, advantages, len(samples)))
    grads = {n: p.main_grad.detach().clone() for n, p in actor.policy.module.named_parameters() if p.requires_grad}
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
