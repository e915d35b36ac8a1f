"""A ``MegatronModel`` as built, per family: logits against transformers (fp32, bf16, every rope type), the
HF export equal to the checkpoint, this rank's parameters against the memory plan, and the same on CUDA."""

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from megatron_worlds import FAMILIES, REFUSED_ROPE, ROPE_CASES

from megatron_checks.common import (
    ADVANTAGES,
    ALGO,
    LAUNCH,
    TEMPERATURE,
    hf_logits,
    hf_model,
    matrix_batch,
    megatron_logits,
    sequences,
)
from slime_mt.assets import smollm2_dir, tiny_model_dir
from slime_mt.backends.megatron.actor import MegatronActor
from slime_mt.backends.megatron.memory_plan import rank_parameters, vision_parameters
from slime_mt.config import AlgoConfig, TrainConfig
from slime_mt.safetensors_files import CheckpointReader, load_hf_state
from slime_mt.types import TrainingSample


def check_families(args, info, out):
    """Megatron logits vs transformers (its SDPA attention: the same fp32 arithmetic as the fused core
    attention; eager; and an fp64 reference, against which transformers' own fp32 errors, eager and
    SDPA, are the bound), and Megatron -> HF export equal to the checkpoint."""
    dense = {"smollm2": smollm2_dir()} if "llama" in LAUNCH.families else {}
    paths = {**dense, **{k: tiny_model_dir(k) for k in LAUNCH.families}}
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


def half_width_experts(kind: str, root: Path) -> Path:
    """The tiny ``kind`` (an MoE family) with ``moe_intermediate_size`` half its hidden size (2I == H, as
    Qwen3-MoE-style configs often have), random weights saved by transformers' own ``save_pretrained``
    (Qwen3-VL-MoE: fused experts in its in-memory layout, gate_up's shape the same in both), the tiny
    model's tokenizer and processor beside them."""
    import transformers

    source, folder = tiny_model_dir(kind), root / f"{kind}-half-width-experts"
    config = json.loads((source / "config.json").read_text())
    text = config.get("text_config", config)
    text["moe_intermediate_size"] = text["hidden_size"] // 2
    vl = "text_config" in config
    cls = transformers.AutoModelForImageTextToText if vl else transformers.AutoModelForCausalLM
    torch.manual_seed(1)
    cls.from_config(transformers.AutoConfig.for_model(**config), dtype=torch.float32).save_pretrained(folder)
    for file in source.iterdir():  # the tokenizer and processor files
        if file.is_file() and not file.name.endswith(".safetensors") and file.name != "config.json":
            shutil.copy2(file, folder / file.name)
    return folder


def check_half_width_experts(args, info, out):
    """Issue 67 item 3: Qwen3-MoE and Qwen3-VL-MoE folders that transformers saved with 2I == H load (one
    fused-expert layout per layer, told by the tensor whose shape tells) and score as transformers does:
    Megatron's logits against transformers' SDPA on the family's sequences."""
    result = {}
    for kind in ("qwen3-moe", "qwen3-vl-moe"):
        path = half_width_experts(kind, Path(args.out))
        actor = MegatronActor(str(path), TrainConfig(lr=1e-5), AlgoConfig(), info)
        sdpa = hf_model(path, attn="sdpa")
        with torch.no_grad():
            diffs = [float((megatron_logits(actor, s) - hf_logits(sdpa, s)).abs().max()) for s in sequences(path, kind)]
        result[kind] = {
            "vs_sdpa": diffs,
            "intermediate": actor.spec.moe.ffn_hidden_size,
            "hidden": actor.spec.hidden_size,
        }
    out["half_width_experts"] = result


def planned_parameters(actor, path) -> dict:
    """This rank's parameter elements, trained and frozen, as built and as the memory plan counts them."""
    count = rank_parameters(
        actor.spec, actor.info.tp_size, actor.policy.moe, vision_parameters(CheckpointReader(path)), vision_frozen=True
    )
    params = list(actor.policy.module.parameters())
    return {
        "built": [
            sum(p.numel() for p in params if p.requires_grad),
            sum(p.numel() for p in params if not p.requires_grad),
        ],
        "plan": [count.trained, count.frozen],
    }


def check_bf16(args, info, out):
    """bf16 parameters and activations with fp32 main parameters and gradients; the fp32 vs bf16
    log-prob difference per family; three training steps stay finite and move the weights."""
    result = {}
    for kind in LAUNCH.families:
        path = tiny_model_dir(kind)
        samples = matrix_batch(path, kind)
        fp32 = MegatronActor(str(path), TrainConfig(lr=1e-4), ALGO, info, temperature=TEMPERATURE)
        ref = torch.cat(fp32.compute_logprobs(samples))
        del fp32
        actor = MegatronActor(str(path), TrainConfig(lr=1e-4, bf16=True), ALGO, info, temperature=TEMPERATURE)
        lp = torch.cat(actor.compute_logprobs(samples))
        decoder = [p for n, p in actor.policy.module.named_parameters() if n.startswith("gpt.")]
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
                "param_devices": sorted({str(p.device) for p in actor.policy.module.parameters()}),
                "param_dtypes": sorted(
                    {str(p.dtype) for n, p in actor.policy.module.named_parameters() if n.startswith("gpt.")}
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


CHECKS = {
    "families": check_families,
    "half_width_experts": check_half_width_experts,
    "bf16": check_bf16,
    "rope": check_rope,
    "gpu": check_gpu,
}
