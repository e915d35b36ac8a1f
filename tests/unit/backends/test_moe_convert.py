"""Mixture-of-experts as data (unit tier, ~2 s): which layers are sparse and how the router normalises,
read from HF configs; the layouts refused by name; every expert layout an HF checkpoint may hold read
the same; and HF -> Megatron -> HF exact for every expert-parallel x expert-tensor-parallel split
(the gathers across processes are the Megatron worlds' job: tests/integration/backends)."""

import pytest
import torch

from slime_mt.backends.megatron.convert import (
    ExpertGather,
    ExpertLayout,
    HFExperts,
    TPGather,
    expert_names,
    iter_hf_to_megatron,
    iter_megatron_to_hf,
)
from slime_mt.backends.megatron.families import MoeOptions, check_tp, decoder_spec, read_hf_config
from slime_mt.errors import ModelConfigError
from slime_mt.safetensors_files import CheckpointReader, load_hf_state


def _text(**moe) -> dict:
    base = dict(
        model_type="qwen3_moe",
        vocab_size=100,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=8,
    )
    return {**base, **moe}


def test_sparse_layers_and_router_normalisation_follow_the_hf_config():
    spec = decoder_spec(_text(decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=False))
    assert spec.family == "qwen3-moe" and spec.qk_norm
    assert spec.moe.sparse_layers == [False, True, False, False]  # (i + 1) % 2 == 0, minus layer 3
    assert spec.moe.layer_pattern == [0, 1, 0, 0]
    assert (spec.moe.num_experts, spec.moe.topk, spec.moe.ffn_hidden_size) == (4, 2, 8)
    assert spec.moe.norm_topk_prob is False
    assert decoder_spec(_text()).moe.norm_topk_prob is True  # Qwen3-30B-A3B's setting
    assert decoder_spec(_text(model_type="qwen3")).moe is None  # a dense family has no experts


def test_bad_moe_configs_and_layouts_are_refused_by_name():
    with pytest.raises(ModelConfigError, match="num_experts_per_tok 5 exceeds num_experts 4"):
        decoder_spec(_text(num_experts_per_tok=5))
    with pytest.raises(ModelConfigError, match="shared experts"):
        decoder_spec(_text(shared_expert_intermediate_size=8))
    spec = decoder_spec(_text())
    with pytest.raises(ModelConfigError, match="--expert-model-parallel-size 3 must divide the 4 experts"):
        check_tp(spec, 1, MoeOptions(expert_parallel=3))
    with pytest.raises(ModelConfigError, match="--expert-tensor-parallel-size 3 must be at least 1 and divide"):
        check_tp(spec, 1, MoeOptions(expert_tensor_parallel=3))
    with pytest.raises(ModelConfigError, match="--expert-model-parallel-size 2: this qwen3 model has no experts"):
        check_tp(decoder_spec(_text(model_type="qwen3")), 1, MoeOptions(expert_parallel=2))
    check_tp(decoder_spec(_text(num_key_value_heads=2)), 2, MoeOptions(expert_parallel=4))  # ETP = TP: 8 % 2 == 0


def _fused(state: dict, prefix: str, experts: int, published: bool) -> dict:
    """``state``'s per-expert tensors as one layer's fused pair, in the published or in-memory layout."""
    out = {k: v for k, v in state.items() if ".experts." not in k}
    gate_up = torch.stack(
        [
            torch.cat([state[f"{prefix}experts.{e}.gate_proj.weight"], state[f"{prefix}experts.{e}.up_proj.weight"]])
            for e in range(experts)
        ]
    )  # [E, 2I, H]
    down = torch.stack([state[f"{prefix}experts.{e}.down_proj.weight"] for e in range(experts)])  # [E, H, I]
    out[f"{prefix}experts.gate_up_proj"] = gate_up.transpose(1, 2).contiguous() if published else gate_up
    out[f"{prefix}experts.down_proj"] = down.transpose(1, 2).contiguous() if published else down
    return out


@pytest.mark.parametrize("published", [True, False])
def test_every_hf_expert_layout_reads_the_same_expert_slices(tiny_paths, published):
    path = tiny_paths["qwen3-moe"]
    spec = decoder_spec(read_hf_config(path))
    state = load_hf_state(path)
    prefix = "model.layers.0.mlp."
    per_expert = HFExperts(CheckpointReader(tensors=state), prefix, spec)
    fused = HFExperts(CheckpointReader(tensors=_fused(state, prefix, 8, published)), prefix, spec)
    assert fused.fused and not per_expert.fused
    for e in (0, 5, 7):
        for f0, f1 in ((0, 48), (24, 48)):
            assert torch.equal(fused.gate_up(e, f0, f1), per_expert.gate_up(e, f0, f1))
            assert torch.equal(fused.down(e, f0, f1), per_expert.down(e, f0, f1))
    bad = _fused(state, prefix, 8, published)
    bad[f"{prefix}experts.down_proj"] = bad[f"{prefix}experts.down_proj"][:, :5]
    with pytest.raises(ValueError, match="experts.gate_up_proj .* and .*experts.down_proj .* fit no fused layout"):
        HFExperts(CheckpointReader(tensors=bad), prefix, spec)


@pytest.mark.parametrize("published", [True, False])
def test_a_layer_whose_gate_up_shape_cannot_tell_takes_its_down_projections_layout(published):
    """Issue 67 item 3: with 2 x moe_intermediate_size == hidden_size gate_up's shape fits both fused
    layouts ([E, H, 2I] and [E, 2I, H] are both [E, H, H]); the layer's down projection, [E, I, H] or
    [E, H, I], tells which one the folder holds, and both tensors are read in it. A layer whose two
    tensors disagree is refused naming them."""
    g = torch.Generator().manual_seed(0)
    prefix, experts, hidden, inter = "model.layers.0.mlp.", 4, 16, 8
    state = {}
    for e in range(experts):
        for name, shape in (
            ("gate_proj", (inter, hidden)),
            ("up_proj", (inter, hidden)),
            ("down_proj", (hidden, inter)),
        ):
            state[f"{prefix}experts.{e}.{name}.weight"] = torch.randn(*shape, generator=g)
    spec = decoder_spec(_text(hidden_size=hidden, moe_intermediate_size=inter, head_dim=8))
    per_expert = HFExperts(CheckpointReader(tensors=state), prefix, spec)
    folder = _fused(state, prefix, experts, published)
    fused = HFExperts(CheckpointReader(tensors=folder), prefix, spec)
    assert fused.published_gate_up is published
    for e in range(experts):
        assert torch.equal(fused.gate_up(e, 0, inter), per_expert.gate_up(e, 0, inter))
        assert torch.equal(fused.down(e, 0, inter), per_expert.down(e, 0, inter))
    mixed = _fused(state, prefix, experts, published)
    mixed[f"{prefix}experts.down_proj"] = _fused(state, prefix, experts, not published)[f"{prefix}experts.down_proj"]
    mixed[f"{prefix}experts.gate_up_proj"] = mixed[f"{prefix}experts.gate_up_proj"][:, :, :15]
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts.gate_up_proj \[4, 16, 15\] .* fit no fused"):
        HFExperts(CheckpointReader(tensors=mixed), prefix, spec)


class _Ranks(ExpertGather):
    """ExpertGather without process groups: every (EP rank, ETP rank)'s converted tensors, joined
    the way the gathers join them (ETP shards: fc1's [gate; up] halves, fc2's columns)."""

    def __init__(self, per_rank: dict, ep: int, etp: int, name_of: dict):
        self.layout, self.active, self.here = ExpertLayout(0, ep, 0, etp), True, True
        self.per_rank, self.name_of = per_rank, name_of

    def expert(self, fc1, fc2):
        out = []
        for ep_rank in range(self.layout.ep):
            shards = [self.per_rank[ep_rank, t] for t in range(self.layout.etp)]
            gates, ups = zip(*(s[self.name_of[id(fc1)]].chunk(2) for s in shards))
            down = torch.cat([s[self.name_of[id(fc2)]] for s in shards], dim=1)
            out.append((torch.cat(gates), torch.cat(ups), down))
        return out


@pytest.mark.parametrize("kind", ["qwen3-moe", "qwen3-vl-moe"])
@pytest.mark.parametrize("ep,etp", [(1, 1), (2, 1), (4, 2), (1, 2)])
@pytest.mark.parametrize("te", [False, True])
def test_experts_round_trip_over_every_expert_split(tiny_paths, kind, ep, etp, te):
    """Each rank holds E / ep experts (rank r: experts r * E/ep ...), each split over etp ranks; joined
    again they export the checkpoint's own layout bit for bit (per-expert keys for Qwen3-MoE, the
    published fused pair for Qwen3-VL-MoE)."""
    path = tiny_paths[kind]
    spec = decoder_spec(read_hf_config(path))
    reader = CheckpointReader(path)
    per_rank = {
        (e, t): dict(iter_hf_to_megatron(reader, spec, 0, 1, te, ExpertLayout(e, ep, t, etp)))
        for e in range(ep)
        for t in range(etp)
    }
    fc1, _ = expert_names(0, 0, te)
    assert per_rank[0, 0][fc1].shape == (2 * 48 // etp, 64)
    assert sum(name.startswith("decoder.layers.0.mlp.experts.") for name in per_rank[0, 0]) == 2 * 8 // ep
    assert not any(".experts." in name for name in per_rank[0, 0] if name.startswith("decoder.layers.1."))  # dense
    first = per_rank[0, 0]
    name_of = {id(t): name for name, t in first.items()}
    prefix = "model.language_model." if kind == "qwen3-vl-moe" else "model."
    back = dict(iter_megatron_to_hf(first, spec, TPGather(1), prefix, te, _Ranks(per_rank, ep, etp, name_of)))
    source = {k: v for k, v in load_hf_state(path).items() if "visual" not in k}
    assert back.keys() == source.keys()
    for name, tensor in source.items():
        assert torch.equal(back[name], tensor), name
