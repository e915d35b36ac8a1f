"""Adapter folders ``--lora-adapter-path`` and a LoRA run's ``--load`` read (issue 71 items 2 and 6): the
names and shapes the trainer expects are those ``peft`` writes for the same model (a text model and a VLM,
whose decoder sits under ``model.language_model.``), and an adapter of another rank, alpha, layer set or base
model, or one whose q, k and v have an A each, is refused naming the flag and the tensor. Unit tier: peft
on two tiny models, about 6 s."""

import json
import shutil

import pytest
import torch
from lora_helpers import PROJECTIONS, peft_adapter
from safetensors.torch import load_file, save_file

from slime_mt.assets import tiny_model_dir
from slime_mt.backends.megatron.families import decoder_spec, read_hf_config
from slime_mt.backends.megatron.peft import check_adapter, write_merged
from slime_mt.errors import CheckpointError

ALL = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def spec_of(kind: str):
    return decoder_spec(read_hf_config(tiny_model_dir(kind)), kind)


@pytest.fixture(scope="module")
def peft_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {kind: (peft_adapter(kind, root / kind), root / kind) for kind in ("qwen3", "qwen2.5-vl")}


@pytest.fixture(scope="module")
def adapters(peft_models):
    return {kind: folder for kind, (_, folder) in peft_models.items()}


@pytest.mark.parametrize("kind", ["qwen3", "qwen2.5-vl"])
def test_pefts_own_adapter_has_the_names_and_shapes_the_trainer_expects(adapters, kind):
    check_adapter(adapters[kind], spec_of(kind), ALL, 4, 8.0)  # raises on any difference
    names = load_file(adapters[kind] / "adapter_model.safetensors")
    decoder = "base_model.model.model." + ("language_model." if kind.endswith("-vl") else "")
    assert len(names) == 2 * len(PROJECTIONS) * spec_of(kind).num_layers and all(n.startswith(decoder) for n in names)


def rewritten(src, dst, config=None, tensors=None):
    """A copy of the adapter folder ``src`` with its config's keys and tensors replaced."""
    shutil.copytree(src, dst)
    if config:
        file = dst / "adapter_config.json"
        file.write_text(json.dumps({**json.loads(file.read_text()), **config}))
    if tensors:
        save_file({**load_file(dst / "adapter_model.safetensors"), **tensors}, dst / "adapter_model.safetensors")
    return dst


def test_an_adapter_that_does_not_fit_is_refused_naming_what_differs(adapters, tmp_path):
    src, spec = adapters["qwen3"], spec_of("qwen3")
    with pytest.raises(CheckpointError, match=r"the adapter has r=4; --lora-rank 8"):
        check_adapter(src, spec, ALL, 8, 8.0)
    with pytest.raises(CheckpointError, match=r"the adapter has lora_alpha=8; --lora-alpha 16.0"):
        check_adapter(src, spec, ALL, 4, 16.0)
    with pytest.raises(CheckpointError, match=r"the adapter targets \[.*'down_proj'.*\]; --target-modules resolves"):
        check_adapter(src, spec, ("linear_qkv",), 4, 8.0)
    with pytest.raises(CheckpointError, match=r"an adapter of another model: 28 tensors this model needs are missing"):
        check_adapter(src, spec_of("qwen2.5-vl"), ALL, 4, 8.0)  # names of a text model, a VLM's decoder
    q_b = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    wide = rewritten(src, tmp_path / "wide", tensors={q_b: torch.zeros(2 * spec.num_heads * spec.head_dim, 4)})
    with pytest.raises(CheckpointError, match=rf"{q_b} is \[{2 * spec.num_heads * spec.head_dim}, 4\] in the adapter"):
        check_adapter(wide, spec, ALL, 4, 8.0)
    with pytest.raises(CheckpointError, match=r"no adapter_config.json \(not a PEFT adapter folder\)"):
        check_adapter(tmp_path, spec, ALL, 4, 8.0)


def test_an_adapter_with_an_a_for_each_of_q_k_and_v_is_refused(tmp_path):
    peft_adapter("qwen3", tmp_path / "separate", shared_a=False)
    with pytest.raises(CheckpointError, match=r"layers.0.self_attn.\{q_proj,k_proj,v_proj\} have different lora_A"):
        check_adapter(tmp_path / "separate", spec_of("qwen3"), ALL, 4, 8.0)


@pytest.mark.parametrize("kind", ["qwen3", "qwen2.5-vl"])
def test_the_merged_model_computes_what_peft_does(peft_models, kind, tmp_path):
    """``write_merged`` (``slime-mt export-merged``; eval of a LoRA checkpoint) folds the adapter into the
    base's weights: transformers on the folder computes peft's logits, and an adapter naming a weight the base
    lacks is refused."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    model, folder = peft_models[kind]
    merged = write_merged(tiny_model_dir(kind), folder, tmp_path / "merged")
    loader = AutoModelForImageTextToText if kind.endswith("-vl") else AutoModelForCausalLM
    plain = loader.from_pretrained(merged).eval()
    ids = torch.randint(0, 100, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = model(input_ids=ids).logits, plain(input_ids=ids).logits
        unadapted = loader.from_pretrained(tiny_model_dir(kind)).eval()(input_ids=ids).logits
    assert float((want - got).abs().max()) < 1e-5 < float((want - unadapted).abs().max())
    stray = "base_model.model.model.layers.0.self_attn.qkv_proj.lora_A.weight"
    bad = rewritten(folder, tmp_path / "bad", tensors={stray: torch.zeros(4, 4)})
    with pytest.raises(CheckpointError, match=rf"1 adapters name no weight of .* \(first: {stray}\)"):
        write_merged(tiny_model_dir(kind), bad, tmp_path / "merged2")
    assert not (tmp_path / "merged2").exists()


def test_slime_mt_export_merged_writes_the_folder_and_names_a_bad_adapter(adapters, tmp_path, capsys):
    from slime_mt.cli import main

    base = str(tiny_model_dir("qwen3"))
    out = tmp_path / "merged"
    assert (
        main(
            [
                "export-merged",
                "--hf-checkpoint",
                base,
                "--lora-adapter-path",
                str(adapters["qwen3"]),
                "--save-dir",
                str(out),
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.strip() == str(out) and (out / "config.json").is_file()
    assert (
        main(["export-merged", "--hf-checkpoint", base, "--lora-adapter-path", str(tmp_path), "--save-dir", str(out)])
        == 2
    )
    assert f"{tmp_path}: no adapter_config.json (not a PEFT adapter folder)" in capsys.readouterr().err


def test_an_adapters_scale_is_pefts_and_a_folder_without_a_lora_config_is_named(tmp_path):
    """adapter_scale: lora_alpha / r, / sqrt(r) under rsLoRA, and peft's own default alpha where a config
    leaves it out (the engine and the merged export read it alike)."""
    from peft import LoraConfig

    from slime_mt.engine.weights.adapters import adapter_scale, read_adapter_config

    assert adapter_scale({"r": 4, "lora_alpha": 16}) == 4.0
    assert adapter_scale({"r": 4, "lora_alpha": 16, "use_rslora": True}) == 8.0
    assert adapter_scale({"r": 4}) == LoraConfig(r=4).lora_alpha / 4
    with pytest.raises(ValueError, match=r"no adapter_config.json \(not a PEFT adapter folder\)"):
        read_adapter_config(tmp_path)
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "IA3"}')
    with pytest.raises(ValueError, match="a IA3 adapter, not LoRA"):
        read_adapter_config(tmp_path)
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 0}')
    with pytest.raises(ValueError, match="r=0 in adapter_config.json"):
        read_adapter_config(tmp_path)
