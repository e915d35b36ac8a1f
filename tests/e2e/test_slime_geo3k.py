"""Issue 75 item 3: slime's geo3k VLM multi-turn example, as slime publishes it (its ``rollout.py``,
``env_geo3k.py``, ``base_env.py`` and config file, byte for byte: tests/helpers/slime_upstream), trains
under ``--slime-compat`` with its recipe's flags at tiny size (run_geo3k_vlm_multi_turn.py's train_args,
sizes shrunk), run from the folder that holds slime's ``examples/`` as slime runs it from its
repository root. The model is a tiny Qwen2.5-VL whose language model is a chain: after the assistant's
turn opens it writes either slime's tool call (``<tool_call>{"name":"calc_score",...}</tool_call>``)
or a boxed answer, at even odds, so episodes end after 1, 2 or 3 turns (the env ends an episode without
a tool call, or at max_turns 3). One run, about 60 s (e2e tier)."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from PIL import Image
from rollout_helpers import chain_vlm
from scripted import segment
from train_helpers import HELPERS

from slime_mt.inspection.dumps import load_dump
from slime_mt.tokenization import mask_runs

UPSTREAM = HELPERS / "slime_upstream"
# the two texts the chain writes, each id once in both (one successor per id): the tool is asked about 4
TOOL_CALL = '<tool_call>{"name":"calc_score","arguments":{"answer":4}}</tool_call>'
ANSWER = "The answer is \\boxed{3}."
IMAGE_PAD = 151655


@pytest.fixture(scope="module")
def geo3k_run(tmp_path_factory, tiny_paths):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("slime_geo3k")
    src = tiny_paths["qwen2.5-vl"]
    tokenizer = AutoTokenizer.from_pretrained(src)
    opening, end = tokenizer.encode("\n")[0], tokenizer.convert_tokens_to_ids("<|im_end|>")
    tool = segment(tokenizer, TOOL_CALL, {opening, end})
    answer = segment(tokenizer, ANSWER, {opening, end, *tool})
    transitions = {opening: [tool[0], answer[0]]}
    for chain in (tool, answer):
        transitions.update({a: [b] for a, b in zip(chain, [*chain[1:], end])})
    model = chain_vlm(src, root / "model", transitions)

    data = root / "data"
    data.mkdir()
    figures = [((56, 56), (200, 30, 30)), ((84, 56), (30, 200, 30)), ((56, 112), (30, 30, 200))]
    rows = []
    for k, (size, color) in enumerate(figures):
        Image.new("RGB", size, color).save(data / f"fig{k}.png")
        problem = f"<image>Find x in figure {k}. Call calc_score to check, then answer in \\boxed{{}}."
        rows.append({"problem": problem, "answer": "3" if k != 1 else "4", "images": [f"fig{k}.png"]})
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    work = root / "slime"  # slime runs its recipes from its repository root: examples/ is a package there
    shutil.copytree(UPSTREAM, work)
    run = root / "run"
    recipe = [
        *("--hf-checkpoint", str(model), "--prompt-data", str(data / "train.jsonl")),
        *("--input-key", "problem", "--label-key", "answer", "--multimodal-keys", '{"image": "images"}'),
        *("--rm-type", "math", "--apply-chat-template"),
        *("--custom-generate-function-path", "examples.geo3k_vlm_multi_turn.rollout.generate"),
        *("--custom-config-path", "examples/geo3k_vlm_multi_turn/geo3k_vlm_multi_turn_config.yaml"),
        *("--rollout-shuffle", "--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4"),
        *("--rollout-max-response-len", "512", "--rollout-temperature", "1", "--global-batch-size", "8"),
        *("--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1"),
        *("--adam-beta1", "0.9", "--adam-beta2", "0.98"),
        *("--advantage-estimator", "grpo", "--kl-loss-coef", "0.00", "--kl-loss-type", "low_var_kl"),
        *("--kl-coef", "0.00", "--entropy-coef", "0.00", "--eps-clip", "0.2", "--eps-clip-high", "0.28"),
        *("--rollout-num-gpus-per-engine", "1", "--sglang-ep-size", "1", "--sglang-mem-fraction-static", "0.6"),
        *("--sglang-cuda-graph-bs", "1", "2", "4", "8"),
        *("--train-backend", "megatron", "--load", str(model), "--tensor-model-parallel-size", "1"),
        *("--sequence-parallel", "--pipeline-model-parallel-size", "1", "--context-parallel-size", "1"),
        *("--expert-model-parallel-size", "1", "--expert-tensor-parallel-size", "1"),
        *("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"),
        *("--micro-batch-size", "1", "--attention-dropout", "0.0", "--hidden-dropout", "0.0"),
        *("--accumulate-allreduce-grads-in-fp32", "--attention-softmax-in-fp32", "--attention-backend", "flash"),
        *("--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", "--colocate"),
    ]
    ours = ["--slime-compat", "--log-dir", str(run), "--save-debug-rollout-data", f"{run}/dumps/{{rollout_id}}.pt"]
    cmd = [sys.executable, "-m", "slime_mt.cli", "train", *recipe, *ours]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=work, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {"run": run, "proc": proc, "tokenizer": tokenizer, "rows": rows}


def test_slimes_geo3k_example_trains_two_steps_unchanged(geo3k_run):
    run, tokenizer = geo3k_run["run"], geo3k_run["tokenizer"]
    proc = geo3k_run["proc"]
    assert "--load" in proc.stderr and "holds no checkpoint yet: starting from --hf-checkpoint" in proc.stderr
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert all("rollout/status/failed" not in r and r["rollout/samples_with_rebuilt_turns"] == 8 for r in rows)
    assert any(r["train/grad_norm"] > 0 for r in rows)

    samples = [s for step in (0, 1) for s in load_dump(run / f"dumps/{step}.pt")["samples"]]
    assert len(samples) == 16
    turns = sorted({len(s["turns"]) for s in samples})
    assert {2, 3} <= set(turns) <= {1, 2, 3}, turns  # slime's second and third turns ran
    for s in samples:
        tokens, mask, start = s["tokens"], s["loss_mask"], s["prompt_length"]
        # the prompt's image pads: as many as the image's patches, merged 2x2 (Qwen2.5-VL)
        grid = s["multimodal_train_inputs"]["image_grid_thw"]
        assert grid.shape == (1, 3) and tokens.count(IMAGE_PAD) == int(grid.prod()) // 4
        assert tokens[:start].count(IMAGE_PAD) == tokens.count(IMAGE_PAD)  # the env's feedback brings none
        # what trains is what the model wrote, each turn one of the chain's two texts; the env's feedback
        # (the tool's result in a user turn) is masked out of the loss
        response = tokens[start:]
        assert len(mask) == len(response)
        texts = [tokenizer.decode(response[a:b]) for a, b in mask_runs(mask)]
        masked = [token for token, bit in zip(response, mask) if not bit]
        assert len(texts) == len(s["turns"])
        assert all(t in (TOOL_CALL + "<|im_end|>", ANSWER + "<|im_end|>") for t in texts), texts
        assert all(t.startswith(TOOL_CALL) for t in texts[:-1])  # only a tool call brings another turn
        feedback = tokenizer.decode(masked)
        assert ("calc_score result" in feedback) == (len(texts) > 1) and "<tool_call>" not in feedback
        if len(texts) > 1:
            label = s["label"]
            assert ("Parsed answer '4' matches the reference" in feedback) == (label == "4")
            assert ("Parsed answer '4' does not match the reference" in feedback) == (label != "4")
        # the rollout's log-probs of what it trained, 0 over the feedback (slime's rollout writes them so)
        assert len(s["rollout_log_probs"]) == len(mask)
        assert all(lp == 0.0 for lp, bit in zip(s["rollout_log_probs"], mask) if not bit)
        # the math reward: 1 for the boxed 3 where the label is 3 (a tool call alone boxes nothing)
        boxed = texts[-1].startswith(ANSWER)
        assert s["reward"] == (1.0 if boxed and s["label"] == "3" else 0.0), (texts, s["label"], s["reward"])


def test_every_turn_sent_the_prompts_image_to_the_engine(geo3k_run):
    """slime's rollout sends the prompt's image with every turn's token ids: the engine was asked with
    one image per request and served every turn (a request whose pads and images disagree is refused)."""
    run = geo3k_run["run"]
    samples = [s for step in (0, 1) for s in load_dump(run / f"dumps/{step}.pt")["samples"]]
    for s in samples:
        assert [t["num_images"] for t in s["turns"]] == [1] * len(s["turns"])
        assert all(t["finish_reason"] == "stop" for t in s["turns"])
    assert isinstance(samples[0]["multimodal_train_inputs"]["pixel_values"], torch.Tensor)
