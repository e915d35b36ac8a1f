#!/usr/bin/env bash
# geo3k VLM multi-turn GRPO on GPUs: Qwen3-VL-2B-Instruct from a local HF folder, SGLang engines
# behind sglang-router, Megatron with tensor parallelism, asymmetric PPO clip (as slime's recipe),
# placed by Ray: trainer ranks and engines on their own GPUs (docs/clusters.md, "Running on a cluster").
#   MODEL=/models/Qwen3-VL-2B-Instruct GEO3K=/data/geo3k \
#   bash examples/geo3k_vlm_multi_turn/run_geo3k_vlm_multi_turn.sh [TP] [extra slime-mt flags]
# One 8-GPU node (default): 4 trainer ranks on GPUs 0-3, 4 engines on GPUs 4-7. NUM_NODES=2 after
# `ray start` on both (RAY_ADDRESS=head:6379, or run it on the head): 8 ranks fill the first node,
# 8 engines the second. NUM_GPUS (per node), ACTOR_GPUS (trainer ranks per node), ROLLOUT_GPUS and
# ENGINE_GPUS (devices per engine) change the split. COLOCATE=1: trainer ranks on all 8 GPUs and an
# engine on each of them (--colocate), the engines releasing their memory while the trainer trains
# and the trainer's state offloaded while they generate (--offload). GEO3K holds the geo3k parquet files
# (train-*.parquet, test-*.parquet). --dry-run prints the resolved configuration, checks the plug-ins,
# prints the placement and exits. The run folder (data, checkpoints, metrics, config.yaml, train.log)
# is $RUN_DIR, by default $HOME/slime_mt_runs/geo3k_qwen3vl_2b (geo3k_qwen3vl_30b_a3b for MoE, _long added with
# LONG=1; printed first).
# MoE (MODEL=/models/Qwen3-VL-30B-A3B-Instruct, or any folder with MOE=1): one 8-GPU node colocated,
# TP=1 and the 128 experts over all 8 ranks (--expert-model-parallel-size 8, whole experts:
# --expert-tensor-parallel-size 1), 4 SGLang engines of 2 GPUs each, rollout routing replay
# (--use-rollout-routing-replay; the engines are launched with --enable-return-routed-experts), every
# layer recomputed in the backward (--recompute-granularity full, as slime's A3B recipes). A rank
# then holds the dense 1.5B parameters and 16 experts per layer (3.6B); Adam's state is sharded over
# the DP ranks (--use-distributed-optimizer, as in every variant here; experts over their own DP group,
# one rank at EP=8). The memory plan (--dry-run; the text decoder, plus the frozen vision tower's bf16
# weights) puts a rank at 79.0 GiB on one node, for 141 GB GPUs (H200); NUM_NODES=2 (EP=16, each
# expert's state over 2 ranks) at 47.5 GiB fits 80 GB GPUs. A 32B dense model on 2 nodes
# (MODEL=/models/Qwen3-VL-32B-Instruct NUM_NODES=2 COLOCATE=1 ... 8: TP=8 x DP=2) plans at 48.5 GiB
# per rank (71.4 without the distributed optimizer; 58.3 without --sequence-parallel, which every
# variant passes as slime's recipes do: under TP each rank keeps 1/TP of the row's norms and residuals).
# LONG=1: the long-trajectory recipe (32k-token responses, 20 turns): colocated on one 8-GPU node,
# TP=1, each packed row of up to 40k tokens split over 4 ranks by context parallelism (CP=4, DP=2;
# --transformer-impl local, this project's attention) with every layer recomputed. A rank of the
# 2B model holds ~38 GB of bf16 weights, fp32 main weights, gradients and Adam state, and about 10k
# tokens of a row: each layer's input kept (~1.1 GB), one layer recomputed at a time.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT"
MODEL="${MODEL:?set MODEL to a local Qwen3-VL-2B-Instruct (or Qwen3-VL-30B-A3B-Instruct) folder}"
MOE="${MOE:-0}"
case "$(basename "$MODEL")" in *-A3B*) MOE=1 ;; esac
LONG="${LONG:-0}"
TP="$([ "$MOE" = 1 ] || [ "$LONG" = 1 ] && echo 1 || echo 2)"
if [[ "${1:-}" =~ ^[0-9]+$ ]]; then TP="$1"; shift; fi  # [TP] is optional: flags may come first
GEO3K="${GEO3K:-}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
NUM_NODES="${NUM_NODES:-1}"
NUM_GPUS="${NUM_GPUS:-8}"
COLOCATE="${COLOCATE:-$([ "$MOE" = 1 ] || [ "$LONG" = 1 ] && echo 1 || echo 0)}"
if [ "$COLOCATE" = 1 ]; then
    ACTOR_GPUS="${ACTOR_GPUS:-$NUM_GPUS}"
    ROLLOUT_GPUS="${ROLLOUT_GPUS:-$((NUM_NODES * ACTOR_GPUS))}"
    MEM_FRACTION="${MEM_FRACTION:-0.5}"  # the trainer's state comes back while the engines sleep
    PLACE=(--colocate --offload)
else
    ACTOR_GPUS="${ACTOR_GPUS:-$((NUM_GPUS / 2))}"
    ROLLOUT_GPUS="${ROLLOUT_GPUS:-$((NUM_NODES * NUM_GPUS - NUM_NODES * ACTOR_GPUS))}"
    MEM_FRACTION="${MEM_FRACTION:-0.7}"
    PLACE=()
fi
ENGINE_GPUS="${ENGINE_GPUS:-$([ "$MOE" = 1 ] && echo 2 || echo 1)}"
MOE_ARGS=()
if [ "$MOE" = 1 ]; then
    EP="${EP:-$((NUM_NODES * ACTOR_GPUS / TP))}"
    MOE_ARGS=(--expert-model-parallel-size "$EP" --expert-tensor-parallel-size 1
        --moe-token-dispatcher-type alltoall --use-rollout-routing-replay
        --recompute-granularity full --recompute-method uniform --recompute-num-layers 1)
fi
LONG_ARGS=()
if [ "$LONG" = 1 ]; then
    LONG_ARGS=(--max-turns 20 --rollout-max-response-len 32000 --rollout-max-context-len 40960
        --max-tokens-per-micro-batch 40960 --context-parallel-size "${CP:-4}" --transformer-impl local
        --recompute-granularity full --recompute-method uniform --recompute-num-layers 1)
fi
NAME="$([ "$MOE" = 1 ] && echo geo3k_qwen3vl_30b_a3b || echo geo3k_qwen3vl_2b)$([ "$LONG" = 1 ] && echo _long || true)"
RUN_DIR="${RUN_DIR:-$HOME/slime_mt_runs/$NAME}"
DATA="$RUN_DIR/data"
echo "[geo3k] run folder: $RUN_DIR" >&2
DRY_RUN=0
for arg in "$@"; do [ "$arg" = "--dry-run" ] && DRY_RUN=1; done
if [ ! -x "$PY" ]; then echo "[geo3k] no Python at $PY: run bash scripts/demo.sh first, or set PYTHON" >&2; exit 2; fi
# a machine without GPUs (and no RAY_ADDRESS of a cluster that has them) runs the CPU recipe instead
if [ "$DRY_RUN" = 0 ] && [ -z "${RAY_ADDRESS:-}" ] \
    && ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.device_count() else 1)' 2>/dev/null; then
    echo "[geo3k] no GPU here (torch sees none): this recipe trains on GPUs. On CPU, run" \
        "bash examples/geo3k_vlm_multi_turn/run_geo3k_vlm_multi_turn_cpu.sh; for a Ray cluster with GPUs," \
        "set RAY_ADDRESS; to see the plan without GPUs, add --dry-run" >&2
    exit 2
fi
if [ "$DRY_RUN" = 0 ] && [ ! -f "$DATA/train.jsonl" ]; then
    if [ -z "$GEO3K" ]; then echo "set GEO3K to the folder of the geo3k parquet files" >&2; exit 2; fi
    "$PY" scripts/prepare_geo3k.py --parquet "$GEO3K"/*.parquet --out "$DATA"
fi
ARGS=(
    --hf-checkpoint "$MODEL"
    --prompt-data "$DATA/train.jsonl" --eval-prompt-data "$DATA/test.jsonl" --eval-interval 20
    --input-key messages --label-key answer --tool-key tools --multimodal-keys '{"image": "images"}'
    --apply-chat-template
    --rollout-interaction-env-path envs/geo3k.py --max-turns 3
    --rollout-max-response-len 4096 --rollout-max-context-len 16384
    --rollout-temperature 1.0 --rollout-top-p 1.0
    --n-samples-per-prompt 8 --rollout-batch-size 64 --global-batch-size 512 --micro-batch-size 1
    --max-tokens-per-micro-batch 16384 --num-rollout 200 --rollout-shuffle
    --advantage-estimator grpo --eps-clip 0.2 --eps-clip-high 0.28
    --use-kl-loss --kl-loss-coef 0.0 --kl-loss-type low_var_kl --entropy-coef 0.0
    --use-tis --tis-clip 2.0
    --lr 1e-6 --weight-decay 0.1 --clip-grad 1.0 --bf16 --use-distributed-optimizer --sequence-parallel
    --tensor-model-parallel-size "$TP"
    --engine sglang --sglang-mem-fraction-static "$MEM_FRACTION"
    --ray --actor-num-nodes "$NUM_NODES" --actor-num-gpus-per-node "$ACTOR_GPUS" --num-gpus-per-node "$NUM_GPUS"
    --rollout-num-gpus "$ROLLOUT_GPUS" --rollout-num-gpus-per-engine "$ENGINE_GPUS" "${PLACE[@]}"
    --save "$RUN_DIR/ckpt" --save-interval 20 --log-dir "$RUN_DIR" "${MOE_ARGS[@]}" "${LONG_ARGS[@]}"
)
if [ -n "${RAY_ADDRESS:-}" ]; then ARGS+=(--ray-address "$RAY_ADDRESS"); fi
exec "$PY" -m slime_mt.cli train "${ARGS[@]}" "$@"
