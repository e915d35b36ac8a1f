#!/usr/bin/env bash
# geo3k VLM multi-turn GRPO on CPU: tiny Qwen2.5-VL (random weights, real Qwen tokenizer and image
# processor), the embedded engine, Megatron TP=1 or 2, synthetic geo3k problems, a few steps.
# It checks the whole pipeline (images in prompts, calc_score tool turns, M-RoPE training); a random
# model does not learn geometry: it earns no reward, so every group's rewards are equal (0) and each
# step's grad norm is 0. For a learning signal, run the GPU recipe with a real model.
#   bash examples/geo3k_vlm_multi_turn/run_geo3k_vlm_multi_turn_cpu.sh [TP] [extra slime-mt flags]
# LONG=1: the long-trajectory recipe at CPU size (the GPU recipe's LONG=1 scaled down): 20 turns of
# about 25 generated tokens and their tool feedback (trajectories of over a thousand tokens), each
# packed row split over the ranks by context parallelism (the first argument is then the CP size, default 2) with every layer recomputed.
# The run folder (data, metrics, config.yaml, train.log, checkpoint) is $RUN_DIR, by default
# ${TMPDIR:-/tmp}/slime_mt_runs/geo3k_cpu_tp$TP (geo3k_cpu_long_cp$CP with LONG=1; printed first);
# RUN_DIR=runs/geo3k_cpu keeps it in the repository.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT"
LONG="${LONG:-0}"
RANKS="${1:-$([ "$LONG" = 1 ] && echo 2 || echo 1)}"
shift || true
PY="${PYTHON:-$ROOT/.venv/bin/python}"
if [ "$LONG" = 1 ]; then
    # a turn cut at its length ends the episode (as slime's): ~4% of the ids stop a turn (about 25 tokens
    # each), so all 20 turns end on a stop
    NAME="geo3k_cpu_long_cp$RANKS" TURNS=20 RESPONSE=1024 CONTEXT=8192 STOP_EVERY=25
    PARALLEL=(--tensor-model-parallel-size 1 --context-parallel-size "$RANKS" --max-tokens-per-micro-batch 8192
        --recompute-granularity full --recompute-method uniform --recompute-num-layers 1)
else
    NAME="geo3k_cpu_tp$RANKS" TURNS=3 RESPONSE=32 CONTEXT=2048 STOP_EVERY=37
    PARALLEL=(--tensor-model-parallel-size "$RANKS" --sequence-parallel)
fi
RUN_DIR="${RUN_DIR:-${TMPDIR:-/tmp}/slime_mt_runs/$NAME}"
DATA="$RUN_DIR/data"
mkdir -p "$RUN_DIR"
echo "[geo3k cpu] run folder: $RUN_DIR"
"$PY" scripts/prepare_geo3k.py --synthetic 24 --out "$DATA" >/dev/null
MODEL="$("$PY" -c 'from slime_mt.assets import tiny_model_dir; print(tiny_model_dir("qwen2.5-vl"))')"
# random tiny weights rarely emit <|im_end|>: end turns on a spread of token ids as well
STOPS="$("$PY" -c "print(' '.join(map(str, list(range(3, 151643, $STOP_EVERY)) + [151645])))")"
LAUNCH=("$PY" -m slime_mt.cli)
if [ "$RANKS" -gt 1 ]; then
    LAUNCH=("$PY" -m torch.distributed.run --nproc-per-node "$RANKS" --master-addr 127.0.0.1
            --master-port "${MASTER_PORT:-29611}" -m slime_mt.cli)
fi
"${LAUNCH[@]}" train \
    --hf-checkpoint "$MODEL" \
    --prompt-data "$DATA/train.jsonl" --eval-prompt-data "$DATA/test.jsonl" --eval-interval 2 \
    --input-key messages --label-key answer --tool-key tools --multimodal-keys '{"image": "images"}' \
    --rollout-interaction-env-path envs/geo3k.py --max-turns "$TURNS" \
    --rollout-max-response-len "$RESPONSE" --rollout-max-context-len "$CONTEXT" --rollout-temperature 1.0 \
    --rollout-stop-token-ids $STOPS \
    --n-samples-per-prompt 4 --rollout-batch-size 2 --global-batch-size 8 --micro-batch-size 2 \
    --num-rollout 3 --advantage-estimator grpo --eps-clip 0.2 --eps-clip-high 0.28 --lr 1e-5 \
    "${PARALLEL[@]}" --save "$RUN_DIR/ckpt" --log-dir "$RUN_DIR" "$@"
