"""HF <-> Megatron conversion as data: per-rank slices read from disk, the Transformer Engine names
(tested without TE: the names are data), and the packing figures."""

import pytest
import torch

from slime_mt.backends.megatron.convert import TPGather, decoder_names, iter_hf_to_megatron, iter_megatron_to_hf
from slime_mt.backends.megatron.families import decoder_spec, read_hf_config
from slime_mt.backends.megatron.packing import useful_attention_fraction
from slime_mt.safetensors_files import CheckpointReader, load_hf_state


class _Shards(TPGather):
    """TPGather without a process group: the "gather" stacks the shards converted for every rank."""

    def __init__(self, per_rank: list[dict[str, torch.Tensor]], name_of):
        super().__init__(tp=len(per_rank), here=True)
        self._per_rank, self._name_of = per_rank, name_of

    def _gather(self, t):
        name = self._name_of[id(t)]
        return torch.stack([state[name] for state in self._per_rank])


def _round_trip(path, tp: int, te: bool) -> dict[str, torch.Tensor]:
    """HF -> every rank's Megatron shards -> HF, for a tiny checkpoint on disk."""
    spec = decoder_spec(read_hf_config(path))
    reader = CheckpointReader(path)
    per_rank = [dict(iter_hf_to_megatron(reader, spec, rank, tp, te)) for rank in range(tp)]
    name_of = {id(t): name for name, t in per_rank[0].items()}
    prefix = "model.language_model." if "model.language_model.embed_tokens.weight" in reader.names() else "model."
    return dict(iter_megatron_to_hf(per_rank[0], spec, _Shards(per_rank, name_of), prefix, te))


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "qwen2.5-vl", "qwen3-vl", "qwen3-moe", "qwen3-vl-moe"])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("te", [False, True])
def test_conversion_round_trips_per_family_tp_and_spec(tiny_paths, kind, tp, te):
    source = load_hf_state(tiny_paths[kind])
    back = _round_trip(tiny_paths[kind], tp, te)
    decoder = {k: v for k, v in source.items() if "visual" not in k}
    assert back.keys() == decoder.keys()
    for name, tensor in decoder.items():
        assert torch.equal(back[name], tensor), name


def test_te_names_are_megatron_own_local_to_te_map(tiny_paths):
    """The TE spec fuses the pre-norms into the next linear; Megatron's local layer spec declares the
    same renaming for checkpoint compatibility (``sharded_state_dict_keys_map``)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    key_map = get_gpt_layer_local_spec(
        qk_layernorm=True, normalization="RMSNorm"
    ).submodules.sharded_state_dict_keys_map
    spec = decoder_spec(read_hf_config(tiny_paths["qwen3"]))
    local = dict(iter_hf_to_megatron(CheckpointReader(tiny_paths["qwen3"]), spec, 0, 1, te=False))
    te = dict(iter_hf_to_megatron(CheckpointReader(tiny_paths["qwen3"]), spec, 0, 1, te=True))

    def renamed(name):
        for old, new in key_map.items():
            name = name.replace("." + old, "." + new)
        return name

    assert {renamed(n) for n in local} == set(te)
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in te
    assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in te
    for name, tensor in local.items():
        assert torch.equal(te[renamed(name)], tensor)
    assert decoder_names(3, te=True)["input_norm"] == "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight"


def test_vocabulary_rows_are_padded_per_rank(tiny_paths):
    """Qwen's 151,936 rows split over 3 ranks pad to 151,938: the last rank's last rows are zeros."""
    from slime_mt.backends.megatron.convert import _vocab_shard

    reader = CheckpointReader(tiny_paths["qwen2"])
    spec = decoder_spec(read_hf_config(tiny_paths["qwen2"]))
    shards = [_vocab_shard(reader, "model.embed_tokens.weight", spec, r, 3) for r in range(3)]
    assert [s.shape[0] for s in shards] == [50646] * 3
    assert torch.equal(torch.cat(shards)[: spec.vocab_size], reader.get("model.embed_tokens.weight"))
    assert torch.count_nonzero(shards[-1][-2:]) == 0


@pytest.mark.parametrize(
    "lengths,rows,expected",
    [
        ([4], [[0]], 1.0),
        ([2, 2], [[0, 1]], 0.5),  # (4 + 4) / 16
        ([1, 1, 1, 1], [[0, 1, 2, 3]], 0.25),
        ([3, 1, 2], [[0, 1], [2]], (9 + 1 + 4) / (16 + 4)),
    ],
)
def test_useful_attention_fraction_by_hand(lengths, rows, expected):
    assert useful_attention_fraction(lengths, rows) == pytest.approx(expected)
