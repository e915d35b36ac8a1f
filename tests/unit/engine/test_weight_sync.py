"""Weight folders for engines outside the trainer's process, and how SGLang engines are launched."""

import pytest
import torch
from safetensors.torch import load_file

from slime_mt.config import EngineConfig, extra_arg
from slime_mt.engine.launch import engine_config_for, sglang_command, vllm_command
from slime_mt.engine.weights.sync import WeightFolders
from slime_mt.errors import ConfigError

TENSORS = [("model.norm.weight", torch.ones(4)), ("lm_head.weight", torch.zeros(3, 4))]


def names(root):
    return sorted(p.name for p in root.iterdir())


@pytest.mark.parametrize("keep, left", [(0, ["v5"]), (1, ["v4", "v5"]), (2, ["v3", "v4", "v5"])])
def test_only_the_served_version_and_the_kept_ones_stay(tmp_path, keep, left):
    folders = WeightFolders(tmp_path / "weights", keep)
    for version in range(1, 6):
        folder = folders.write(version, iter(TENSORS))
        assert (folder / "model.safetensors.index.json").is_file() or list(folder.glob("*.safetensors"))
        folders.acknowledged(version)
        assert len(names(tmp_path / "weights")) <= keep + 1
    assert names(tmp_path / "weights") == left
    loaded = {k: v for f in (tmp_path / "weights" / "v5").glob("*.safetensors") for k, v in load_file(f).items()}
    assert torch.equal(loaded["lm_head.weight"], TENSORS[1][1])


def test_nothing_is_deleted_before_every_engine_acknowledged_a_newer_version(tmp_path):
    """An update that failed (or still runs) acknowledges nothing: the folder an engine may be
    reading, and the one it serves, both stay."""
    folders = WeightFolders(tmp_path / "weights", keep=0)
    folders.write(1, iter(TENSORS))
    folders.acknowledged(1)
    folders.write(2, iter(TENSORS))  # the update to v2 failed on an engine: no acknowledgement
    folders.write(3, iter(TENSORS))
    assert names(tmp_path / "weights") == ["v1", "v2", "v3"]
    assert folders.acknowledged(3) == [tmp_path / "weights" / "v1", tmp_path / "weights" / "v2"]
    assert names(tmp_path / "weights") == ["v3"]


def test_folders_an_earlier_run_left_are_deleted_at_start_and_nothing_else(tmp_path):
    root = tmp_path / "weights"
    for name in ("v3", "v7", ".tmp_v8", "notes", "vanilla"):
        (root / name).mkdir(parents=True)
    (root / "README").write_text("kept")
    WeightFolders(root, keep=1)
    assert names(root) == ["README", "notes", "vanilla"]


def test_sglang_is_launched_with_the_runs_starting_weight_version():
    cmd = sglang_command("/models/m", 30000, tp_size=2, extra_args="--dp-size 2", weight_version="12")
    assert cmd[cmd.index("--weight-version") + 1] == "12"
    assert cmd[cmd.index("--tp-size") + 1] == "2" and cmd[-2:] == ["--dp-size", "2"]
    default = sglang_command("/models/m", 30000)
    assert default[default.index("--weight-version") + 1] == "0"


@pytest.mark.parametrize("oldest_first", [False, True])
@pytest.mark.parametrize("routed", [False, True])
def test_launched_engines_get_the_flags_the_run_needs_once(routed, oldest_first):
    """--use-rollout-routing-replay: SGLang returns routed experts; --oldest-groups-first: SGLang and vLLM
    schedule by request priority. A flag the user already passed is not added twice; neither: unchanged."""
    engine = EngineConfig(sglang_extra_args="--dp-size 2", vllm_extra_args="--max-num-seqs 8")
    got = engine_config_for(engine, routed, oldest_first)
    sglang = sglang_command("/m", 1, extra_args=got.sglang_extra_args)
    vllm = vllm_command("python", "/m", 1, extra_args=got.vllm_extra_args)
    assert ("--enable-return-routed-experts" in sglang) == routed
    assert ("--enable-priority-scheduling" in sglang) == oldest_first
    assert (vllm[-2:] == ["--scheduling-policy", "priority"]) == oldest_first
    assert sglang.count("--dp-size") == 1 and "--max-num-seqs" in vllm
    if not (routed or oldest_first):
        assert got is engine
    again = engine_config_for(got, routed, oldest_first)
    assert again.sglang_extra_args == got.sglang_extra_args and again.vllm_extra_args == got.vllm_extra_args


def test_a_flag_the_user_gave_with_an_equals_sign_is_not_added_again():
    engine = EngineConfig(
        sglang_extra_args="--enable-priority-scheduling", vllm_extra_args="--scheduling-policy=priority"
    )
    got = engine_config_for(engine, False, True)
    assert got.sglang_extra_args == "--enable-priority-scheduling"
    assert got.vllm_extra_args == "--scheduling-policy=priority"
    assert extra_arg("--a 1 --b=x --c --d", "--b") == "x" and extra_arg("--a 1 --c --d", "--c") == ""
    assert extra_arg("--a 1", "--a") == "1" and extra_arg("--ab 1", "--a") is None and extra_arg(None, "--a") is None


def test_a_lora_runs_engines_serve_its_adapter_where_they_can():
    """--lora-rank: embedded, SGLang and vLLM engines over the in-process or disk transport serve the
    adapter by name (SGLang launched with --enable-lora, the rank and the projections; vLLM with
    --enable-lora, the smallest rank it takes at or above the run's, one adapter per batch), and so do Ray's
    over the disk transport; the broadcast transports take merged weights; vLLM refuses a rank above 512."""
    from slime_mt.config.training import adapter_updates
    from slime_mt.config_parsing import parse_config
    from slime_mt.engine.launch import lora_flags, lora_serving

    base = [
        "--hf-checkpoint",
        "m",
        "--prompt-data",
        "d.jsonl",
        "--lora-rank",
        "8",
        "--target-modules",
        "q_proj,k_proj,v_proj",
    ]
    cfg = parse_config(base + ["--engine", "sglang"])
    lora = lora_serving(cfg)
    assert adapter_updates(cfg) and lora.max_lora_rank == 8
    sglang = sglang_command(
        "/m", 1, extra_args=engine_config_for(cfg.engine, False, False, lora_flags(lora, cfg.train)).sglang_extra_args
    )
    assert "--enable-lora" in sglang and sglang[sglang.index("--max-lora-rank") + 1] == "8"
    assert sglang[sglang.index("--lora-target-modules") + 1 :][:3] == ["q_proj", "k_proj", "v_proj"]
    cfg = parse_config(base + ["--engine", "vllm", "--lora-rank", "12"])
    assert adapter_updates(cfg)
    settings = engine_config_for(cfg.engine, False, False, lora_flags(lora_serving(cfg), cfg.train, "vllm"))
    vllm = vllm_command("python", "/m", 1, extra_args=settings.vllm_extra_args)
    assert settings.sglang_extra_args is None and "--enable-lora" in vllm
    assert vllm[vllm.index("--max-lora-rank") + 1] == "16" and vllm[vllm.index("--max-loras") + 1] == "1"
    with pytest.raises(ConfigError, match=r"--lora-rank=1024: vLLM serves adapters of rank up to 512"):
        parse_config(base + ["--engine", "vllm", "--lora-rank", "1024"])
    for flags in (["--engine", "vllm", "--weight-transport", "distributed"], ["--weight-transport", "distributed"]):
        assert not adapter_updates(parse_config(base + flags)) and lora_serving(parse_config(base + flags)) is None
    # under --ray the adapter alone travels over the disk transport; auto there is the broadcast (merged)
    assert adapter_updates(parse_config(base + ["--ray", "--weight-transport", "disk"]))
    assert not adapter_updates(parse_config(base + ["--ray"]))
    assert not adapter_updates(parse_config(base[:4]))  # no --lora-rank: full weights
