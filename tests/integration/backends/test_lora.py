"""LoRA adapters on Megatron's parallel linear layers (issue 71 items 1 and 2, at TP, SP, PP, CP and EP; integration
tier: the ``lora`` check in five worlds already launched for other checks, 8-20 s in each, and ``lora_resume`` in
tp2sp's and pp2's, about 8 s each): fresh adapters change no
log-prob, only the adapters are trained, the base stays bit for bit, the weights sent to the engines are the
base with the adapters folded in (transformers on them computes what the adapted Megatron model does), the
adapters export in PEFT's format (peft on the base computes the same), a step at TP=2 with sequence
parallelism, at PP=2 and at CP=2 (and a MoE model's, adapters on its attention, at EP=2) equals the step at
TP=1 (adapter gradients within 1e-6, adapters after it within 1e-5), and a LoRA run's checkpoint is a PEFT
folder that resumes bit for bit at its layout, and at TP=2 with SP and at PP=2, and that --lora-adapter-path
starts from."""

import json

import pytest
import torch
from megatron_checks.adapters import FLAGS, LORA_KINDS, MOE_KIND
from megatron_worlds import WORLDS

from slime_mt.assets import tiny_model_dir
from slime_mt.backends.megatron.families import decoder_spec, read_hf_config
from slime_mt.backends.megatron.memory_plan import lora_parameters
from slime_mt.backends.megatron.parallel import Stage
from slime_mt.config import TrainConfig

WORLDS_OF = {"tp1": "ep1_resume", "tp2_sp": "tp2_state"}
LAYOUTS = {**WORLDS_OF, "tp1_pp2": "pp2", "tp1_cp2": "cp2", "tp1_ep2": "ep2"}  # the layouts whose step is TP=1's
TP = {"tp1": 1, "tp2_sp": 2, "tp1_pp2": 1, "tp1_cp2": 1, "tp1_ep2": 1}
# (layout, family): the dense text model and the VLM at every layout but EP, the MoE model at TP=1 and EP=2
RUNS = [(tag, kind) for tag in LAYOUTS if tag != "tp1_ep2" for kind in LORA_KINDS]
RUNS += [("tp1", MOE_KIND), ("tp1_ep2", MOE_KIND)]
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
PROJECTIONS = (*ATTENTION, "gate_proj", "up_proj", "down_proj")


def adapted(kind: str) -> tuple[str, ...]:
    """The HF projections ``kind``'s LoRA run adapts (a MoE model's attention only)."""
    return ATTENTION if kind == MOE_KIND else PROJECTIONS


def layers_of(kind: str) -> int:
    config = json.loads((tiny_model_dir(kind) / "config.json").read_text())
    return config.get("text_config", config)["num_hidden_layers"]


@pytest.mark.parametrize(("tag", "kind"), RUNS)
def test_only_the_adapters_train_fresh_ones_change_nothing_and_the_reference_is_the_base(world, tag, kind):
    assert "lora" in WORLDS[LAYOUTS[tag]][2]
    r = world(LAYOUTS[tag])["lora"][kind]
    assert r["fresh_gap"] == 0.0  # B starts at zero: the adapted model computes exactly what its base does
    stage = range(*r["stage_layers"])  # rank 0's pipeline stage: half the layers at PP=2
    assert len(stage) == layers_of(kind) // (2 if tag.endswith("pp2") else 1)
    # linear_qkv, linear_proj, linear_fc1, linear_fc2 of every layer (a MoE model's first two)
    assert r["adapters"] == (2 if kind == MOE_KIND else 4) * len(stage)
    assert r["trainable"] == 2 * r["adapters"] and r["trainable_all_adapters"]
    assert r["optimized_numel"] == r["adapter_numel"] > 0  # the base never reaches the optimizer
    # the memory plan counts this rank's adapters as the model has them
    spec = decoder_spec(read_hf_config(tiny_model_dir(kind)), kind)
    assert lora_parameters(spec, TrainConfig(**FLAGS[kind]), TP[tag], Stage(stage)) == r["adapter_numel"]
    assert r["base_unchanged"] and r["b_moved"] and r["grad_norm"] > 0
    # --use-kl-loss: the reference is the policy with its adapters off (no second copy), the base exactly
    assert not r["reference_copy"] and r["reference_gap"] == 0.0 < r["policy_moved"]


@pytest.mark.parametrize("kind", [*LORA_KINDS, MOE_KIND])
def test_the_engines_get_the_base_with_the_adapters_folded_in(world, megatron_dir, kind):
    world("ep1_resume")
    run = torch.load(megatron_dir / f"lora_tp1_{kind}.pt", weights_only=True)
    # every projection of every layer changed, and nothing else (embeddings, norms, the vision tower)
    suffixes = {name.rsplit(".", 2)[-2] for name in run["changed"]}
    assert suffixes == set(adapted(kind)) and len(run["changed"]) == len(adapted(kind)) * layers_of(kind)


def test_transformers_on_the_merged_weights_computes_what_the_adapted_model_does(world):
    r = world("ep1_resume")["lora"]["qwen3"]
    assert r["hf_unexpected"] == [] and set(r["hf_missing"]) <= {"lm_head.weight"}  # tied to the embedding
    assert r["hf_gap"] < 1e-4  # logits, fp32


@pytest.mark.parametrize(("tag", "kind"), [(tag, kind) for tag, kind in RUNS if tag != "tp1"])
def test_a_step_at_tp2_sp_pp2_cp2_and_ep2_equals_the_step_at_tp1(world, megatron_dir, tag, kind):
    """The adapters' gradients (PEFT-named, every stage's) within 1e-6 and the adapters after the step within
    1e-5 of TP=1's; loss, grad norm, the log-probs after the step and the merged weights the engines get too."""
    world("ep1_resume"), world(LAYOUTS[tag])
    one, two = (torch.load(megatron_dir / f"lora_{t}_{kind}.pt", weights_only=True) for t in ("tp1", tag))
    assert abs(one["loss"] - two["loss"]) <= 1e-6 + 1e-5 * abs(one["loss"])
    assert abs(one["grad_norm"] - two["grad_norm"]) <= 1e-5 * one["grad_norm"]
    assert float((one["logprobs"] - two["logprobs"]).abs().max()) < 1e-5
    assert len(one["grads"]) == 2 * len(adapted(kind)) * layers_of(kind)
    for key, bound in (("grads", 1e-6), ("adapter_tensors", 1e-5), ("weights", 1e-6)):
        assert one[key].keys() == two[key].keys(), key
        for name, tensor in one[key].items():
            assert float((tensor - two[key][name]).abs().max()) < bound, (key, name)
    assert one["changed"] == two["changed"]


@pytest.mark.parametrize(("tag", "kind"), [(tag, kind) for tag, kind in RUNS if tag != "tp1"])
def test_the_adapters_export_in_pefts_format_and_peft_computes_the_same(world, megatron_dir, tag, kind):
    """adapter_config.json and adapter_model.safetensors, HF module names, q/k/v and gate/up unpacked from
    Megatron's fused layers, every pipeline stage's: peft.PeftModel on the base computes the adapted Megatron
    model's logits at TP=1, and the export at TP=2 with SP, PP=2, CP=2 and EP=2 is TP=1's (within the 1e-5
    the adapters after the step are held to)."""
    from safetensors.torch import load_file

    assert world("ep1_resume")["lora"][kind]["peft_gap"] < 1e-4
    world(LAYOUTS[tag])
    one, two = (megatron_dir / f"peft_{t}_{kind}" for t in ("tp1", tag))
    config = json.loads((one / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8.0)
    assert sorted(config["target_modules"]) == sorted(adapted(kind))
    assert json.loads((two / "adapter_config.json").read_text()) == config
    a, b = load_file(one / "adapter_model.safetensors"), load_file(two / "adapter_model.safetensors")
    assert len(a) == 2 * len(adapted(kind)) * layers_of(kind) and a.keys() == b.keys()
    decoder = "base_model.model.model." + ("language_model." if kind.endswith("-vl") else "")
    assert all(name.startswith(decoder + "layers.") for name in a)  # transformers' module paths
    for name, tensor in a.items():
        assert float((tensor - b[name]).abs().max()) < 1e-5, name


@pytest.mark.parametrize("kind", LORA_KINDS)
def test_a_lora_checkpoint_is_a_peft_folder_and_resumes_bitwise(world, megatron_dir, kind):
    """--save of a LoRA run writes its adapters only, as a PEFT folder (peft on the base computes the
    adapted model's logits), with the adapters' optimizer state; --load resumes it for the same next step bit
    for bit, and --lora-adapter-path starts from it (the same log-probs, step 0)."""
    r = world("ep1_resume")["lora"][kind]
    folder = megatron_dir / f"lora_ckpt_{kind}" / "iter_0000001"
    files = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    assert {"adapter_config.json", "adapter_model.safetensors", "trainer_state.json"} <= files
    assert {"optimizer/exp_avg/adapter_model.safetensors", "optimizer/exp_avg_sq/adapter_model.safetensors"} <= files
    assert not any(f.startswith("model") or f == "config.json" for f in files)  # the base is --hf-checkpoint's
    assert r["ckpt_peft_gap"] < 1e-4
    assert r["resumed_step"] == 1 and r["resumed_extra"] == {"data_cursor": 1} and r["resume_bitwise"]
    assert r["warm_gap"] == 0.0 and r["warm_step"] == 0


@pytest.mark.parametrize("kind", LORA_KINDS)
@pytest.mark.parametrize(("tag", "name"), [("tp2_sp", "tp2sp"), ("tp1_pp2", "pp2")])
def test_a_lora_checkpoint_of_tp1_resumes_at_tp2_with_sp_and_at_pp2(world, megatron_dir, tag, name, kind):
    """TP=2 with SP and PP=2 load TP=1's checkpoint (its log-probs on loading are TP=1's) and the next step
    gives TP=1's adapters: within 0.02 x lr, Adam's second step turning float32 noise in a gradient near zero
    into a step of a few ulps of lr (9e-6 in one element of a VLM's gate/up A here, 7e-7 elsewhere)."""
    r = world(name)["lora_resume"][kind]
    assert r["resumed_step"] == 1 and r["resumed_extra"] == {"data_cursor": 1}
    at_one, at_two = (torch.load(megatron_dir / f"lora_resumed_{t}_{kind}.pt", weights_only=True) for t in ("tp1", tag))
    step_one = torch.load(megatron_dir / f"lora_tp1_{kind}.pt", weights_only=True)
    assert float((at_two["logprobs"] - step_one["logprobs"]).abs().max()) < 1e-5
    assert at_one["adapters"].keys() == at_two["adapters"].keys() and len(at_one["adapters"]) > 0
    for name, tensor in at_one["adapters"].items():
        assert float((tensor - at_two["adapters"][name]).abs().max()) < 0.02 * 1e-3, name
