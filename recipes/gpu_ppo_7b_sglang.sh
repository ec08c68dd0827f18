#!/usr/bin/env bash
# PPO with a critic and a reward model on a 7B policy, one 8-GPU node, SGLang rollout engines.
#
# GPU layout (8 GPUs, every group a Ray placement group):
#   GPUs 0-1  actor, 2 ZeRO-3 ranks; the reference model's 2 ranks share them (--train.colocate_actor_ref)
#   GPUs 2-3  critic, 2 ZeRO-3 ranks; the reward model's 2 ranks share them (--train.colocate_critic_reward)
#   GPUs 4-7  2 SGLang engines, tensor parallel 2 each
# The reference model only runs forwards, so it keeps its ZeRO-3 parameters in host memory between uses
# (--train.ref_offload) and costs its GPU little while the actor trains; the reward model's shards (7 GB a GPU)
# stay beside the critic's. New weights reach the engines by NCCL broadcast of flat buckets (the "collective"
# transport).
# Memory per trainer GPU, by `python -m rlhf_sg.bench memory --model-config qwen2.5-7b --seq-len 8192
# --world-size 2 --gradient-checkpointing --attn-implementation flash_attention_2`: 61 GB of ZeRO-3 shards
# (7.6e9 parameters x 16 bytes over 2 ranks) and 7 GB at the backward's peak. Without gradient checkpointing a
# 16k-token micro-batch would keep about 100 GB of activations on top: more ranks do not help (the 8 GPUs are
# taken), so the backward recomputes each layer.
#
# Usage: REWARD_MODEL=/path/to/7b_reward_model MODEL=/path/to/7b_sft PROMPT_DATA=prompts.jsonl \
#   bash recipes/gpu_ppo_7b_sglang.sh [more flags]
# REWARD_MODEL: a sequence-classification checkpoint (its score head is loaded as the value head) or a
# directory saved by rlhf_sg.models.ValueHeadModel. The critic starts from it too.
# Needs: `pip install -e ".[sglang]"` (SGLang's CUDA build). Extra arguments go to `rlhf-sg train-ppo`.
# Sized for qwen2.5-7b on 8 GPUs of 80 GB (held to that by tests/test_recipes.py with `bench memory`'s formulas).
set -euo pipefail

MODEL="${MODEL:?set MODEL to a local Hugging Face 7B model directory (the SFT policy)}"
REWARD_MODEL="${REWARD_MODEL:?set REWARD_MODEL to a local reward model directory}"
PROMPT_DATA="${PROMPT_DATA:?set PROMPT_DATA to a JSONL/Parquet file with a \"prompt\" column}"

args=(
    --backend sglang                        # rollout engine: SGLang
    --model "$MODEL"                        # policy to train; the engines start from the same directory
    --prompt-data "$PROMPT_DATA"            # training prompts
    --data.apply_chat_template true         # prompts are user turns of the policy's chat template
    --algo gae                              # PPO: GAE advantages from the critic's values
    --reward.kind model                     # scores from a reward model group
    --model.reward_pretrain "$REWARD_MODEL" # the reward model; the critic starts from it
    --reward.num_ranks 2                    # reward model ZeRO-3 ranks, beside the critic's
    --model.dtype bfloat16                  # trainer and engine weights in bf16
    --model.attn_implementation flash_attention_2  # varlen attention over packed rows
    --train.device cuda                     # ZeRO-3 ranks on GPUs, NCCL
    --train.actor_num_ranks 2               # actor ZeRO-3 ranks
    --train.ref_num_ranks 2                 # reference ranks, beside the actor's
    --train.colocate_actor_ref true         # reference rank i on actor rank i's GPU
    --train.ref_offload true                # reference parameters in host memory between forwards
    --train.critic_num_ranks 2              # critic ZeRO-3 ranks
    --train.colocate_critic_reward true     # reward rank i on critic rank i's GPU
    --train.actor_lr 1e-6                   # policy learning rate
    --train.critic_lr 9e-6                  # value learning rate
    --train.critic_warmup_steps 5           # critic-only steps first: a fresh value head gives noisy advantages
    --train.kl_coef 0.01                    # KL to the reference, as a reward penalty (--train.kl_mode reward)
    --train.num_minibatches 4               # optimizer steps per rollout batch
    --train.max_tokens_per_microbatch 8192  # packed tokens per forward/backward
    --train.gradient_checkpointing true     # keep each layer's input only; recompute the rest in the backward
    --rollout.num_engines 2                 # SGLang engines
    --rollout.tensor_parallel_size 2        # GPUs per engine
    --rollout.weight_transport collective   # NCCL broadcast of flat buckets on side groups
    --rollout.n_samples_per_prompt 1        # PPO: one sample per prompt
    --rollout.prompts_per_step 512          # rollout batch
    --rollout.max_new_tokens 1024           # response budget
    --rollout.max_model_len 2048            # engine context (prompt + response)
    --data.max_prompt_len 1024              # longer prompts are an error naming the row
    --rollout.engine_kwargs '{"engine_kwargs": {"mem_fraction_static": 0.85}}'  # engines own their GPUs
    --log.save_steps 50                     # DeepSpeed checkpoints of actor and critic
    --output-dir runs/ppo_7b_sglang         # logs, checkpoints, exported policy
)
exec rlhf-sg train-ppo "${args[@]}" "$@"
