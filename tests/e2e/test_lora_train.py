"""``slime-mt train --lora-rank`` end to end (issue 71 items 2 and 3; e2e tier: one run of two steps on the
demo's game per engine and launch path, ~30 s each: the embedded engine launched by the run in one process
and under ``--ray``, and the shared vLLM server by ``--engine-url``; and ``slime-mt eval`` of the embedded
run's checkpoint, ~10 s): the engine serves the run's
adapter by name on its unchanged base, and each update sends only the adapter (a PEFT folder per version
through the disk transport: SGLang's ``/unload_lora_adapter``, ``/load_lora_adapter``,
``/update_weight_version``; vLLM's ``/v1/load_lora_adapter`` in place). Each token's log-prob as the run's
engine sampled it is the one peft gives on the base with the adapter of its version (version 1: the
checkpoint after one step, a PEFT folder), and not the base's; every checkpoint is the adapter alone, and
the offline evaluation serves the base with it folded in."""

import json
import subprocess
import sys

import httpx
import pytest
import torch
from train_helpers import PLUGINS, REPO, TWO_SMALL_STEPS, demo_train_cmd, metrics, run

from slime_mt.assets import VLLM_TINY_KIND, tiny_model_dir
from slime_mt.inspection.dumps import load_dump
from slime_mt.metrics import read_evals

TEMPERATURE = 0.6  # the demo's rollout temperature: the engine's log-probs are log_softmax(logits / T)
LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--target-modules", "all-linear", "--lr", "1e-2"]


def scored(model, tokens: list[int], start: int) -> list[float]:
    """log_softmax(logits / T) of ``tokens[start:]`` given what precedes each, in one forward pass."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0].float()
    logp = torch.log_softmax(logits[start - 1 : -1] / TEMPERATURE, -1)
    return logp.gather(-1, torch.tensor(tokens[start:])[:, None])[:, 0].tolist()


@pytest.fixture(scope="module", params=["local", "vllm", "ray"])
def lora_run(request, tmp_path_factory):
    """(folder, run folder, checkpoints, command, model, steps) of the LoRA run on ``request.param``'s engine:
    the embedded one on the tiny Qwen3, two steps, in one process or under ``--ray`` on three loopback nodes
    (the adapter over the disk transport there too), or the shared vLLM server on the tiny Qwen2 at head size
    64, three (its first step's group all fails the game, so the adapter first moves at the second; the
    server's adapter is unloaded and version "0" put back after the run)."""
    root = tmp_path_factory.mktemp(f"lora_run_{request.param}")
    subprocess.run([sys.executable, str(REPO / "examples/demo/make_data.py"), str(root / "data")], check=True, cwd=REPO)
    (root / "plugins.py").write_text(PLUGINS)
    run_dir, ckpt = root / "run", root / "ckpt"
    flags = [*TWO_SMALL_STEPS, *LORA, "--custom-rm-path", f"{root}/plugins.py:rm", "--weight-transport", "disk"]
    flags += [
        "--save",
        str(ckpt),
        "--save-interval",
        "1",
        "--save-debug-rollout-data",
        str(root / "dumps/{rollout_id}.pt"),
    ]
    model, steps = tiny_model_dir("qwen3"), 2
    if request.param == "vllm":
        model, target, steps = tiny_model_dir(VLLM_TINY_KIND), request.getfixturevalue("vllm_target"), 3
        flags += ["--engine", "vllm", "--engine-url", target.url, "--num-rollout", "3"]
    elif request.param == "ray":  # the engine started by its actor on a node of its own
        flags += ["--ray", "--ray-address", request.getfixturevalue("three_nodes").address]
        flags += ["--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1"]
        flags += ["--num-gpus-per-node", "1", "--rollout-num-gpus", "1"]
    cmd = demo_train_cmd(model, root / "data/train.jsonl", run_dir, *flags)
    try:
        proc = run(cmd)
    finally:
        if request.param == "vllm":  # the shared server as it was
            httpx.post(f"{target.url}/v1/unload_lora_adapter", json={"lora_name": "policy"}, timeout=60)
            httpx.post(f"{target.url}/update_weight_version", json={"new_version": "0"}, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root, run_dir, ckpt, cmd, model, steps


def test_the_engine_serves_the_adapter_of_each_version_on_its_base(lora_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root, run_dir, ckpt, _, model, steps = lora_run
    rows = metrics(run_dir)
    assert [r["rollout/weight_version"] for r in rows] == [float(v) for v in range(1, steps + 1)]
    base = AutoModelForCausalLM.from_pretrained(model).eval()
    models = {0: base}
    for v in range(1, steps):
        plain = AutoModelForCausalLM.from_pretrained(model)
        models[v] = PeftModel.from_pretrained(plain, str(ckpt / f"iter_{v:07d}")).eval()
    gaps, from_base, versions = {}, 0.0, set()
    for step in range(steps):
        for s in load_dump(root / f"dumps/{step}.pt")["samples"]:
            start = s["prompt_length"]
            for v in set(s["token_versions"]):
                got, plain = scored(models[v], s["tokens"], start), scored(base, s["tokens"], start)
                for j, (want, mask, version) in enumerate(
                    zip(s["rollout_log_probs"], s["loss_mask"], s["token_versions"])
                ):
                    if mask and version == v:  # a sampled token (observations have no engine log-prob)
                        gaps[v] = max(gaps.get(v, 0.0), abs(got[j] - want))
                        if v > 0:
                            from_base = max(from_base, abs(plain[j] - want))
                        versions.add(v)
    assert versions == set(range(steps)) and max(gaps.values()) < 1e-4 < from_base / 10, (gaps, from_base)


def test_each_update_and_checkpoint_is_the_adapter_alone(lora_run):
    _, run_dir, ckpt, _, _, steps = lora_run
    kept = sorted(p.name for p in (run_dir / "weights").iterdir())
    assert kept == [f"v{steps - 1}", f"v{steps}"]  # --keep-weight-versions 1: the newest and the one before
    for name in kept:
        files = sorted(p.name for p in (run_dir / "weights" / name).iterdir())
        assert files == ["adapter_config.json", "adapter_model.safetensors"]
        config = json.loads((run_dir / "weights" / name / "adapter_config.json").read_text())
        assert (config["r"], config["lora_alpha"]) == (4, 8.0)
    assert (ckpt / f"iter_{steps:07d}" / "adapter_model.safetensors").is_file()
    assert not list((ckpt / f"iter_{steps:07d}").glob("model*.safetensors"))


@pytest.mark.parametrize("lora_run", ["local"], indirect=True)  # an eval of its own: not on the shared server
def test_slime_mt_eval_serves_the_base_with_the_checkpoints_adapter_folded_in(lora_run, tmp_path):
    root, _, ckpt, cmd, _, _ = lora_run
    flags = cmd[cmd.index("train") + 1 :]
    flags[flags.index("--log-dir") + 1] = str(tmp_path)
    flags += ["--eval-prompt-data", "demo", str(root / "data/eval.jsonl"), "--n-samples-per-eval-prompt", "1"]
    proc = run([sys.executable, "-m", "slime_mt.cli", "eval", *flags, "--load", str(ckpt)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = read_evals(tmp_path)
    assert row["step"] == 2 and row["eval/demo/samples"] > 0
    assert (tmp_path / "merged_iter_0000002" / "config.json").is_file()
