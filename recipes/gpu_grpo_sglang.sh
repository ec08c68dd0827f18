#!/usr/bin/env bash
# GRPO, layout recipes/gpu/grpo_separate.yaml (read it for the GPUs, transport and sizes), sglang engines.
# Usage: REWARD=my_task:score MODEL=/path/to/hf_model PROMPT_DATA=prompts.jsonl bash recipes/gpu_grpo_sglang.sh [more flags]
# The twin script for the other engine differs only in the backend name.
set -euo pipefail
exec bash "$(dirname "$0")/gpu/run.sh" grpo_separate sglang "$@"
