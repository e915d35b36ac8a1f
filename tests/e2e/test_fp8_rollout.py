"""``slime-mt train --rollout-quantization fp8`` (e2e tier, ~35 s a run): the demo's two-turn game on the
tiny Qwen3-MoE (its experts quantized too), two steps in sync mode and three in ``--fully-async``, TIS on. The
embedded engine starts from an FP8 copy of ``--hf-checkpoint`` converted into the run folder (16 x 24
blocks: several per dimension, the last one partial) and takes the trainer's weights quantized at every
update. Each token's log-prob as the run's engine sampled it is the one a fresh load of its version's
weights, quantized the same way, gives (version 0: the converted folder; version v: the checkpoint after
v steps), and not the one the full-precision weights give; the gap metrics are logged."""

import subprocess
import sys

import pytest
import torch
from train_helpers import PLUGINS, REPO, TWO_SMALL_STEPS, demo_train_cmd, metrics, run

from slime_mt.assets import tiny_model_dir
from slime_mt.engine.embedded.runner import ModelRunner
from slime_mt.engine.weights.fp8 import BlockFp8, convert_folder, folder_format
from slime_mt.inspection.dumps import load_dump

BLOCK = BlockFp8((16, 24))
TEMPERATURE = 0.6  # the demo's rollout temperature: the engine's log-probs are log_softmax(logits / T)


def scored(runner: ModelRunner, tokens: list[int], start: int) -> list[float]:
    """log_softmax(logits / T) of ``tokens[start:]`` given what precedes each, in one forward pass."""
    with torch.no_grad():
        logits = runner.model(input_ids=torch.tensor([tokens])).logits[0].float()
    logp = torch.log_softmax(logits[start - 1 : -1] / TEMPERATURE, -1)
    return logp.gather(-1, torch.tensor(tokens[start:])[:, None])[:, 0].tolist()


@pytest.mark.parametrize("mode", ["sync", "fully_async"])
def test_the_engine_serves_every_update_quantized(tmp_path, mode):
    data = tmp_path / "data"
    subprocess.run([sys.executable, str(REPO / "examples/demo/make_data.py"), str(data)], check=True, cwd=REPO)
    (tmp_path / "plugins.py").write_text(PLUGINS)
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    flags = [*TWO_SMALL_STEPS, "--custom-rm-path", f"{tmp_path}/plugins.py:rm", "--use-tis"]
    flags += ["--rollout-quantization", "fp8", "--rollout-quantization-block-size", "16", "24"]
    flags += ["--save", str(ckpt), "--save-interval", "1"]
    flags += ["--save-debug-rollout-data", str(tmp_path / "dumps/{rollout_id}.pt")]
    steps = 2
    if mode == "fully_async":  # a third step: the second's groups were all sampled before the first update
        steps = 3
        flags += ["--fully-async", "--max-staleness", "1", "--num-rollout", "3"]
    model = tiny_model_dir("qwen3-moe")
    proc = run(demo_train_cmd(model, data / "train.jsonl", run_dir, *flags))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert folder_format(run_dir / "rollout_checkpoint") == BLOCK
    rows = metrics(run_dir)
    assert [r["rollout/weight_version"] for r in rows] == [float(v) for v in range(1, steps + 1)]
    for r in rows:
        assert r["train/train_rollout_logprob_abs_diff_max"] >= r["train/train_rollout_logprob_abs_diff"] > 0
        assert 0.0 <= r["train/tis_clipped_fraction"] <= 1.0
    # every sampled token against a fresh load of its version, quantized and not
    served = {0: run_dir / "rollout_checkpoint"}
    full = {0: model}
    for v in range(1, steps + 1):
        full[v] = ckpt / f"iter_{v:07d}"
        served[v] = convert_folder(full[v], tmp_path / f"fp8_v{v}", BLOCK)
    runners = {(v, q): ModelRunner((served if q else full)[v]) for v in served for q in (True, False)}
    gaps = {True: 0.0, False: 0.0}
    versions = set()
    for step in range(steps):
        for s in load_dump(tmp_path / f"dumps/{step}.pt")["samples"]:
            start = s["prompt_length"]
            for quantized in (True, False):
                for v in set(s["token_versions"]):
                    got = scored(runners[(v, quantized)], s["tokens"], start)
                    for j, (want, mask, version) in enumerate(
                        zip(s["rollout_log_probs"], s["loss_mask"], s["token_versions"])
                    ):
                        if mask and version == v:  # a sampled token (observations have no engine log-prob)
                            gaps[quantized] = max(gaps[quantized], abs(got[j] - want))
                            versions.add(v)
    assert versions >= {0, 1}  # the converted folder's tokens and an update's
    assert gaps[True] < 1e-4 < gaps[False] / 10, gaps
