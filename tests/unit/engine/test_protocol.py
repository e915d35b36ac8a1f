import pytest

from slime_mt.engine.protocol import (
    SamplingParams,
    decode_json_body,
    expand_image_pads,
    parse_bool,
    parse_generate,
    parse_sampling_params,
)
from slime_mt.errors import ProtocolError

PAD = 151655


def test_single_request_defaults():
    [req], is_batch = parse_generate({"input_ids": [1, 2, 3], "rid": "r1", "whatever": 5}, vocab_size=10)
    assert not is_batch and req.rid == "r1" and req.input_ids == [1, 2, 3]
    assert req.sampling.max_new_tokens == 128 and req.sampling.temperature == 1.0
    assert req.return_logprob is False and req.images == []


def test_batch_request_spreads_fields():
    reqs, is_batch = parse_generate(
        {
            "input_ids": [[1], [2, 3]],
            "sampling_params": [{"max_new_tokens": 4}, {"max_new_tokens": 5, "stop": "x"}],
            "image_data": [None, []],
            "return_logprob": True,
        },
        vocab_size=10,
    )
    assert is_batch and [r.input_ids for r in reqs] == [[1], [2, 3]]
    assert [r.sampling.max_new_tokens for r in reqs] == [4, 5]
    assert reqs[1].sampling.stop == ["x"]
    assert all(r.return_logprob for r in reqs)
    assert reqs[0].rid != reqs[1].rid


def test_priority_is_per_request_and_none_by_default():
    """SGLang's ``priority`` (--enable-priority-scheduling): one value, one per prompt, or none (None:
    the scheduler serves it after every request with one, as SGLang's sets it to -sys.maxsize - 1)."""
    [req], _ = parse_generate({"input_ids": [1], "priority": -3}, vocab_size=10)
    assert req.priority == -3
    reqs, _ = parse_generate({"input_ids": [[1], [2]], "priority": [2, None]}, vocab_size=10)
    assert [r.priority for r in reqs] == [2, None]
    reqs, _ = parse_generate({"input_ids": [[1], [2]], "priority": 4}, vocab_size=10)
    assert [r.priority for r in reqs] == [4, 4]
    [req], _ = parse_generate({"input_ids": [1]}, vocab_size=10)
    assert req.priority is None


@pytest.mark.parametrize(
    "body,message",
    [
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
        ({"input_ids": [1], "sampling_params": {"temperature": -0.5}}, "temperature must be a non-negative finite"),
        (
            {"input_ids": [1], "sampling_params": {"temperature": float("nan")}},
            "temperature must be a non-negative finite",
        ),
        (
            {"input_ids": [1], "sampling_params": {"temperature": float("inf")}},
            "temperature must be a non-negative finite",
        ),
        ({"input_ids": [1], "sampling_params": {"top_p": float("nan")}}, r"top_p must be in \(0, 1\]"),
        ({"input_ids": [1], "sampling_params": {"min_p": float("-inf")}}, r"min_p must be in \[0, 1\]"),
        ({"input_ids": [1], "sampling_params": {"temperature": 10**400}}, "temperature is out of range"),
        ({"input_ids": [1], "sampling_params": {"sampling_seed": 2**64}}, "sampling_seed must be a 64-bit integer"),
        ({"input_ids": [1], "sampling_params": {"sampling_seed": -(2**63) - 1}}, "sampling_seed must be a 64-bit"),
        ({"input_ids": [1], "sampling_params": {"sampling_seed": 1.5}}, "sampling_seed must be an integer"),
        ({"input_ids": [1], "sampling_params": {"min_new_tokens": 5, "max_new_tokens": 4}}, "min_new_tokens=5 must be"),
        ({"input_ids": [1], "sampling_params": {"n": True}}, "n=True is not supported"),
        ({"input_ids": [1], "sampling_params": {"frequency_penalty": float("nan")}}, "frequency_penalty=nan is not"),
        ({"input_ids": [1], "sampling_params": {"ignore_eos": "maybe"}}, "ignore_eos must be true or false"),
        ({"input_ids": [1], "sampling_params": {"stream_interval": "x"}}, "stream_interval must be an integer"),
        ({"input_ids": [1], "stream": True}, "stream=True is not supported"),
        ({"input_ids": [1], "top_logprobs_num": 5}, "top_logprobs_num=5 is not supported"),
        ({"input_ids": [1], "lora_path": 5}, "lora_path must be the name of a loaded adapter, got 5"),
        ({"input_ids": [[1], [2]], "lora_path": ["a"]}, "lora_path has 1 entries for a batch of 2"),
        ({"input_ids": [[1], [2]], "rid": ["a", "a"]}, r"Duplicate request IDs detected within the request: \['a'\]"),
        ({"input_ids": [[1], [2]], "rid": ["a"]}, "rid has 1 entries for a batch of 2"),
        ({"input_ids": [1], "rid": ["a"]}, "rid must be a string, got"),
        ({"input_ids": [1], "logprob_start_len": -2}, "logprob_start_len must be an integer >= -1"),
        ({"input_ids": [[1], [2]], "image_data": ["a", "b", "c"]}, "image_data has 3 entries for a batch of 2"),
        ({"input_ids": [[1], [2]], "image_data": [["a"], [5]]}, r"image_data\[1\]\[0\] must be a data URI"),
        ({"input_ids": [1], "sampling_params": {"top_p": 0}}, r"top_p must be in \(0, 1\]"),
        ({"input_ids": [1], "sampling_params": {"top_k": 0}}, "top_k must be -1 or >= 1"),
        ({"input_ids": [1], "sampling_params": {"stop": [1]}}, "stop must be a non-empty string"),
        ({"input_ids": [1], "sampling_params": {"stop_token_ids": "2"}}, "stop_token_ids must be a list"),
        ({"input_ids": [1], "sampling_params": {"n": 2}}, "n=2 is not supported"),
        ({"input_ids": [1], "image_data": [3]}, r"image_data\[0\]\[0\] must be a data URI"),
        ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "sampling_params has 1 entries for a batch of 2"),
        ({"input_ids": [1], "rid": 5}, "rid must be a string"),
        ({"input_ids": [1], "return_logprob": "maybe"}, "return_logprob must be true or false"),
        ({"input_ids": [[1], [2]], "return_logprob": [True, "maybe"]}, r"return_logprob\[1\] must be true or false"),
        ({"input_ids": [1], "priority": 1.5}, "priority must be an integer, got 1.5"),
        ({"input_ids": [1], "priority": True}, "priority must be an integer, got True"),
        ({"input_ids": [[1], [2]], "priority": [0, "high"]}, r"priority\[1\] must be an integer"),
        ({"input_ids": [[1], [2]], "priority": [0]}, "priority has 1 entries for a batch of 2"),
    ],
)
def test_malformed_requests(body, message):
    with pytest.raises(ProtocolError, match=message):
        parse_generate(body, vocab_size=10)


def test_sampling_params_greedy():
    assert parse_sampling_params({"temperature": 0}).greedy
    assert parse_sampling_params({"top_k": 1}).greedy
    assert not parse_sampling_params({"temperature": 0.7}).greedy


def test_expand_rejects_count_mismatch():
    with pytest.raises(ProtocolError, match="2 image pad tokens in input_ids but 1 images"):
        expand_image_pads([PAD, 1, PAD], PAD, [4])


def test_null_means_the_default():
    [req], _ = parse_generate(
        {
            "input_ids": [1],
            "rid": None,
            "return_logprob": None,
            "logprob_start_len": None,
            "image_data": None,
            "stream": None,
            "sampling_params": {
                "temperature": None,
                "top_p": None,
                "top_k": None,
                "min_p": None,
                "stop": None,
                "stop_token_ids": None,
                "ignore_eos": None,
                "n": None,
                "min_new_tokens": None,
                "sampling_seed": None,
                "frequency_penalty": None,
                "logit_bias": None,
            },
        },
        vocab_size=10,
    )
    assert req.sampling == SamplingParams()
    assert req.return_logprob is False and req.logprob_start_len == -1 and req.images == []
    assert parse_sampling_params({"max_new_tokens": None}).max_new_tokens is None  # up to the context


@pytest.mark.parametrize(
    "value,expected",
    [
        (True, True),
        ("true", True),
        ("Yes", True),
        ("on", True),
        (1, True),
        ("1", True),
        (False, False),
        ("false", False),
        ("0", False),
        ("off", False),
        (0, False),
        (None, False),
    ],
)
def test_booleans_are_read_as_pydantic_reads_them(value, expected):
    assert parse_bool(value, "x") is expected
    [req], _ = parse_generate({"input_ids": [1], "return_logprob": value}, vocab_size=10)
    assert req.return_logprob is expected


def test_batch_rids_follow_sglang():
    reqs, _ = parse_generate({"input_ids": [[1], [2], [3]], "rid": "job"}, vocab_size=10)
    assert [r.rid for r in reqs] == ["job_0", "job_1", "job_2"]
    reqs, _ = parse_generate({"input_ids": [[1], [2]], "rid": ["x", "y"]}, vocab_size=10)
    assert [r.rid for r in reqs] == ["x", "y"]
    [req], _ = parse_generate({"input_ids": [1], "rid": "job"}, vocab_size=10)
    assert req.rid == "job"


@pytest.mark.parametrize(
    "image_data,expected",
    [
        ("a", [["a"], ["a"]]),  # one image for every request
        (["a", "b"], [["a"], ["b"]]),  # one image per request
        ([["a", "b"], None], [["a", "b"], []]),  # a list per request
        ([None, "b"], [[], ["b"]]),
        ([], [[], []]),
    ],
)
def test_batch_image_data_forms(image_data, expected):
    reqs, _ = parse_generate({"input_ids": [[1], [2]], "image_data": image_data}, vocab_size=10)
    assert [r.images for r in reqs] == expected


def test_single_image_data_forms():
    assert parse_generate({"input_ids": [1], "image_data": "a"}, vocab_size=10)[0][0].images == ["a"]
    assert parse_generate({"input_ids": [1], "image_data": ["a", "b"]}, vocab_size=10)[0][0].images == ["a", "b"]


@pytest.mark.parametrize(
    "raw,message",
    [
        (b"", "request body is empty"),
        (b"{", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        (b"[" * 40 + b"]" * 40, "nested deeper than 32 levels"),
        (b'{"a": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nested deeper than 32 levels"),
        (b"[" * 200_000, "nested deeper than 32 levels"),
        (b"9" * 5000, "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
    ],
)
def test_body_decoding_raises_only_request_errors(raw, message):
    with pytest.raises(ProtocolError, match=message):
        decode_json_body(raw)


def test_error_messages_show_bounded_values():
    with pytest.raises(ProtocolError) as raised:
        parse_generate({"input_ids": [1], "rid": [[[[[[[["deep"]]]]]]]] * 1000}, vocab_size=10)
    assert len(str(raised.value)) < 300
