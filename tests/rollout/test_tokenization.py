"""ObservationEncoder deltas with real tokenizers: exact expected token lists."""

import pytest

from slime_mt.processing import load_tokenizer_or_processor
from slime_mt.tokenization import ObservationEncoder

IM_START, IM_END, NL = 151644, 151645, 198
USER, ASSISTANT = 872, 77091
OBS = 5481  # "obs"
QWEN_USER_DELTA = [NL, IM_START, USER, NL, OBS, IM_END, NL, IM_START, ASSISTANT, NL]
QWEN_TOOL_DELTA_NO_EOT = [IM_END, NL, IM_START, USER, NL, 151665, NL, 19, 17, NL, 151666, IM_END, NL, IM_START,
                          ASSISTANT, NL]


@pytest.fixture(scope="module")
def tokenizers(tiny_paths, smollm2_path):
    from slime_mt.assets import qwen_tokenizer_dir

    return {
        "qwen2.5": load_tokenizer_or_processor(qwen_tokenizer_dir("qwen2.5")),
        "qwen3": load_tokenizer_or_processor(qwen_tokenizer_dir("qwen3")),
        "qwen2.5-vl": load_tokenizer_or_processor(tiny_paths["qwen2.5-vl"]),
        "smollm2": load_tokenizer_or_processor(smollm2_path),
    }


@pytest.mark.parametrize("name,message,ended,expected", [
    ("qwen2.5", {"role": "user", "content": "obs"}, True, QWEN_USER_DELTA),
    ("qwen3", {"role": "user", "content": "obs"}, True, QWEN_USER_DELTA),
    ("qwen2.5-vl", {"role": "user", "content": "obs"}, True, QWEN_USER_DELTA),
    ("qwen2.5", {"role": "tool", "content": "42"}, False, QWEN_TOOL_DELTA_NO_EOT),
    ("qwen3", {"role": "tool", "content": "42"}, False, QWEN_TOOL_DELTA_NO_EOT),
    # SmolLM2: <|im_start|>=1, <|im_end|>=2; its default system prompt is not repeated
    ("smollm2", {"role": "user", "content": "obs"}, True, [198, 1, 4093, 198, 7031, 2, 198, 1, 520, 9531, 198]),
    ("smollm2", {"role": "tool", "content": "42"}, False, [2, 198, 1, 19324, 198, 36, 34, 2, 198, 1, 520, 9531, 198]),
])
def test_observation_delta_exact_tokens(tokenizers, name, message, ended, expected):
    encoder = ObservationEncoder(tokenizers[name])
    assert encoder.encode_observation(message, model_ended_turn=ended).ids == expected


def test_tools_preamble_is_not_repeated(tokenizers):
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    encoder = ObservationEncoder(tokenizers["qwen2.5"], tools=tools)
    prompt = encoder.encode_prompt([{"role": "user", "content": "2+2?"}])
    assert "# Tools" in prompt.text
    delta = encoder.encode_observation({"role": "tool", "content": "42"})
    assert "# Tools" not in delta.text and "system" not in delta.text
    assert delta.ids == QWEN_TOOL_DELTA_NO_EOT[1:]  # ended turn: starts at the "\n" after <|im_end|>


def test_several_observation_messages(tokenizers):
    encoder = ObservationEncoder(tokenizers["qwen2.5"])
    delta = encoder.encode_observation([{"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}])
    assert delta.text == ("\n<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n"
                          "</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_qwen3_thinking_off_generation_prompt(tokenizers):
    encoder = ObservationEncoder(tokenizers["qwen3"], chat_template_kwargs={"enable_thinking": False})
    delta = encoder.encode_observation({"role": "user", "content": "obs"})
    assert delta.text == "\n<|im_start|>user\nobs<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_image_observation_expands_pads(tokenizers):
    from PIL import Image

    processor = tokenizers["qwen2.5-vl"]
    encoder = ObservationEncoder(processor)
    image = Image.new("RGB", (84, 56), (10, 20, 30))
    delta = encoder.encode_observation({"role": "user", "content": [{"type": "image", "image": image},
                                                                    {"type": "text", "text": "see"}]})
    grid = delta.tensors["image_grid_thw"]
    assert grid.tolist() == [[1, 4, 6]]
    assert delta.ids.count(processor.image_token_id) == 6  # 1*4*6 / 4
    assert delta.ids[:4] == [NL, IM_START, USER, NL]
    assert delta.tensors["pixel_values"].shape[0] == 24
