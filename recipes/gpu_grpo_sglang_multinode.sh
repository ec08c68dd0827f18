#!/usr/bin/env bash
# GRPO on a 70B policy across 8 GPU nodes (64 GPUs) with SGLang engines, on a Ray cluster.
#
# Layout: 4 nodes train (32 ZeRO-3 actor ranks: bf16 weights, fp32 master weights and Adam states,
# ~16 bytes a parameter, ~35 GB a GPU, activations recomputed in the backward), 4 nodes generate
# (4 SGLang engines, tensor parallel 8, one node each). No reference model (--train.kl_coef 0), so
# no GPU goes to it; add --train.kl_coef 0.001 --train.ref_num_ranks 32 --train.colocate_actor_ref true
# --train.ref_offload true to regularise toward the start policy on the trainer's GPUs.
#
# Start Ray first, on the head node `ray start --head --port 6379` and on every other node
# `ray start --address HEAD_IP:6379`; then run this script on the head node. Ray places the ZeRO-3
# actor ranks and the SGLang engines (sglang.Engine in Ray actors) across the nodes; weights move by
# NCCL broadcast of flat buckets (the "collective" transport), every trainer rank sending to its
# share of the engines, so no single rank's link carries every engine's copy.
#
# Usage: REWARD=my_task:score MODEL=/shared/hf_model PROMPT_DATA=/shared/prompts.jsonl bash recipes/gpu_grpo_sglang_multinode.sh [more flags]
# MODEL and PROMPT_DATA must be readable at the same path on every node (a shared filesystem).
# Needs: `pip install -e ".[sglang]"` on every node. Extra arguments go to `rlhf-sg train-ppo`.
# For SGLang servers you run yourself (behind SGLang's router), see gpu_grpo_sglang_servers.sh.
set -euo pipefail

MODEL="${MODEL:?set MODEL to a Hugging Face model directory readable on every node}"
REWARD="${REWARD:?set REWARD to the reward function, module:function (see rlhf_sg/rewards.py)}"
PROMPT_DATA="${PROMPT_DATA:?set PROMPT_DATA to a prompt file readable on every node}"
export RAY_ADDRESS="${RAY_ADDRESS:-auto}"   # join the running Ray cluster instead of starting one

args=(
    --backend sglang                        # rollout engine: SGLang
    --model "$MODEL"                        # policy to train; every engine starts from it
    --prompt-data "$PROMPT_DATA"            # training prompts
    --algo grpo                             # group-relative advantages, no critic
    --reward.function "$REWARD"             # scores each completion (rule-based, module:function)
    --model.dtype bfloat16                  # trainer and engine weights in bf16
    --train.device cuda                     # ZeRO-3 ranks on GPUs (NCCL across nodes)
    --model.attn_implementation flash_attention_2  # varlen attention over packed rows
    --train.actor_num_ranks 32              # ZeRO-3 actor ranks: four 8-GPU nodes' worth
    --train.gradient_checkpointing true     # recompute activations: a 70B backward does not fit otherwise
    --train.kl_coef 0                       # no reference model
    --train.max_tokens_per_microbatch 8192  # packed tokens per forward/backward and rank
    --rollout.num_engines 4                 # SGLang engines, one node each
    --rollout.tensor_parallel_size 8        # GPUs per engine (one node; SGLang's schedulers, one per TP rank)
    --rollout.weight_transport collective   # NCCL broadcast of flat buckets on side groups
    --rollout.bucket_bytes 1073741824       # 1 GiB buckets: fewer, larger inter-node broadcasts
    --rollout.n_samples_per_prompt 8        # GRPO group size
    --rollout.prompts_per_step 256          # prompts per step
    --rollout.max_new_tokens 2048           # response budget
    --rollout.max_model_len 8192            # engine context
    --rollout.engine_kwargs '{"engine_kwargs": {"mem_fraction_static": 0.9}}'  # engines own their GPUs
    --output-dir /shared/runs/grpo_sglang   # on the shared filesystem, so every node can write checkpoints
)
exec rlhf-sg train-ppo "${args[@]}" "$@"
