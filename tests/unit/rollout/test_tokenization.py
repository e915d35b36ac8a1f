"""ObservationEncoder deltas with real tokenizers: exact expected token lists."""

import pytest

from slime_mt.errors import EncodingError
from slime_mt.processing import load_tokenizer_or_processor
from slime_mt.tokenization import ObservationEncoder, mask_runs

IM_START, IM_END, NL = 151644, 151645, 198
USER, ASSISTANT = 872, 77091
OBS = 5481  # "obs"
QWEN_USER_DELTA = [NL, IM_START, USER, NL, OBS, IM_END, NL, IM_START, ASSISTANT, NL]
QWEN_TOOL_DELTA_NO_EOT = [
    IM_END,
    NL,
    IM_START,
    USER,
    NL,
    151665,
    NL,
    19,
    17,
    NL,
    151666,
    IM_END,
    NL,
    IM_START,
    ASSISTANT,
    NL,
]


@pytest.fixture(scope="module")
def tokenizers(tiny_paths, smollm2_path):
    from slime_mt.assets import qwen_tokenizer_dir

    return {
        "qwen2.5": load_tokenizer_or_processor(qwen_tokenizer_dir("qwen2.5")),
        "qwen3": load_tokenizer_or_processor(qwen_tokenizer_dir("qwen3")),
        "qwen2.5-vl": load_tokenizer_or_processor(tiny_paths["qwen2.5-vl"]),
        "smollm2": load_tokenizer_or_processor(smollm2_path),
    }


@pytest.mark.parametrize(
    "name,message,ended,expected",
    [
        ("qwen2.5", {"role": "user", "content": "obs"}, True, QWEN_USER_DELTA),
        ("qwen3", {"role": "user", "content": "obs"}, True, QWEN_USER_DELTA),
        ("qwen2.5-vl", {"role": "user", "content": "obs"}, True, QWEN_USER_DELTA),
        ("qwen2.5", {"role": "tool", "content": "42"}, False, QWEN_TOOL_DELTA_NO_EOT),
        ("qwen3", {"role": "tool", "content": "42"}, False, QWEN_TOOL_DELTA_NO_EOT),
        # SmolLM2: <|im_start|>=1, <|im_end|>=2; its default system prompt is not repeated
        ("smollm2", {"role": "user", "content": "obs"}, True, [198, 1, 4093, 198, 7031, 2, 198, 1, 520, 9531, 198]),
        (
            "smollm2",
            {"role": "tool", "content": "42"},
            False,
            [2, 198, 1, 19324, 198, 36, 34, 2, 198, 1, 520, 9531, 198],
        ),
    ],
)
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
    assert delta.text == (
        "\n<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_qwen3_thinking_off_generation_prompt(tokenizers):
    encoder = ObservationEncoder(tokenizers["qwen3"], chat_template_kwargs={"enable_thinking": False})
    delta = encoder.encode_observation({"role": "user", "content": "obs"})
    assert delta.text == "\n<|im_start|>user\nobs<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_image_observation_expands_pads(tokenizers):
    from PIL import Image

    processor = tokenizers["qwen2.5-vl"]
    encoder = ObservationEncoder(processor)
    image = Image.new("RGB", (84, 56), (10, 20, 30))
    delta = encoder.encode_observation(
        {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "see"}]}
    )
    grid = delta.tensors["image_grid_thw"]
    assert grid.tolist() == [[1, 4, 6]]
    assert delta.ids.count(processor.image_token_id) == 6  # 1*4*6 / 4
    assert delta.ids[:4] == [NL, IM_START, USER, NL]
    assert delta.tensors["pixel_values"].shape[0] == 24


# ---------------------------------------------------------------- --no-conversation-multi-turn

OBSERVATION = "\n<observation>{observation}</observation>\n"


@pytest.mark.parametrize("name", ["qwen2.5", "qwen3", "smollm2"])
def test_raw_observations_are_the_wrapped_text_tokenized_as_is(tokenizers, name):
    tokenizer = tokenizers[name]
    encoder = ObservationEncoder(tokenizer)
    one = encoder.encode_raw_observation({"role": "tool", "content": "391"}, OBSERVATION)
    assert one.text == "\n<observation>391</observation>\n"
    assert one.ids == tokenizer.encode(one.text, add_special_tokens=False)
    two = encoder.encode_raw_observation(
        [{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "text", "text": "b"}]}],
        "[{observation}]",
    )
    assert two.text == "[a\nb]" and two.ids == tokenizer.encode("[a\nb]", add_special_tokens=False)


def test_a_raw_image_observation_renders_as_the_template_does(tokenizers):
    from PIL import Image

    processor = tokenizers["qwen2.5-vl"]
    encoder = ObservationEncoder(processor)
    image = Image.new("RGB", (84, 56), (10, 20, 30))
    out = encoder.encode_raw_observation(
        {"role": "user", "content": [{"type": "text", "text": "see "}, {"type": "image", "image": image}]}, OBSERVATION
    )
    assert out.text == "\n<observation>see <|vision_start|><|image_pad|><|vision_end|></observation>\n"
    assert out.ids.count(processor.image_token_id) == 6 and out.tensors["image_grid_thw"].tolist() == [[1, 4, 6]]
    with pytest.raises(EncodingError, match="no image processor"):
        ObservationEncoder(tokenizers["qwen2.5"]).encode_raw_observation(
            {"role": "user", "content": [{"type": "image", "image": image}]}, OBSERVATION
        )


# ---------------------------------------------------------------- --retokenize-chat-history masks

# A ChatML template with {% generation %} blocks around each assistant body (through <|im_end|>),
# and a variant that, like Qwen3's, drops the reasoning of assistant turns before the last one.
TAGGED = """{%- for message in messages -%}
{{- '<|im_start|>' + message.role + '\\n' -}}
{%- if message.role == 'assistant' -%}
{%- set content = message.content -%}
{%- if STRIP and not loop.last and '</think>' in content -%}{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}
{%- generation -%}{{- content + '<|im_end|>' -}}{%- endgeneration -%}
{%- else -%}{{- message.content + '<|im_end|>' -}}{%- endif -%}
{{- '\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"""

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "tool", "content": "ok"},
        {"role": "assistant", "content": "\n\nleading newlines"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": ""},
    ],
    [
        {"role": "user", "content": "Think."},
        {"role": "assistant", "content": "<think>hmm</think>\n\nA"},
        {"role": "user", "content": "More."},
        {"role": "assistant", "content": "<think>so</think>\n\nB"},
    ],
]


@pytest.mark.parametrize("strip", [False, True])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_generation_tag_masks_equal_offset_masks(qwen_tokenizer, conversation, strip):
    import copy

    tagged = copy.copy(qwen_tokenizer)
    tagged.chat_template = TAGGED.replace("STRIP", str(strip).lower())
    plain = copy.copy(qwen_tokenizer)
    plain.chat_template = tagged.chat_template.replace("{%- generation -%}", "").replace("{%- endgeneration -%}", "")
    by_tags, tag_mask = ObservationEncoder(tagged).encode_with_assistant_mask(conversation)
    by_offsets, offset_mask = ObservationEncoder(plain).encode_with_assistant_mask(conversation)
    assert by_tags.ids == by_offsets.ids == qwen_tokenizer.encode(by_offsets.text, add_special_tokens=False)
    assert tag_mask == offset_mask
    bodies = [m["content"] for m in conversation if m["role"] == "assistant"]
    if strip:
        bodies = [b.split("</think>")[-1].lstrip("\n") if "</think>" in b else b for b in bodies[:-1]] + bodies[-1:]
    got = [qwen_tokenizer.decode(by_tags.ids[a:b]) for a, b in mask_runs(tag_mask)]
    # a body that starts with newlines merges with the header's "\n" into one token, which both
    # masks take (transformers marks every token a generation block's characters touch)
    assert got == [("\n" if body.startswith("\n") else "") + body + "<|im_end|>" for body in bodies]


@pytest.mark.parametrize("name", ["qwen2.5", "qwen3", "smollm2", "qwen2.5-vl"])
def test_assistant_masks_of_the_real_templates(tokenizers, name):
    from PIL import Image

    processor = tokenizers[name]
    encoder = ObservationEncoder(processor)
    tokenizer = encoder.tokenizer
    image = Image.new("RGB", (84, 56), (10, 20, 30))
    question = (
        [{"type": "image", "image": image}, {"type": "text", "text": "Shape?"}] if name == "qwen2.5-vl" else "Shape?"
    )
    conversation = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": "A square."},
        {"role": "user", "content": "Sure?"},
        {"role": "assistant", "content": "Yes."},
    ]
    encoded, mask = encoder.encode_with_assistant_mask(conversation)
    assert len(mask) == len(encoded.ids)
    bodies = [tokenizer.decode(encoded.ids[a:b]) for a, b in mask_runs(mask)]
    eot = encoder.eot_text
    # Qwen3's template gives the last answer an empty think block: a token the model may not have made
    last = "<think>\n\n</think>\n\nYes." if name == "qwen3" else "Yes."
    assert bodies == ["A square." + eot, last + eot]
    if name == "qwen2.5-vl":
        pad = processor.image_token_id
        assert encoded.ids == processor(text=encoded.text, images=[image])["input_ids"][0].tolist()
        assert encoded.ids.count(pad) == 6 and all(m == 0 for t, m in zip(encoded.ids, mask) if t == pad)
        assert encoded.tensors["image_grid_thw"].tolist() == [[1, 4, 6]]
