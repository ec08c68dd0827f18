#!/usr/bin/env bash
# Runs one GPU layout with one rollout engine: `bash recipes/gpu/run.sh LAYOUT BACKEND [more flags]`.
#
# LAYOUT is a config in this directory (grpo_separate, grpo_colocated, grpo_multinode), the same for
# every engine; BACKEND is sglang or vllm (or any --backend value). The scripts recipes/gpu_<layout>_<engine>.sh
# call this. MODEL, REWARD and PROMPT_DATA come from the environment; extra arguments go to
# `rlhf-sg train-ppo` and win over the config.
# Needs the engine's CUDA build where this runs: `bash recipes/install/gpu.sh sglang` (or vllm).
set -euo pipefail

LAYOUT="${1:?usage: run.sh LAYOUT BACKEND [flags]}"
BACKEND="${2:?usage: run.sh LAYOUT BACKEND [flags]}"
shift 2
HERE="$(cd "$(dirname "$0")" && pwd)"
CONFIG="$HERE/$LAYOUT.yaml"
[[ -f "$CONFIG" ]] || { echo "no layout config $CONFIG" >&2; exit 2; }
MODEL="${MODEL:?set MODEL to a local Hugging Face model directory (on every node, for a multi-node layout)}"
REWARD="${REWARD:?set REWARD to the reward function, module:function (see rlhf_sg/rewards.py)}"
PROMPT_DATA="${PROMPT_DATA:?set PROMPT_DATA to a JSONL/Parquet file with a \"prompt\" column}"

exec rlhf-sg train-ppo --config "$CONFIG" --backend "$BACKEND" --model "$MODEL" --prompt-data "$PROMPT_DATA" \
    --reward.function "$REWARD" --output-dir "${OUTPUT_ROOT:-runs}/${LAYOUT}_${BACKEND}" "$@"
