#!/usr/bin/env bash
# GRPO on one GPU node with SGLang rollout engines on GPUs of their own (not colocated).
#
# Layout on an 8-GPU node: 4 GPUs for the ZeRO-3 actor ranks, 2 SGLang engines with tensor
# parallelism 2 on the other 4. Each engine is sglang.Engine inside a Ray actor, token ids in and
# out. Weights move trainer -> engines by NCCL broadcast of flat buckets on a side group (the
# "collective" transport): SGLang receives each bucket as one buffer ("flattened_bucket" format).
#
# Usage: REWARD=my_task:score MODEL=/path/to/hf_model PROMPT_DATA=prompts.jsonl bash recipes/gpu_grpo_sglang.sh [more flags]
# Needs: `pip install -e ".[sglang]"` (SGLang's CUDA build) in the environment that runs this.
# Extra arguments are passed on to `rlhf-sg train-ppo` and win over the flags below.
set -euo pipefail

MODEL="${MODEL:?set MODEL to a local Hugging Face model directory}"
REWARD="${REWARD:?set REWARD to the reward function, module:function (see rlhf_sg/rewards.py)}"
PROMPT_DATA="${PROMPT_DATA:?set PROMPT_DATA to a JSONL/Parquet file with a \"prompt\" column}"

args=(
    --backend sglang                        # rollout engine: SGLang (backends/sglang_backend.py)
    --model "$MODEL"                        # policy to train; the engines start from the same directory
    --prompt-data "$PROMPT_DATA"            # training prompts
    --algo grpo                             # group-relative advantages, no critic
    --reward.function "$REWARD"             # scores each completion (rule-based, module:function)
    --model.dtype bfloat16                  # trainer and engine weights in bf16
    --train.device cuda                     # ZeRO-3 ranks on GPUs (NCCL)
    --train.actor_num_ranks 4               # ZeRO-3 actor ranks, one GPU each
    --rollout.num_engines 2                 # SGLang engines (Ray actors), each with its own GPUs
    --rollout.tensor_parallel_size 2        # GPUs per engine; each TP rank is one rank of the weight group
    --rollout.weight_transport collective   # NCCL broadcast of flat buckets on a side group
    --rollout.bucket_bytes 536870912        # 512 MiB buckets: few large broadcasts
    --rollout.n_samples_per_prompt 8        # GRPO group size
    --rollout.prompts_per_step 64           # prompts per step (x8 completions)
    --rollout.max_new_tokens 1024           # response budget
    --rollout.max_model_len 4096            # engine context (prompt + response)
    --rollout.temperature 1.0               # sample at T=1, no truncation: log-probs on-policy
    --rollout.engine_kwargs '{"engine_kwargs": {"mem_fraction_static": 0.85}}'  # sglang.Engine: share of each GPU for weights + KV
    --output-dir runs/grpo_sglang           # logs, checkpoints, exported policy
)
exec rlhf-sg train-ppo "${args[@]}" "$@"
