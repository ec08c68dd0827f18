#!/usr/bin/env bash
# GRPO on a vision-language policy (Qwen2.5-VL), layout recipes/gpu/grpo_vl.yaml (read it for the GPUs and sizes),
# embedded engines (the backend that generates with images).
# Usage: REWARD=my_task:score MODEL=/path/to/Qwen2.5-VL-7B-Instruct PROMPT_DATA=prompts_with_images.jsonl \
#        bash recipes/gpu_grpo_vl_hf.sh [more flags]
# PROMPT_DATA rows name their images (paths relative to the file, see the README's vision-language section).
set -euo pipefail
exec bash "$(dirname "$0")/gpu/run.sh" grpo_vl hf "$@"
