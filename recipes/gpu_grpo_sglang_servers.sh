#!/usr/bin/env bash
# GRPO driving SGLang HTTP servers you run yourself (a disaggregated rollout cluster), behind SGLang's router.
#
# Start the servers first, one per rollout node, with token ids in and out and our log-prob convention
# (temperature-scaled, the default; pin it so a stray environment cannot change it):
#   SGLANG_RETURN_ORIGINAL_LOGPROB=0 python -m sglang.launch_server --model-path /shared/hf_model \
#       --tp-size 8 --skip-tokenizer-init --host 0.0.0.0 --port 30000
# and the router in front of them (SGLang's router package):
#   python -m sglang_router.launch_router --worker-urls http://node1:30000 http://node2:30000 --port 30100
# The trainer sends rollouts to the router and weight updates to every server; each server's TP
# ranks join the trainer's NCCL weight-update group (the "collective" transport), so the servers
# must reach the trainer nodes on the group's port.
#
# Usage: SERVER_URLS="http://node1:30000 http://node2:30000" ROUTER_URL=http://node1:30100 \
#   REWARD=my_task:score MODEL=/shared/hf_model PROMPT_DATA=/shared/prompts.jsonl bash recipes/gpu_grpo_sglang_servers.sh
# MODEL must be the servers' model (the trainer starts from it; the backend checks manifests against it).
# Sized for qwen2.5-7b on 8 GPUs of 80 GB: the trainer's node (the servers run on GPUs of their own; held to
# that by tests/test_recipes.py with `bench memory`'s formulas).
set -euo pipefail

MODEL="${MODEL:?set MODEL to the Hugging Face model directory the servers serve}"
REWARD="${REWARD:?set REWARD to the reward function, module:function (see rlhf_sg/rewards.py)}"
PROMPT_DATA="${PROMPT_DATA:?set PROMPT_DATA to a JSONL/Parquet file with a \"prompt\" column}"
SERVER_URLS="${SERVER_URLS:?set SERVER_URLS to the running SGLang servers, space-separated}"
ROUTER_URL="${ROUTER_URL:-}"      # optional: without it rollouts are split over the servers directly
TP_PER_SERVER="${TP_PER_SERVER:-8}"
read -r -a urls <<< "$SERVER_URLS"
urls_json=$(printf '"%s",' "${urls[@]}"); urls_json="[${urls_json%,}]"
router_json=""
if [ -n "$ROUTER_URL" ]; then router_json=", \"router_url\": \"$ROUTER_URL\""; fi
extra="{\"server_urls\": ${urls_json}${router_json}}"
export RAY_ADDRESS="${RAY_ADDRESS:-auto}"   # the trainer's own Ray cluster

args=(
    --backend sglang                        # rollout engine: SGLang, http mode (BackendConfig.extra server_urls)
    --model "$MODEL"                        # policy to train; the same model the servers serve
    --prompt-data "$PROMPT_DATA"            # training prompts
    --algo grpo                             # group-relative advantages, no critic
    --reward.function "$REWARD"             # scores each completion (rule-based, module:function)
    --model.dtype bfloat16                  # trainer weights in bf16, as the servers'
    --train.device cuda                     # ZeRO-3 ranks on GPUs
    --train.actor_num_ranks 8               # ZeRO-3 actor ranks
    --train.kl_coef 0                       # no reference model: the node's 8 GPUs hold the actor ranks
    --rollout.num_engines 1                 # one backend drives every server
    --rollout.tensor_parallel_size "$((TP_PER_SERVER * ${#urls[@]}))"  # all servers' TP ranks: the engine's share of the weight group (their GPUs are the servers'; the engine actor takes none here)
    --rollout.weight_transport collective   # NCCL broadcast of flat buckets; every server receives each one
    --rollout.bucket_bytes 1073741824       # 1 GiB buckets
    --rollout.n_samples_per_prompt 8        # GRPO group size
    --rollout.prompts_per_step 256          # prompts per step
    --rollout.max_new_tokens 2048           # response budget
    --rollout.max_model_len 8192            # must not exceed the servers' context length
    --rollout.engine_kwargs "$extra"        # server_urls (+ router_url): where the servers are
    --output-dir runs/grpo_sglang_servers   # logs, checkpoints, exported policy
)
exec rlhf-sg train-ppo "${args[@]}" "$@"
