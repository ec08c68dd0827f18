#!/usr/bin/env bash
# Long-response GRPO on a 7B with the actor's rows split over 4 ranks (sequence parallelism), layout
# recipes/gpu/grpo_long_sp.yaml (read it for the GPUs and sizes), SGLang engines. By construction, not run.
# Usage: REWARD=my_task:score MODEL=/path/to/7b_model PROMPT_DATA=prompts.jsonl bash recipes/gpu_grpo_long_sp_sglang.sh
# [more flags]; `bash recipes/gpu/run.sh grpo_long_sp vllm` runs the same layout on vLLM.
set -euo pipefail
exec bash "$(dirname "$0")/gpu/run.sh" grpo_long_sp sglang "$@"
