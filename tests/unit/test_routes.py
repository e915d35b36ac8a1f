"""R3 routes as data (unit tier, <1 s): the layout read from HF configs, SGLang's wire form decoded into
the compact sample form and back, bad payloads named, and the replay targets training builds."""

import pytest
import torch

from slime_mt.routes import RouteLayout, no_route, replay_targets, route_dtype

CONFIG = {
    "model_type": "qwen3_moe",
    "num_hidden_layers": 4,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [0],
}


def test_the_layout_follows_the_config_and_the_dtype_the_expert_count():
    layout = RouteLayout.of(CONFIG)
    assert layout == RouteLayout(num_layers=4, moe_layers=(1, 2, 3), top_k=8, num_experts=128)
    assert layout.dtype == torch.uint8 and layout.bytes_per_token_layer() == 8  # int32 on the wire: 32
    assert (
        RouteLayout.of({"text_config": {**CONFIG, "num_experts": None, "num_local_experts": 300}}).dtype == torch.int16
    )
    assert route_dtype(254) == torch.uint8 and route_dtype(255) == torch.int16  # 255 marks "no route"
    assert RouteLayout.of({"num_hidden_layers": 2, "num_experts_per_tok": 2}) is None  # a dense model


def test_the_wire_form_decodes_to_the_moe_layers_and_back():
    layout = RouteLayout.of(CONFIG)
    g = torch.Generator().manual_seed(0)
    wire = torch.randint(0, 128, (5, 4, 8), generator=g, dtype=torch.int32)
    wire[:, 0] = -1  # the dense layer
    rows = layout.decode(layout.encode(wire))
    assert rows.shape == (5, 3, 8) and rows.dtype == torch.uint8
    assert torch.equal(rows.long(), wire[:, 1:].long())
    assert layout.decode(layout.encode(wire[:0])).shape == (0, 3, 8)


def test_bad_payloads_are_named():
    layout = RouteLayout.of(CONFIG)
    with pytest.raises(ValueError, match="turn 2: 31 int32 values are not rows of 4 layers x 8 experts"):
        layout.decode(layout.encode(torch.zeros(31, dtype=torch.int32)), "turn 2")
    wire = torch.zeros(1, 4, 8, dtype=torch.int32)
    wire[0, 2, 3] = 128
    with pytest.raises(ValueError, match="an expert index outside 0..127"):
        layout.decode(layout.encode(wire))


def test_replay_targets_fill_unrouted_tokens_with_minus_one():
    routes = torch.tensor([[[1, 2]], [[3, 4]], [[no_route(torch.uint8)] * 2]], dtype=torch.uint8)
    targets = replay_targets(routes, 5, 1, 2)
    assert targets.dtype == torch.int64 and targets.shape == (5, 1, 2)
    assert targets[:, 0].tolist() == [[1, 2], [3, 4], [-1, -1], [-1, -1], [-1, -1]]
    assert (replay_targets(None, 3, 2, 2) == -1).all()


def test_each_route_row_has_the_version_that_processed_its_token():
    """Row i was routed by the call that generated the first model token after i: the prompt's rows by
    the first call, the last token before a weight update by the resumed call, an observation's rows by
    the next turn's prefill; their gaps to the trained version are the route staleness metrics."""
    from slime_mt.rollout.staleness import route_staleness_metrics, route_versions
    from slime_mt.types import NO_VERSION, Sample

    sample = Sample(index=0, tokens=[1, 2, 3])  # prompt: positions 0-2
    sample.append_model_runs([10, 11, 12, 13], [-0.1] * 4, [0, 0, 1, 1])  # 3-6: resumed across an update
    sample.append_observation_tokens([20, 21])  # 7-8
    sample.append_model_runs([30, 31, 32], [-0.1] * 3, [2, 2, 2])  # 9-11
    sample.routed_experts = torch.zeros(len(sample.tokens) - 1, 1, 2, dtype=torch.uint8)  # the last has no row
    assert route_versions(sample) == [0, 0, 0, 0, 1, 1, 2, 2, 2, 2, 2]
    metrics = route_staleness_metrics([sample], 3)
    assert metrics == {"rollout/route_version_gap_max": 3.0, "rollout/route_version_gap_mean": 21 / 11}
    sample.routed_experts = sample.routed_experts[:6]  # rows may stop short of the end
    assert route_versions(sample) == [0, 0, 0, 0, 1, 1]
    sample.token_versions = [NO_VERSION] * sample.response_length  # an engine that names no version
    assert route_versions(sample) == [NO_VERSION] * 6 and route_staleness_metrics([sample], 3) == {}
    sample.routed_experts = None
    assert route_versions(sample) == []
