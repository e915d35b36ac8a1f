#!/usr/bin/env bash
# geo3k VLM multi-turn GRPO on CPU: tiny Qwen2.5-VL (random weights, real Qwen tokenizer and image
# processor), the embedded engine, Megatron TP=1 or 2, synthetic geo3k problems, a few steps.
# It checks the whole pipeline (images in prompts, calc_score tool turns, M-RoPE training); a random
# model does not learn geometry: it earns no reward, so every group's rewards are equal (0) and each
# step's grad norm is 0. For a learning signal, run the GPU recipe with a real model.
#   bash examples/geo3k_vlm_multi_turn/run_geo3k_vlm_multi_turn_cpu.sh [TP] [extra slime-mt flags]
# The run folder (data, metrics, config.yaml, train.log, checkpoint) is $RUN_DIR, by default
# ${TMPDIR:-/tmp}/slime_mt_runs/geo3k_cpu_tp$TP (printed first); RUN_DIR=runs/geo3k_cpu keeps it in the repository.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT"
TP="${1:-1}"
shift || true
PY="${PYTHON:-$ROOT/.venv/bin/python}"
RUN_DIR="${RUN_DIR:-${TMPDIR:-/tmp}/slime_mt_runs/geo3k_cpu_tp$TP}"
DATA="$RUN_DIR/data"
mkdir -p "$RUN_DIR"
echo "[geo3k cpu] run folder: $RUN_DIR"
"$PY" scripts/prepare_geo3k.py --synthetic 24 --out "$DATA" >/dev/null
MODEL="$("$PY" -c 'from slime_mt.assets import tiny_model_dir; print(tiny_model_dir("qwen2.5-vl"))')"
# random tiny weights rarely emit <|im_end|>: end turns on a spread of token ids as well
STOPS="$("$PY" -c 'print(" ".join(map(str, list(range(3, 151643, 37)) + [151645])))')"
LAUNCH=("$PY" -m slime_mt.cli)
if [ "$TP" -gt 1 ]; then
    LAUNCH=("$PY" -m torch.distributed.run --nproc-per-node "$TP" --master-addr 127.0.0.1
            --master-port "${MASTER_PORT:-29611}" -m slime_mt.cli)
fi
"${LAUNCH[@]}" train \
    --hf-checkpoint "$MODEL" \
    --prompt-data "$DATA/train.jsonl" --eval-prompt-data "$DATA/test.jsonl" --eval-interval 2 \
    --input-key messages --label-key answer --tool-key tools --multimodal-keys '{"image": "images"}' \
    --rollout-interaction-env-path envs/geo3k.py --max-turns 3 \
    --rollout-max-response-len 32 --rollout-max-context-len 2048 --rollout-temperature 1.0 \
    --rollout-stop-token-ids $STOPS \
    --n-samples-per-prompt 4 --rollout-batch-size 2 --global-batch-size 8 --micro-batch-size 2 \
    --num-rollout 3 --advantage-estimator grpo --eps-clip 0.2 --eps-clip-high 0.28 --lr 1e-5 \
    --tensor-model-parallel-size "$TP" --save "$RUN_DIR/ckpt" --log-dir "$RUN_DIR" "$@"
