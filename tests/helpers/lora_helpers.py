"""LoRA adapters for the tests, made by peft itself on the tiny models (``peft_adapter``), and the log-probs
peft computes with one (``peft_logprobs``): the reference the trainer's and the engines' adapters are held to."""

import torch

from slime_mt.assets import tiny_model_dir

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peft_adapter(kind: str, folder, shared_a: bool = True, seed: int = 0, rank: int = 4, alpha: float = 8):
    """peft's own adapter of the tiny ``kind`` model on every projection (B drawn at random as A is, from
    ``seed``), saved to ``folder`` -> the peft model (eval mode); ``shared_a``: q, k and v (gate and up)
    given one A, as the trainer's fused layers have."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    vlm = kind.endswith("-vl")
    model = (AutoModelForImageTextToText if vlm else AutoModelForCausalLM).from_pretrained(tiny_model_dir(kind))
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=PROJECTIONS,
        init_lora_weights=False,
        exclude_modules=r"(?!model\.language_model\.).*" if vlm else None,
    )
    torch.manual_seed(seed)
    model = get_peft_model(model, config)
    if shared_a:
        decoder = model.base_model.model.model
        with torch.no_grad():
            for layer in decoder.language_model.layers if vlm else decoder.layers:
                for module, fused in (
                    (layer.self_attn, ("q_proj", "k_proj", "v_proj")),
                    (layer.mlp, ("gate_proj", "up_proj")),
                ):
                    first = getattr(module, fused[0]).lora_A["default"].weight
                    for name in fused[1:]:
                        getattr(module, name).lora_A["default"].weight.copy_(first)
    model.save_pretrained(folder)
    return model.eval()


def peft_logprobs(model, ids: list[int], start: int) -> list[float]:
    """log p(ids[i] | ids[:i]) for i in [start, len(ids)) under ``model`` (temperature 1, fp32)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, -1)
    return [float(logprobs[i - 1, ids[i]]) for i in range(start, len(ids))]
