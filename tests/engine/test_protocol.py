import pytest

from slime_mt.engine.protocol import (
    ProtocolError,
    collapse_image_pads,
    expand_image_pads,
    parse_generate,
    parse_sampling_params,
)

PAD = 151655


def test_single_request_defaults():
    [req], is_batch = parse_generate({"input_ids": [1, 2, 3], "rid": "r1", "whatever": 5}, vocab_size=10)
    assert not is_batch and req.rid == "r1" and req.input_ids == [1, 2, 3]
    assert req.sampling.max_new_tokens == 128 and req.sampling.temperature == 1.0
    assert req.return_logprob is False and req.images == []


def test_batch_request_spreads_fields():
    reqs, is_batch = parse_generate({
        "input_ids": [[1], [2, 3]],
        "sampling_params": [{"max_new_tokens": 4}, {"max_new_tokens": 5, "stop": "x"}],
        "image_data": [None, []],
        "return_logprob": True,
    }, vocab_size=10)
    assert is_batch and [r.input_ids for r in reqs] == [[1], [2, 3]]
    assert [r.sampling.max_new_tokens for r in reqs] == [4, 5]
    assert reqs[1].sampling.stop == ["x"]
    assert all(r.return_logprob for r in reqs)
    assert reqs[0].rid != reqs[1].rid


@pytest.mark.parametrize("body,message", [
    ([1, 2], "must be a JSON object"),
    ({}, "exactly one of 'text' or 'input_ids'"),
    ({"input_ids": [1], "text": "a"}, "exactly one of"),
    ({"input_ids": []}, "non-empty list"),
    ({"input_ids": [1, "a"]}, r"holds 'a', not a token id in \[0, 10\)"),
    ({"input_ids": [1, 10]}, r"holds 10"),
    ({"input_ids": [-1]}, r"holds -1"),
    ({"input_ids": [[1], []]}, r"input_ids\[1\] must be a non-empty list"),
    ({"input_ids": [1.5]}, r"holds 1.5"),
    ({"input_ids": [True]}, r"holds True"),
    ({"text": ""}, "text must be a non-empty string"),
    ({"input_ids": [1], "sampling_params": []}, "sampling_params must be an object"),
    ({"input_ids": [1], "sampling_params": {"max_tokens": 3}}, r"unknown key\(s\) \['max_tokens'\]"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": "3"}}, "max_new_tokens must be an integer"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens must be >= 0"),
    ({"input_ids": [1], "sampling_params": {"temperature": -0.5}}, "temperature must be >= 0"),
    ({"input_ids": [1], "sampling_params": {"top_p": 0}}, r"top_p must be in \(0, 1\]"),
    ({"input_ids": [1], "sampling_params": {"top_k": 0}}, "top_k must be -1 or >= 1"),
    ({"input_ids": [1], "sampling_params": {"stop": [1]}}, "stop must be a non-empty string"),
    ({"input_ids": [1], "sampling_params": {"stop_token_ids": "2"}}, "stop_token_ids must be a list"),
    ({"input_ids": [1], "sampling_params": {"n": 2}}, "n=2 is not supported"),
    ({"input_ids": [1], "image_data": [3]}, r"image_data\[0\]\[0\] must be a data URI"),
    ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "sampling_params has 1 entries for a batch of 2"),
    ({"input_ids": [1], "rid": 5}, "rid must be a string"),
    ({"input_ids": [1], "return_logprob": "yes"}, "return_logprob must be true or false"),
])
def test_malformed_requests(body, message):
    with pytest.raises(ProtocolError, match=message):
        parse_generate(body, vocab_size=10)


def test_sampling_params_greedy():
    assert parse_sampling_params({"temperature": 0}).greedy
    assert parse_sampling_params({"top_k": 1}).greedy
    assert not parse_sampling_params({"temperature": 0.7}).greedy


@pytest.mark.parametrize("expanded,engine,counts", [
    ([1, PAD, PAD, PAD, 2], [1, PAD, 2], [3]),
    ([PAD, PAD, 5, PAD, 7, PAD, PAD], [PAD, 5, PAD, 7, PAD], [2, 1, 2]),
    ([1, 2, 3], [1, 2, 3], []),
])
def test_image_pad_views_round_trip(expanded, engine, counts):
    assert collapse_image_pads(expanded, PAD) == (engine, counts)
    assert expand_image_pads(engine, PAD, counts) == expanded


def test_expand_rejects_count_mismatch():
    with pytest.raises(ProtocolError, match="2 image pad tokens in input_ids but 1 images"):
        expand_image_pads([PAD, 1, PAD], PAD, [4])
