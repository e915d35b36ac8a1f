"""LoRA adapters (``--lora-rank``): a model with fresh adapters computes what its base does, only the adapters
reach the optimizer and move, the weights the engines get have the adapters folded in (transformers on them
computes what the adapted Megatron model does), the adapters export in PEFT's format (peft on the base computes
the same), and every layout writes the step it took and its adapters for the tests to compare
(``lora_TAG_KIND.pt``, ``peft_TAG_KIND/``). Checkpoints: TP=1 saves after its step (``lora_ckpt_KIND/``, a
PEFT folder peft loads), takes a second step, and resumes the checkpoint in a new actor for the same second
step (bitwise), and ``--lora-adapter-path`` starts from it; ``lora_resume`` at TP=2 with SP and at PP=2 resumes
TP=1's checkpoint for the same second step (the tests compare the adapters). A MoE model (adapters on its
attention) runs at TP=1 and EP=2."""

import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_checks.common import (
    ADVANTAGES,
    ALGO,
    LAUNCH,
    TEMPERATURE,
    hf_logits,
    hf_model,
    is_main,
    layout_tag,
    matrix_batch,
    megatron_logits,
)
from slime_mt.assets import tiny_model_dir
from slime_mt.backends.megatron.actor import MegatronActor
from slime_mt.backends.megatron.peft import iter_adapter_tensors, save_adapter
from slime_mt.config import TrainConfig

LORA_KINDS = ("qwen3", "qwen2.5-vl")
LORA = dict(lora_rank=4, lora_alpha=8.0, target_modules="all-linear")
# a MoE model's adapters sit on its attention (its MLPs are experts, which take none yet): run at TP=1 (one
# process) and at EP=2
MOE_KIND = "qwen3-moe"
FLAGS = {**dict.fromkeys(LORA_KINDS, LORA), MOE_KIND: {**LORA, "target_modules": "q_proj,k_proj,v_proj,o_proj"}}


def _logprobs(actor, samples) -> torch.Tensor:
    """Every response token's log-prob, samples in order (the actor's own scoring: any layout)."""
    return torch.cat(actor.compute_logprobs(samples))


def _base_shards(actor) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in actor.policy.module.named_parameters() if ".lora." not in f".{n}"}


def _actor(kind: str, info, **lora) -> MegatronActor:
    """An actor of the tiny ``kind`` model (``lora``: LoRA's flags, none for full training; a LoRA actor
    with a KL term, whose reference is its own base)."""
    train = TrainConfig(lr=1e-3, micro_batch_size=2, sequence_parallel=LAUNCH.sequence_parallel, **lora)
    algo = dataclasses.replace(ALGO, entropy_coef=0.0, use_kl_loss=bool(lora), kl_loss_coef=0.01 if lora else 0.0)
    return MegatronActor(str(tiny_model_dir(kind)), train, algo, info, temperature=TEMPERATURE)


def _step(actor, samples) -> dict:
    return actor.train(actor.share_of(samples, ADVANTAGES, 2), on_policy=False)


def _step_with_grads(actor, samples) -> tuple[dict, dict[str, torch.Tensor]]:
    """One step, and the adapters' gradients (PEFT-named, whole, global rank 0) before Adam takes them."""
    share = actor.share_of(samples, ADVANTAGES, 2)
    reference = actor.compute_logprobs(share.samples, reference=True) if actor.algo.kl_term else None
    metrics = actor.accumulate_gradients(share, ref=reference)
    grads = {n: t.clone() for n, t in iter_adapter_tensors(actor.policy, pick=_grad) if t is not None}
    metrics.update(actor.apply_gradients())
    return metrics, grads


def _grad(param) -> torch.Tensor:
    return param.main_grad if getattr(param, "main_grad", None) is not None else param.grad


def _adapters(actor) -> dict[str, torch.Tensor]:
    """The whole adapters, PEFT-named (global rank 0; empty elsewhere)."""
    return {n: t.clone() for n, t in iter_adapter_tensors(actor.policy) if t is not None}


def _resumed(kind: str, info, out_dir: Path, samples, result: dict) -> dict[str, torch.Tensor]:
    """TP=1's LoRA checkpoint (``lora_ckpt_KIND``) resumed in a new actor for the second step -> its
    adapters after it; writes them and the log-probs on resuming (``lora_resumed_TAG_KIND.pt``)."""
    resumed = _actor(kind, info, **LORA)
    result["resumed_extra"] = resumed.load(out_dir / f"lora_ckpt_{kind}")
    result["resumed_step"] = resumed.policy.step
    logprobs = _logprobs(resumed, samples)
    _step(resumed, samples)
    adapters = _adapters(resumed)
    if is_main(info):
        torch.save({"logprobs": logprobs, "adapters": adapters}, out_dir / f"lora_resumed_{layout_tag(info)}_{kind}.pt")
    return adapters


def _resume_at_one(kind: str, info, out_dir: Path, lora, samples, result: dict) -> None:
    """TP=1, the checkpoint of the first step saved: --lora-adapter-path from it (the same log-probs, step 0),
    and the second step straight and resumed from it (bitwise)."""
    after_one = _logprobs(lora, samples)
    warm = _actor(kind, info, **LORA, lora_adapter_path=str(out_dir / f"lora_ckpt_{kind}" / "iter_0000001"))
    result["warm_gap"] = float((_logprobs(warm, samples) - after_one).abs().max())
    result["warm_step"] = warm.policy.step
    del warm
    _step(lora, samples)
    straight = _adapters(lora)
    again = _resumed(kind, info, out_dir, samples, result)
    result["resume_bitwise"] = straight.keys() == again.keys() and all(
        torch.equal(t, again[n]) for n, t in straight.items()
    )


def _lora_kind(kind: str, info, out_dir: Path) -> dict:
    path = tiny_model_dir(kind)
    samples = matrix_batch(path, kind)
    base, lora = _actor(kind, info), _actor(kind, info, **FLAGS[kind])
    base_logprobs = _logprobs(base, samples)
    fresh_gap = float((base_logprobs - _logprobs(lora, samples)).abs().max())
    trainable = [n for n, p in lora.policy.module.named_parameters() if p.requires_grad]
    optimized = sum(p.numel() for g in lora.policy.optimizer.param_groups for p in g["params"])
    before, base_weights = _base_shards(lora), base.export_hf()
    metrics, grads = _step_with_grads(lora, samples)
    after = lora.export_hf()
    # the KL reference after the step: the base's log-probs exactly, from the policy with its adapters off
    reference = torch.cat(lora.compute_logprobs(samples, reference=True))
    stage = lora.policy.stage.layers
    result = {
        "stage_layers": [stage.start, stage.stop],  # global rank 0's pipeline stage
        "fresh_gap": fresh_gap,
        "reference_copy": lora.reference is not None,
        "reference_gap": float((reference - base_logprobs).abs().max()),
        "policy_moved": float((_logprobs(lora, samples) - base_logprobs).abs().max()),
        "trainable": len(trainable),
        "trainable_all_adapters": all(".lora.lora_" in n for n in trainable),
        "adapters": len(lora.policy.adapters),
        "optimized_numel": optimized,
        "adapter_numel": sum(p.numel() for n, p in lora.policy.module.named_parameters() if p.requires_grad),
        "base_unchanged": all(torch.equal(before[n], t) for n, t in _base_shards(lora).items()),
        "b_moved": all(bool(a.lora_B.detach().abs().sum() > 0) for a in lora.policy.adapters.values()),
        "loss": metrics["loss"],
        "grad_norm": metrics["train/grad_norm"],
    }
    if is_main(info):
        changed = sorted(n for n in after if not torch.equal(after[n], base_weights[n]))
        result["changed"] = changed
        logprobs, adapters = _logprobs(lora, samples), _adapters(lora)
        torch.save(
            {"logprobs": logprobs, "weights": after, **result, "grads": grads, "adapter_tensors": adapters},
            out_dir / f"lora_{layout_tag(info)}_{kind}.pt",
        )
    else:
        _logprobs(lora, samples), _adapters(lora)  # collective
    adapter_dir = out_dir / f"peft_{layout_tag(info)}_{kind}"
    save_adapter(lora.policy, adapter_dir)
    if info.world_size == 1:
        # peft on the base, with the adapters as exported and as checkpointed, computes what the adapted
        # Megatron model does
        from peft import PeftModel

        lora.save(out_dir / f"lora_ckpt_{kind}", {"data_cursor": 1})  # what TP=1 and TP=2 resume
        for key, folder in (
            ("peft_gap", adapter_dir),
            ("ckpt_peft_gap", out_dir / f"lora_ckpt_{kind}" / "iter_0000001"),
        ):
            model = PeftModel.from_pretrained(hf_model(path), str(folder)).eval()
            with torch.no_grad():
                result[key] = max(float((hf_logits(model, s) - megatron_logits(lora, s)).abs().max()) for s in samples)
    if kind == "qwen3" and info.world_size == 1:
        # transformers on the merged weights computes what the adapted Megatron model does
        model = hf_model(path)
        loaded = model.load_state_dict(after, strict=False)
        result["hf_unexpected"], result["hf_missing"] = list(loaded.unexpected_keys), list(loaded.missing_keys)
        with torch.no_grad():
            result["hf_gap"] = max(float((hf_logits(model, s) - megatron_logits(lora, s)).abs().max()) for s in samples)
    if info.world_size == 1 and kind in LORA_KINDS:
        _resume_at_one(kind, info, out_dir, lora, samples, result)
    return result


def check_lora(args, info, out):
    """--lora-rank 4 on all-linear for a text model and a VLM (on the attention of a MoE model at TP=1 and in
    an expert-parallel world, which runs that one only): fresh adapters change no log-prob, the
    optimizer holds the adapters only, one step moves B and leaves the base bit for bit, the exported weights
    change in the adapted projections only, and (TP=1) transformers on them matches the Megatron model."""
    out_dir = Path(args.out)
    kinds = (MOE_KIND,) if info.ep_size > 1 else (*LORA_KINDS, MOE_KIND) if info.world_size == 1 else LORA_KINDS
    out["lora"] = {kind: _lora_kind(kind, info, out_dir) for kind in kinds}
    if info.world_size > 1:
        dist.barrier()


def check_lora_resume(args, info, out):
    """TP=1's LoRA checkpoints (the ``lora`` check's, a text model and a VLM) resumed at this layout for the
    second step TP=1 took (the tests compare the adapters after it)."""
    out_dir = Path(args.out)
    out["lora_resume"] = {}
    for kind in LORA_KINDS:
        out["lora_resume"][kind] = result = {}
        _resumed(kind, info, out_dir, matrix_batch(tiny_model_dir(kind), kind), result)
    if info.world_size > 1:
        dist.barrier()


CHECKS = {"lora": check_lora, "lora_resume": check_lora_resume}
