"""One turn, several engine calls: how a turn is put together when an engine aborts it.

A chain model (the tiny Qwen3 made to emit a fixed sentence token by token, round and round,
``chain_model``) gives every call a known output, whichever token the abort lands on. An abort that no weight update
caused (an operator's ``/abort_request``) is made again within the engine retry budget, resumed
from the turn's tokens with ``--partial-rollout``, and fails the sample past the budget; a turn of
several calls ends at the first stop string of its joined output and its text is the decode of all
its ids. The engine reports SGLang's ``"default"`` version (launched without ``--weight-version``),
which a run reads as its starting version."""

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
