#!/usr/bin/env bash
# GRPO on one GPU node with vLLM colocated: engines and trainer ranks share the same GPUs.
#
# --train.colocate_all puts one ZeRO-3 actor rank, one reference rank and one vLLM engine on
# each GPU. The engine sleeps while the trainer
# trains (vLLM sleep level 1: weights offloaded to host memory, KV cache freed) and wakes for the
# next rollout; new weights arrive as CUDA IPC handles of flat buckets (the "tensor" transport),
# so no byte crosses a network.
#
# Usage: REWARD=my_task:score MODEL=/path/to/hf_model PROMPT_DATA=prompts.jsonl bash recipes/gpu_grpo_vllm_colocated.sh [more flags]
# Needs: `pip install -e ".[vllm]"` (the CUDA build of vLLM). Extra arguments go to `rlhf-sg train-ppo`.
set -euo pipefail

MODEL="${MODEL:?set MODEL to a local Hugging Face model directory}"
REWARD="${REWARD:?set REWARD to the reward function, module:function (see rlhf_sg/rewards.py)}"
PROMPT_DATA="${PROMPT_DATA:?set PROMPT_DATA to a JSONL/Parquet file with a \"prompt\" column}"
NUM_GPUS="${NUM_GPUS:-8}"   # GPUs on this node; one actor rank and one engine on each

args=(
    --backend vllm                              # rollout engine: vLLM
    --model "$MODEL"                            # policy to train; the engines start from the same directory
    --prompt-data "$PROMPT_DATA"                # training prompts
    --algo grpo                                 # group-relative advantages, no critic
    --reward.function "$REWARD"                 # scores each completion (rule-based, module:function)
    --model.dtype bfloat16                      # trainer and engine weights in bf16
    --train.device cuda                         # ZeRO-3 ranks on GPUs
    --train.actor_num_ranks "$NUM_GPUS"         # one actor rank per GPU
    --train.ref_num_ranks "$NUM_GPUS"           # one reference rank per GPU, beside its actor rank
    --train.ref_offload true                    # reference parameters wait in host memory between forwards
    --rollout.num_engines "$NUM_GPUS"           # one engine per GPU, beside its actor rank
    --rollout.tensor_parallel_size 1            # one GPU per engine
    --rollout.weight_transport tensor           # CUDA IPC hand-off of flat buckets on the shared GPU
    --train.colocate_all true                   # rank i and engine i share GPU i (Ray placement-group bundle i);
                                                # implies engines sleep while training and the actor's
                                                # ZeRO-3 states (params, grads, Adam) leave the GPU while engines generate
    --rollout.n_samples_per_prompt 8            # GRPO group size
    --rollout.prompts_per_step 64               # prompts per step
    --rollout.max_new_tokens 1024               # response budget
    --rollout.max_model_len 4096                # engine context
    --rollout.engine_kwargs '{"gpu_memory_utilization": 0.45, "sleep_level": 1}'  # leave the trainer half the GPU; level 1 keeps weights in host memory
    --output-dir runs/grpo_vllm_colocated       # logs, checkpoints, exported policy
)
exec rlhf-sg train-ppo "${args[@]}" "$@"
