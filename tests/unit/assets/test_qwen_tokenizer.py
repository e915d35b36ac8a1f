"""The rebuilt Qwen tokenizer against known ids and an independent rank-based BPE, and its templates."""

import unicodedata

import pytest
import regex

from slime_mt.assets.qwen_tokenizer import QWEN_PATTERN, SPECIAL_TOKENS, find_ranks_file, load_ranks

KNOWN = [
    ("Hello world", [9707, 1879]),
    ("<|im_start|>user\n", [151644, 872, 198]),
    ("<|im_end|>", [151645]),
    ("<|image_pad|><think></think>", [151655, 151667, 151668]),
]


@pytest.mark.parametrize("text,ids", KNOWN)
def test_known_ids(qwen_tokenizer, text, ids):
    assert qwen_tokenizer.encode(text, add_special_tokens=False) == ids


def test_special_tokens_at_real_ids(qwen_tokenizer):
    assert len(SPECIAL_TOKENS) == 26
    for offset, (token, _) in enumerate(SPECIAL_TOKENS):
        assert qwen_tokenizer.convert_tokens_to_ids(token) == 151643 + offset
    assert qwen_tokenizer.eos_token_id == 151645 and qwen_tokenizer.pad_token_id == 151643


def tiktoken_reference(text: str, ranks: dict[bytes, int]) -> list[int]:
    """tiktoken's algorithm written independently: regex split, then merge the lowest-rank pair."""
    ids = []
    for piece in regex.findall(QWEN_PATTERN, unicodedata.normalize("NFC", text)):
        data = piece.encode()
        if data in ranks:
            ids.append(ranks[data])
            continue
        parts = [bytes([b]) for b in data]
        while len(parts) > 1:
            best = min(range(len(parts) - 1), key=lambda i: ranks.get(parts[i] + parts[i + 1], float("inf")))
            if parts[best] + parts[best + 1] not in ranks:
                break
            parts[best : best + 2] = [parts[best] + parts[best + 1]]
        ids.extend(ranks[p] for p in parts)
    return ids


MIXED = (
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # 递归\n\n"
    "中文测试：几何题的答案是 42。日本語のテキスト、한국어 텍스트.\n"
    "Emoji 😀🚀👩‍💻 and accents: café naïve façade — “quotes” 1234567890 3.14159\n"
    "\t\tTabs   and    spaces\r\n  It's we'll they've I'M\n"
)


def test_mixed_text_matches_reference_bpe(qwen_tokenizer):
    ranks = load_ranks(find_ranks_file())
    ours = qwen_tokenizer.encode(MIXED, add_special_tokens=False)
    assert ours == tiktoken_reference(MIXED, ranks)
    assert qwen_tokenizer.decode(ours) == MIXED


def test_special_tokens_inside_text(qwen_tokenizer):
    text = "a<|im_start|>b<tool_call>{}</tool_call>"
    ids = qwen_tokenizer.encode(text, add_special_tokens=False)
    assert 151644 in ids and 151657 in ids and 151658 in ids
    assert qwen_tokenizer.decode(ids) == text
    assert qwen_tokenizer.decode(ids, skip_special_tokens=True) == "ab<tool_call>{}</tool_call>"


def render(tokenizer, messages, **kw):
    return tokenizer.apply_chat_template(messages, tokenize=False, **kw)


def test_qwen25_template_default_system_and_generation_prompt(qwen_tokenizer):
    text = render(qwen_tokenizer, [{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
        "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_qwen25_template_tools_calls_and_responses(qwen_tokenizer):
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "calc", "arguments": {"expr": "2+2"}}}],
        },
        {"role": "tool", "content": "4"},
        {"role": "tool", "content": "ok"},
        {"role": "assistant", "content": "4"},
    ]
    text = render(qwen_tokenizer, messages, tools=tools)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions")
    assert (
        '\n<tools>\n{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}\n</tools>'
        in text
    )
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "calc", "arguments": {"expr": "2+2"}}\n</tool_call><|im_end|>\n'
        in text
    )
    assert (
        "<|im_start|>user\n<tool_response>\n4\n</tool_response>\n<tool_response>\nok\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
    ) in text


def test_qwen3_template_strips_old_thinking(qwen3_tokenizer):
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "<think>\nold reasoning\n</think>\n\nA1"},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "<think>\nnew reasoning\n</think>\n\nA2"},
    ]
    text = render(qwen3_tokenizer, messages)
    assert text == (
        "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n"
        "<|im_start|>user\nb<|im_end|>\n<|im_start|>assistant\n<think>\nnew reasoning\n</think>\n\nA2"
        "<|im_end|>\n"
    )
    gen = render(qwen3_tokenizer, messages[:1], add_generation_prompt=True, enable_thinking=False)
    assert gen.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_vl_template_renders_one_pad_per_image():
    from transformers import AutoTokenizer

    from slime_mt.assets import qwen_tokenizer_dir

    tokenizer = AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir("qwen2.5-vl")))
    messages = [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": "Find x."}, {"type": "image", "image": "b.png"}],
        }
    ]
    text = render(tokenizer, messages, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        "<|vision_start|><|image_pad|><|vision_end|>Find x.<|vision_start|><|image_pad|><|vision_end|>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )
