import json

import pytest
import torch

from slime_mt.errors import SampleError
from slime_mt.types import Sample, Status, Turn


def two_turn_sample():
    s = Sample(index=3, group_index=1, prompt="Q", label="4")
    s.set_prompt_tokens([10, 11, 12])
    s.append_model_tokens([20, 21], [-0.5, -0.25], text="ab")
    s.append_observation_tokens([30, 31, 32], text="obs")
    s.append_model_tokens([22], [-1.0], text="c")
    s.turns = [
        Turn(output_start=3, output_end=5, observation_end=8, finish_reason="stop", weight_version="0"),
        Turn(output_start=8, output_end=9, observation_end=9, finish_reason="stop", weight_version="1"),
    ]
    s.status = Status.COMPLETED
    return s


def test_append_builds_tokens_mask_and_logprobs():
    s = two_turn_sample()
    assert s.tokens == [10, 11, 12, 20, 21, 30, 31, 32, 22]
    assert s.response_length == 6 and s.prompt_length == 3
    assert s.loss_mask == [1, 1, 0, 0, 0, 1]
    assert s.rollout_log_probs == [-0.5, -0.25, 0.0, 0.0, 0.0, -1.0]
    assert s.response == "abobsc"
    s.validate()


def test_append_model_tokens_checks_lengths():
    s = Sample(index=0)
    with pytest.raises(SampleError, match="sample 0: 2 generated tokens but 1 log-probs"):
        s.append_model_tokens([1, 2], [-0.1])
    assert s.tokens == [] and s.response_length == 0


def test_prompt_cannot_be_set_after_response():
    s = two_turn_sample()
    with pytest.raises(SampleError, match="prompt set after 6 response tokens"):
        s.set_prompt_tokens([1])


@pytest.mark.parametrize(
    "corrupt,message",
    [
        (lambda s: s.loss_mask.pop(), r"len\(loss_mask\)=5 != response_length=6"),
        (lambda s: s.rollout_log_probs.append(0.0), r"len\(rollout_log_probs\)=7 != response_length=6"),
        (lambda s: setattr(s, "response_length", 20), r"response_length 20 outside 0..9"),
        (lambda s: s.loss_mask.__setitem__(0, 2), r"loss_mask holds 2"),
        (lambda s: s.loss_mask.__setitem__(0, 0), r"turn 0: generated tokens with loss_mask 0"),
        (lambda s: s.loss_mask.__setitem__(3, 1), r"turn 0: observation tokens with loss_mask 1"),
        (lambda s: setattr(s.turns[1], "output_start", 4), r"turn 1: spans .* out of order"),
        (lambda s: setattr(s.turns[1], "observation_end", 12), r"turn 1: spans .* out of order"),
    ],
)
def test_validate_reports_each_invariant(corrupt, message):
    s = two_turn_sample()
    corrupt(s)
    with pytest.raises(SampleError, match=message):
        s.validate()


def test_trainable_tokens_must_match_turns():
    s = two_turn_sample()
    s.turns.pop()
    with pytest.raises(SampleError, match="3 trainable tokens but turns generated 2"):
        s.validate()


def test_round_trip_with_tensors_through_json():
    s = two_turn_sample()
    s.reward = {"score": 1.0}
    s.metadata = {"difficulty": 2}
    s.multimodal_train_inputs = {
        "pixel_values": torch.randn(8, 12),
        "image_grid_thw": torch.tensor([[1, 2, 4]]),
        "half": torch.randn(3).to(torch.bfloat16),
    }
    s.multimodal_inputs = {"images": ["data:image/png;base64,AAAA"]}
    restored = Sample.from_dict(json.loads(json.dumps(s.to_dict())))
    assert restored.tokens == s.tokens and restored.loss_mask == s.loss_mask
    assert restored.status is Status.COMPLETED
    assert restored.turns == s.turns
    for key, tensor in s.multimodal_train_inputs.items():
        assert restored.multimodal_train_inputs[key].dtype == tensor.dtype
        assert torch.equal(restored.multimodal_train_inputs[key], tensor)
    assert restored.multimodal_inputs == s.multimodal_inputs
    restored.validate()


def test_from_dict_rejects_unknown_keys():
    data = two_turn_sample().to_dict()
    data["tokenz"] = []
    with pytest.raises(SampleError, match=r"unknown keys \['tokenz'\]"):
        Sample.from_dict(data)


def test_append_turn_and_observation_keep_the_turn_records():
    s = Sample(index=3, tokens=[1, 2])
    first = s.append_turn([10, 11], [-0.1, -0.2], "ab", "stop", "4")
    s.append_observation([20, 21, 22], "obs")
    s.append_turn([12], [-0.3], "c", "length")
    s.validate()
    assert (first.output_start, first.output_end, first.observation_end, first.weight_version) == (2, 4, 7, "4")
    assert (s.turns[1].output_start, s.turns[1].output_end, s.turns[1].finish_reason) == (7, 8, "length")
    assert s.loss_mask == [1, 1, 0, 0, 0, 1] and s.token_versions == [4, 4, -1, -1, -1, -1]
    assert s.weight_versions == ["4"] and s.response == "abobsc"
    with pytest.raises(SampleError, match="sample 5: an observation before any model turn"):
        Sample(index=5, tokens=[1]).append_observation([2])
