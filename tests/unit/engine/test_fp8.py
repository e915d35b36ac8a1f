"""Block-wise FP8 weights in the Hugging Face format (unit tier, ~3 s: the tiny models' tensors in
memory, no engine). ``BlockFp8`` quantizes and dequantizes as a reference written here from the format's
definition does, block by block, for every tensor of the tiny Qwen3, Qwen3-MoE and Qwen2.5-VL, in the
published 128 x 128 blocks (every tiny dimension one partial block) and in 16 x 24 blocks (several per
dimension, the last partial); the tensors it quantizes are the decoder's linear weights and every
expert's; a converted folder says so in ``quantization_config``; bad scales and configs are refused by
name."""

import json
import math
import re

import pytest
import torch

from slime_mt.engine.weights.fp8 import BlockFp8, convert_folder, dequantize_named, folder_format, quantize_stream
from slime_mt.errors import ConfigError, WeightUpdateError
from slime_mt.safetensors_files import load_hf_state

KINDS = ["qwen3", "qwen3-moe", "qwen2.5-vl"]
SMALL_BLOCK = BlockFp8((16, 24))
BLOCKS = [(128, 128), (16, 24)]
# the decoder's linear weights, every expert's included; nothing of the vision tower
LINEAR = re.compile(
    r"model\.(language_model\.)?layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(experts\.\d+\.)?(gate|up|down)_proj)\.weight"
)


def reference_quantize(weight: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The format's definition, one block at a time: scale_inv = amax / 448 (1 for an all-zero block),
    weight / scale_inv rounded to e4m3; the last block of a row or column holds what is left."""
    n, k = weight.shape
    q = torch.empty((n, k), dtype=torch.float8_e4m3fn)
    scale_inv = torch.empty((math.ceil(n / bn), math.ceil(k / bk)), dtype=torch.float32)
    for i in range(0, n, bn):
        for j in range(0, k, bk):
            block = weight[i : i + bn, j : j + bk].to(torch.float32)
            amax = float(block.abs().max())
            scale = torch.tensor(amax, dtype=torch.float32) / 448.0 if amax > 0 else torch.tensor(1.0)
            q[i : i + bn, j : j + bk] = (block / scale).to(torch.float8_e4m3fn)
            scale_inv[i // bn, j // bk] = scale
    return q, scale_inv


def reference_dequantize(q: torch.Tensor, scale_inv: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.float32)
    for i in range(0, q.shape[0], bn):
        for j in range(0, q.shape[1], bk):
            out[i : i + bn, j : j + bk] = q[i : i + bn, j : j + bk].to(torch.float32) * scale_inv[i // bn, j // bk]
    return out


@pytest.fixture(scope="module")
def states(tiny_paths):
    return {kind: load_hf_state(tiny_paths[kind]) for kind in KINDS}


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: f"{b[0]}x{b[1]}")
@pytest.mark.parametrize("kind", KINDS)
def test_every_tensor_quantizes_and_dequantizes_as_the_formats_definition(states, kind, block):
    state, fmt = states[kind], BlockFp8(block)
    out = dict(quantize_stream(state.items(), fmt))
    quantized = sorted(n for n, t in out.items() if t.dtype == torch.float8_e4m3fn)
    assert quantized == sorted(n for n in state if LINEAR.fullmatch(n))
    if kind == "qwen3-moe":
        routers = [n for n in state if n.endswith("mlp.gate.weight")]
        assert routers and sum(".experts." in n for n in quantized) == len(routers) * 8 * 3  # every expert
    assert set(out) == set(state) | {n + "_scale_inv" for n in quantized}
    for name, tensor in state.items():
        if name not in quantized:
            assert out[name] is tensor, name  # embeddings, norms, biases, routers, the vision tower
            continue
        q, scale_inv = reference_quantize(tensor, *block)
        assert torch.equal(out[name].view(torch.uint8), q.view(torch.uint8)), name
        assert out[name + "_scale_inv"].dtype == torch.float32 and torch.equal(out[name + "_scale_inv"], scale_inv)
        back = fmt.dequantize(out[name], out[name + "_scale_inv"], torch.float32)
        assert torch.equal(back, reference_dequantize(q, scale_inv, *block)), name
        # e4m3 keeps 3 mantissa bits: half a step is 1/16 of a normal value, 2^-10 of the scale below 2^-6
        bound = torch.maximum(
            tensor.abs() / 16,
            scale_inv.repeat_interleave(block[0], 0)[: tensor.shape[0]].repeat_interleave(block[1], 1)[
                :, : tensor.shape[1]
            ]
            * 2**-10,
        )
        assert bool(((back - tensor).abs() <= bound * (1 + 1e-6)).all()), name
    full = dequantize_named(out, fmt, torch.float32)
    assert full.keys() == state.keys()


def test_a_fused_expert_tensor_is_blocked_expert_by_expert():
    """Qwen3-VL-MoE publishes experts fused, ``[E, H, 2I]``: each expert's matrix has its own blocks."""
    g = torch.Generator().manual_seed(0)
    fused = torch.randn(3, 40, 72, generator=g) * torch.tensor([1.0, 10.0, 0.1]).view(3, 1, 1)
    (name, q), (scale_name, scale_inv) = quantize_stream(
        [("model.language_model.layers.0.mlp.experts.gate_up_proj", fused)], BlockFp8((16, 24))
    )
    assert scale_name == name + "_scale_inv" and scale_inv.shape == (3, 3, 3)
    for e in range(3):
        want_q, want_scale = reference_quantize(fused[e], 16, 24)
        assert torch.equal(q[e].view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scale_inv[e], want_scale)


def test_an_all_zero_block_has_scale_one_and_stays_zero():
    weight = torch.zeros(20, 30)
    weight[16:, 24:] = 3.0
    q, scale_inv = BlockFp8((16, 24)).quantize(weight)
    assert torch.equal(scale_inv, torch.tensor([[1.0, 1.0], [1.0, 3.0]]) / torch.tensor([[1.0, 1.0], [1.0, 448.0]]))
    assert torch.equal(BlockFp8((16, 24)).dequantize(q, scale_inv, torch.float32), weight)


def test_a_converted_folder_declares_its_format_and_keeps_the_rest(tiny_paths, tmp_path):
    source = tiny_paths["qwen3-moe"]
    target = convert_folder(source, tmp_path / "fp8", BlockFp8((128, 128)))
    config = json.loads((target / "config.json").read_text())
    quant = config.pop("quantization_config")
    assert config == json.loads((source / "config.json").read_text())
    assert {k: v for k, v in quant.items() if k != "modules_to_not_convert"} == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    kept = quant["modules_to_not_convert"]
    assert {"model.embed_tokens", "model.norm", "model.layers.0.mlp.gate", "model.layers.0.self_attn.q_norm"} <= set(
        kept
    )
    assert not any(LINEAR.fullmatch(m + ".weight") for m in kept)
    assert folder_format(target) == BlockFp8((128, 128))
    assert (target / "tokenizer.json").is_file() and not list(tmp_path.glob(".tmp_*"))
    with pytest.raises(ConfigError, match="already quantized"):
        convert_folder(target, tmp_path / "again", BlockFp8((128, 128)))
    assert not (tmp_path / "again").exists()


@pytest.mark.parametrize(
    "quant,match",
    [
        ({"quant_method": "awq"}, "'awq'"),
        ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "'e5m2'"),
        ({"quant_method": "fp8", "fmt": "e4m3"}, "no weight_block_size"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}, "ue8m0"),
        ({"quant_method": "fp8", "weight_block_size": [128, 0]}, "two positive integers"),
    ],
)
def test_a_quantization_config_not_served_is_refused_by_name(quant, match):
    with pytest.raises(ConfigError, match=match) as raised:
        BlockFp8.of_config({"quantization_config": quant}, "m/config.json")
    assert "m/config.json" in str(raised.value) or "two positive" in match
    assert BlockFp8.of_config({}, "m/config.json") is None


def test_scales_that_do_not_fit_their_weights_are_refused_by_name():
    fmt = BlockFp8((16, 24))
    q, scale_inv = fmt.quantize(torch.randn(40, 50))
    with pytest.raises(WeightUpdateError, match="'a.weight' is float8_e4m3fn without its 'a.weight_scale_inv'"):
        dequantize_named({"a.weight": q}, fmt, torch.float32)
    with pytest.raises(WeightUpdateError, match="'b.weight_scale_inv' scales no weight"):
        dequantize_named({"b.weight_scale_inv": scale_inv}, fmt, torch.float32)
    with pytest.raises(WeightUpdateError, match=r"weight 'a.weight': scale_inv of shape \(3, 2\) .* expected \(3, 3\)"):
        dequantize_named({"a.weight": q, "a.weight_scale_inv": scale_inv[:, :2]}, fmt, torch.float32)


def test_the_engines_folder_and_its_format_follow_the_flags(tiny_paths, tmp_path):
    """--rollout-quantization fp8 converts --hf-checkpoint into the run folder, or takes an FP8
    --rollout-checkpoint as it is (its own blocks); a folder in the other precision is refused by name."""
    from slime_mt.config import EngineConfig
    from slime_mt.engine.weights.fp8 import check_rollout_checkpoint, rollout_checkpoint

    hf = str(tiny_paths["qwen3"])
    assert rollout_checkpoint(EngineConfig(), hf, tmp_path) == (hf, None)
    fp8 = EngineConfig(rollout_quantization="fp8", rollout_quantization_block_size=[16, 24])
    folder, fmt = rollout_checkpoint(fp8, hf, tmp_path / "run")
    assert folder == str(tmp_path / "run" / "rollout_checkpoint") and fmt == BlockFp8((16, 24)) == folder_format(folder)
    given = EngineConfig(rollout_quantization="fp8", rollout_checkpoint=folder)  # its 16 x 24, not the default
    assert rollout_checkpoint(given, hf, tmp_path / "other") == (folder, BlockFp8((16, 24)))
    assert not (tmp_path / "other").exists()
    with pytest.raises(ConfigError, match=f"--rollout-checkpoint {folder} is FP8 .*add --rollout-quantization fp8"):
        check_rollout_checkpoint(EngineConfig(rollout_checkpoint=folder), hf)
    with pytest.raises(ConfigError, match=f"--rollout-checkpoint {hf}: not FP8"):
        check_rollout_checkpoint(EngineConfig(rollout_quantization="fp8", rollout_checkpoint=hf), hf)
    with pytest.raises(ConfigError, match="--rollout-checkpoint /nowhere: not a model folder"):
        check_rollout_checkpoint(EngineConfig(rollout_checkpoint="/nowhere"), hf)


def test_slime_mt_convert_fp8_writes_the_folder_and_names_a_bad_input(tiny_paths, tmp_path, capsys):
    from slime_mt.cli import main

    args = ["convert-fp8", "--model-dir", str(tiny_paths["qwen2"]), "--save-dir", str(tmp_path / "out")]
    assert main([*args, "--block-size", "16", "24"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "out") and folder_format(tmp_path / "out") == SMALL_BLOCK
    assert main(["convert-fp8", "--model-dir", str(tmp_path / "none"), "--save-dir", str(tmp_path / "x")]) == 2
    assert f"--model-dir {tmp_path / 'none'}: not a model folder" in capsys.readouterr().err
    assert main(["convert-fp8", "--model-dir", str(tmp_path / "out"), "--save-dir", str(tmp_path / "y")]) == 2
    assert "already quantized (fp8)" in capsys.readouterr().err and not (tmp_path / "y").exists()
