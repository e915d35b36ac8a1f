"""A model's state: checkpoints (bitwise resume, a save killed midway, bf16 main parameters), resharding
across TP, DP, EP and PP layouts, the distributed optimizer's checkpoint, and offload's round trip."""

import dataclasses
from pathlib import Path

import torch

from megatron_checks.common import (
    ADVANTAGES,
    ALGO,
    LAUNCH,
    TEMPERATURE,
    is_main,
    layout_tag,
    matrix_batch,
)
from slime_mt.assets import tiny_model_dir
from slime_mt.backends.megatron.actor import MegatronActor
from slime_mt.config import AlgoConfig, TrainConfig
from slime_mt.safetensors_files import load_hf_state


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
    reference = {k: v.clone() for k, v in straight.policy.module.state_dict().items() if isinstance(v, torch.Tensor)}
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
    state = {k: v for k, v in resumed.policy.module.state_dict().items() if isinstance(v, torch.Tensor)}
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
    params = lambda a: dict(a.policy.module.named_parameters())  # noqa: E731
    main_equal = all(torch.equal(p.main_param, params(second)[n].main_param) for n, p in params(first).items())
    model_equal = all(torch.equal(p, params(second)[n]) for n, p in params(first).items())
    state_equal = True
    for inner_a, inner_b in zip(first.policy.optimizer.chained_optimizers, second.policy.optimizer.chained_optimizers):
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
        "vision_trainable": any(p.requires_grad for p in first.policy.module.visual.parameters()),
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


def check_offload(args, info, out):
    """--offload: two train steps with the trainer's state offloaded and onloaded around the second
    (bf16 with fp32 main parameters, a KL reference model; the replicated and the distributed
    optimizer; LoRA adapters on a frozen base) against the same two steps without: the
    device holds none of it while offloaded, and the losses, grad norms and weights are identical."""
    result = {}
    lora = dict(lora_rank=4, lora_alpha=8.0, target_modules="all-linear")
    for kind, sharded, flags in (
        ("qwen2", False, {}),
        ("qwen2.5-vl", False, {}),
        ("qwen2", True, {}),
        ("qwen2", True, lora),
    ):
        path = tiny_model_dir(kind)
        samples = matrix_batch(path, kind)
        algo = dataclasses.replace(ALGO, use_kl_loss=True, kl_loss_coef=0.01)
        train = TrainConfig(lr=1e-4, bf16=True, use_distributed_optimizer=sharded, **flags)
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
        result[kind + ("_distributed_optimizer" if sharded else "") + ("_lora" if flags else "")] = {
            "held_bytes": runs["held"],
            "offloaded_bytes": runs["while_offloaded"],
            "onloaded_bytes": runs["after_onload"],
            "losses": [runs[False]["losses"], runs[True]["losses"]],
            "grad_norms": [runs[False]["grad_norms"], runs[True]["grad_norms"]],
            "same_weights": same_weights,
        }
    out["offload"] = result


def check_pp_reshard(args, info, out):
    """Load the checkpoint TP=1 saved (reshard/a) into this world's pipeline stages, save it again
    (folder ``TAG``), and take TP=1's extra step."""
    root, tag = Path(args.out) / "reshard", layout_tag(info)
    train = dataclasses.replace(RESHARD_CFG, sequence_parallel=LAUNCH.sequence_parallel)
    actor = MegatronActor(str(tiny_model_dir("qwen3")), train, AlgoConfig(), info)
    extra = actor.load(root / "a")
    actor.save(root / tag, extra)
    reshard_step(actor, args, info, f"reshard_continued_{tag}.pt")
    out["pp_reshard"] = {"step": actor.step, "extra": extra}


CHECKS = {
    "checkpoint": check_checkpoint,
    "checkpoint_bf16": check_checkpoint_bf16,
    "reshard_save": check_reshard_save,
    "reshard_load": check_reshard_load,
    "moe_reshard_save": check_moe_reshard_save,
    "moe_reshard_load": check_moe_reshard_load,
    "distopt_reshard": check_distopt_reshard,
    "offload": check_offload,
    "pp_reshard": check_pp_reshard,
}
