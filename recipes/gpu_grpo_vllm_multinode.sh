#!/usr/bin/env bash
# GRPO, layout recipes/gpu/grpo_multinode.yaml (read it for the GPUs, transport and sizes), vllm engines.
# Usage: REWARD=my_task:score MODEL=/path/to/hf_model PROMPT_DATA=prompts.jsonl bash recipes/gpu_grpo_vllm_multinode.sh [more flags]
# The twin script for the other engine differs only in the backend name.
set -euo pipefail
export RAY_ADDRESS="${RAY_ADDRESS:-auto}"   # join the running Ray cluster
exec bash "$(dirname "$0")/gpu/run.sh" grpo_multinode vllm "$@"
