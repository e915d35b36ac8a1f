"""LoRA adapters (``--lora-rank``): a model with fresh adapters computes what its base does, only the adapters
reach the optimizer and move, the weights the engines get have the adapters folded in (transformers on them
computes what the adapted Megatron model does), the adapters export in PEFT's format (peft on the base computes
the same), and every layout writes the step it took and its adapters for the tests to compare
(``lora_TAG_KIND.pt``, ``peft_TAG_KIND/``)."""

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
from slime_mt.backends.megatron import scoring
from slime_mt.backends.megatron.actor import MegatronActor
from slime_mt.backends.megatron.peft import save_adapter
from slime_mt.config import TrainConfig

LORA_KINDS = ("qwen3", "qwen2.5-vl")
LORA = dict(lora_rank=4, lora_alpha=8.0, target_modules="all-linear")


def _logprobs(actor, samples) -> torch.Tensor:
    row = scoring.pack(actor.policy, samples, list(range(len(samples))))
    with torch.no_grad():
        return scoring.row_outputs(actor.policy, row, scoring.LogProbs(TEMPERATURE))[0]


def _base_shards(actor) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in actor.policy.module.named_parameters() if ".lora." not in f".{n}"}


def _lora_kind(kind: str, info, out_dir: Path) -> dict:
    path = tiny_model_dir(kind)
    samples = matrix_batch(path, kind)
    train = TrainConfig(lr=1e-3, micro_batch_size=2, sequence_parallel=LAUNCH.sequence_parallel)
    algo = dataclasses.replace(ALGO, entropy_coef=0.0)
    base = MegatronActor(str(path), train, algo, info, temperature=TEMPERATURE)
    lora = MegatronActor(str(path), dataclasses.replace(train, **LORA), algo, info, temperature=TEMPERATURE)
    fresh_gap = float((_logprobs(base, samples) - _logprobs(lora, samples)).abs().max())
    trainable = [n for n, p in lora.policy.module.named_parameters() if p.requires_grad]
    optimized = sum(p.numel() for g in lora.policy.optimizer.param_groups for p in g["params"])
    before, base_weights = _base_shards(lora), base.export_hf()
    metrics = lora.train(lora.share_of(samples, ADVANTAGES, 2), on_policy=False)
    after = lora.export_hf()
    result = {
        "fresh_gap": fresh_gap,
        "trainable": len(trainable),
        "trainable_all_adapters": all(".lora.lora_" in n for n in trainable),
        "adapters": len(lora.policy.adapters),
        "optimized_numel": optimized,
        "adapter_numel": sum(p.numel() for n, p in lora.policy.module.named_parameters() if p.requires_grad),
        "base_unchanged": all(torch.equal(before[n], t) for n, t in _base_shards(lora).items()),
        "b_moved": all(bool(a.lora_B.detach().abs().sum() > 0) for a in lora.policy.adapters.values()),
        "loss": metrics["train/loss"],
        "grad_norm": metrics["train/grad_norm"],
    }
    if is_main(info):
        changed = sorted(n for n in after if not torch.equal(after[n], base_weights[n]))
        result["changed"] = changed
        torch.save(
            {"logprobs": _logprobs(lora, samples), "weights": after, **result},
            out_dir / f"lora_{layout_tag(info)}_{kind}.pt",
        )
    else:
        _logprobs(lora, samples)  # collective
    adapter_dir = out_dir / f"peft_{layout_tag(info)}_{kind}"
    save_adapter(lora.policy, adapter_dir)
    if info.world_size == 1:
        # peft on the base, with the adapters as exported, computes what the adapted Megatron model does
        from peft import PeftModel

        model = PeftModel.from_pretrained(hf_model(path), str(adapter_dir)).eval()
        with torch.no_grad():
            result["peft_gap"] = max(
                float((hf_logits(model, s) - megatron_logits(lora, s)).abs().max()) for s in samples
            )
    if kind == "qwen3" and info.world_size == 1:
        # transformers on the merged weights computes what the adapted Megatron model does
        model = hf_model(path)
        loaded = model.load_state_dict(after, strict=False)
        result["hf_unexpected"], result["hf_missing"] = list(loaded.unexpected_keys), list(loaded.missing_keys)
        with torch.no_grad():
            result["hf_gap"] = max(float((hf_logits(model, s) - megatron_logits(lora, s)).abs().max()) for s in samples)
    return result


def check_lora(args, info, out):
    """--lora-rank 4 on all-linear for a text model and a VLM: fresh adapters change no log-prob, the
    optimizer holds the adapters only, one step moves B and leaves the base bit for bit, the exported weights
    change in the adapted projections only, and (TP=1) transformers on them matches the Megatron model."""
    out_dir = Path(args.out)
    out["lora"] = {kind: _lora_kind(kind, info, out_dir) for kind in LORA_KINDS}
    if info.world_size > 1:
        dist.barrier()


CHECKS = {"lora": check_lora}
