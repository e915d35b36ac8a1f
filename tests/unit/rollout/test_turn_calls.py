"""One turn, several engine calls, without an engine: a turn resumed across calls ends at the first stop
string of its joined output and its text is the decode of all its ids (tests/integration/rollout/
test_turn_calls.py aborts real calls on the embedded engine)."""

import pytest

from slime_mt.rollout.multi_turn import resumed_output

QWEN_IDS = [785, 4226, 374, 81250, 242, 116, 3918, 9217, 29, 803, 1467]  # "The answer is 𝔸.</answer> more text"


@pytest.mark.parametrize(
    "stops, keep, stop, text",
    [
        (["</answer>"], 9, "</answer>", "The answer is 𝔸.</answer>"),  # the stop spans 9217 | 29
        (["text", "</answer>"], 9, "</answer>", "The answer is 𝔸.</answer>"),  # the first stop wins
        (["𝔸."], 7, "𝔸.", "The answer is 𝔸.</"),  # a character split over three tokens; ".</" ends it
        (["more"], 10, "more", "The answer is 𝔸.</answer> more"),
        (["<|im_end|>"], 11, None, "The answer is 𝔸.</answer> more text"),
        ([], 11, None, "The answer is 𝔸.</answer> more text"),
    ],
)
def test_a_resumed_turn_ends_at_the_first_stop_of_its_joined_output(qwen_tokenizer, stops, keep, stop, text):
    tokenizer = qwen_tokenizer
    assert tokenizer.decode(QWEN_IDS[:5]).endswith("\ufffd")  # 𝔸 is three tokens: a cut inside it is not text
    assert resumed_output(tokenizer, QWEN_IDS, stops) == (keep, stop)
    assert tokenizer.decode(QWEN_IDS[:keep]) == text
