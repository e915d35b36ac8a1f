"""Offline model assets: SmolLM2 answers sensibly, tiny models load and run, VL pads expand right."""

import math

import pytest
import torch
from PIL import Image
from transformers import AutoModelForCausalLM, AutoTokenizer

from slime_mt.errors import ProcessorError
from slime_mt.processing import QwenVLProcessor, load_tokenizer_or_processor


def test_smollm2_answers_a_fixed_question_greedily(smollm2_path):
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_path))
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_path), dtype=torch.float32)
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_tiny_text_models_run_with_the_qwen_tokenizer(tiny_paths, kind):
    tokenizer = load_tokenizer_or_processor(tiny_paths[kind])
    model = AutoModelForCausalLM.from_pretrained(str(tiny_paths[kind]))
    ids = tokenizer("Hello world", return_tensors="pt")["input_ids"]
    assert ids.tolist() == [[9707, 1879]]
    logits = model(ids).logits
    assert logits.shape == (1, 2, 151936)
    assert torch.isfinite(logits).all()


def test_tiny_llama_has_smollm2_architecture_and_tokenizer(tiny_paths, smollm2_path):
    """The TP/dtype/rope matrices' Llama member: SmolLM2's tokenizer, GQA and tied embeddings, tiny."""
    from transformers import AutoConfig

    tokenizer, reference = load_tokenizer_or_processor(tiny_paths["llama"]), load_tokenizer_or_processor(smollm2_path)
    text = "Hello world, 12 x 7 = 84."
    assert tokenizer(text)["input_ids"] == reference(text)["input_ids"]
    config, smol = AutoConfig.from_pretrained(str(tiny_paths["llama"])), AutoConfig.from_pretrained(str(smollm2_path))
    assert config.model_type == smol.model_type == "llama" and config.vocab_size == smol.vocab_size
    assert config.tie_word_embeddings and config.num_key_value_heads < config.num_attention_heads
    logits = AutoModelForCausalLM.from_pretrained(str(tiny_paths["llama"]))(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, 49152) and torch.isfinite(logits).all()


def images():
    return [
        Image.new("RGB", (64, 48), (200, 10, 10)),
        Image.new("RGB", (120, 100), (10, 200, 10)),
        Image.new("RGB", (224, 224), (10, 10, 200)),
    ]


@pytest.mark.parametrize("kind,patch", [("qwen2.5-vl", 14), ("qwen3-vl", 16)])
def test_vl_processor_expands_pads_per_image(tiny_paths, kind, patch):
    processor = load_tokenizer_or_processor(tiny_paths[kind])
    assert isinstance(processor, QwenVLProcessor)
    assert processor.image_processor.patch_size == patch
    text = processor.apply_chat_template(
        [
            {
                "role": "user",
                "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}, {"type": "image"}],
            }
        ],
        add_generation_prompt=True,
    )
    out = processor(text=text, images=images())
    grid = out["image_grid_thw"]
    assert grid.shape == (3, 3)
    ids = out["input_ids"][0].tolist()
    # pads per image = prod(t, h, w) / 4, contiguous runs between vision_start/vision_end
    runs, current = [], 0
    for token in ids:
        if token == processor.image_token_id:
            current += 1
        elif current:
            runs.append(current)
            current = 0
    assert runs == [math.prod(row) // 4 for row in grid.tolist()]
    assert out["pixel_values"].shape[0] == int(grid.prod(dim=-1).sum())


def test_vl_processor_rejects_mismatched_images(tiny_paths):
    processor = load_tokenizer_or_processor(tiny_paths["qwen2.5-vl"])
    with pytest.raises(ProcessorError, match="1 <|image_pad|> placeholders but 2 images"):
        processor(text="<|image_pad|>", images=images()[:2])


@pytest.mark.parametrize("kind", ["qwen2.5-vl", "qwen3-vl"])
def test_tiny_vlms_forward_on_images(tiny_paths, kind):
    from transformers import AutoModelForImageTextToText

    processor = load_tokenizer_or_processor(tiny_paths[kind])
    model = AutoModelForImageTextToText.from_pretrained(str(tiny_paths[kind]))
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x?"}]}], add_generation_prompt=True
    )
    inputs = processor(text=text, images=images()[:1])
    logits = model(**inputs).logits
    assert logits.shape[:2] == inputs["input_ids"].shape
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen2.5-vl"])
def test_tokenizer_folders_list_their_added_tokens_as_the_hub_ones_do(tiny_paths, kind, tmp_path):
    """Every asset's ``tokenizer_config.json`` lists ``tokenizer.json``'s added tokens (so a load does
    not parse the 18 MB file twice), and a copy without the list loads the same tokenizer."""
    import json
    import shutil

    folder = tiny_paths[kind]
    listed = json.loads((folder / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    added = json.loads((folder / "tokenizer.json").read_text())["added_tokens"]
    assert {int(i): t["content"] for i, t in listed.items()} == {t["id"]: t["content"] for t in added}
    bare = tmp_path / "bare"
    shutil.copytree(folder, bare)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    del config["added_tokens_decoder"]
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    ours, theirs = (AutoTokenizer.from_pretrained(str(p)) for p in (folder, bare))
    text = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>x = 2 <tool_call>{}</tool_call><|im_end|>\n"
    assert ours(text).input_ids == theirs(text).input_ids
    assert ours.added_tokens_decoder == theirs.added_tokens_decoder
    assert (ours.all_special_ids, ours.eos_token_id, ours.pad_token_id) == (
        theirs.all_special_ids,
        theirs.eos_token_id,
        theirs.pad_token_id,
    )
