"""One typed config for a training run, filled from a YAML file and/or CLI flags.

Every field is reachable as a dotted flag (``--rollout.backend sglang``, ``--train.actor_lr 1e-6``);
the most used ones also have a short alias (``--backend``, ``--model``). YAML files use the same
nesting. :func:`validate` checks everything that can be checked before Ray starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from rlhf_sg.advantages import advantage_estimator, advantage_estimators
from rlhf_sg.algorithms import (
    ADVANTAGE_NORMS,
    AGGREGATIONS,
    KL_KINDS,
    LOSS_CLIP_DEFAULTS,
    LOSS_RATIO_LEVELS,
    POLICY_LOSSES,
    RATIO_LEVELS,
    TIS_MODES,
)

LR_SCHEDULERS = ("constant", "linear", "cosine")
#: --data.overlong_prompts: what happens to a prompt over --data.max_prompt_len (rlhf_sg.data.load_prompts)
OVERLONG_PROMPTS = ("error", "drop", "truncate")


class ConfigError(ValueError):
    """The configuration is wrong; the message names the flag and what to do."""


@dataclass
class ModelConfig:
    #: the policy: a local HF causal-LM directory
    pretrain: str = ""
    #: critic initialisation (a causal LM or a saved value model); default: the reward model, else the policy
    critic_pretrain: str | None = None
    #: reward model (a value-head model); only with reward.kind == "model"
    reward_pretrain: str | None = None
    #: attention implementation for training forwards: "sdpa" (CPU), "flash_attention_2" (GPU), "eager"
    attn_implementation: str = "sdpa"
    dtype: str = "float32"  # "float32" | "bfloat16"
    #: a vision-language policy's vision tower stays as loaded (no gradient, no optimizer state): training moves
    #: the language model only
    freeze_vision_tower: bool = True
    #: the training ranks run RMSNorms, gated-MLP products and rotary embeddings as fused torch.compile kernels
    #: where a module's forward matches the form they compute (:mod:`rlhf_sg.kernels`); each process compiles them
    #: at its first forward
    fused_kernels: bool = False


@dataclass
class RolloutConfig:
    #: rollout engine: a built-in name (hf, sglang, vllm), an installed plugin, or module:Class
    backend: str = "hf"
    num_engines: int = 1
    tensor_parallel_size: int = 1
    #: prompts per step; each is sampled n_samples_per_prompt times
    prompts_per_step: int = 8
    n_samples_per_prompt: int = 4
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    #: extra stop tokens (the tokenizer's EOS always stops)
    stop_token_ids: list[int] = field(default_factory=list)
    max_model_len: int = 2048
    #: weight transport into the engines: "collective" | "tensor" | "disk"
    weight_transport: str = "collective"
    bucket_bytes: int = 512 * 2**20
    #: share of each engine device for weights and KV cache (SGLang's mem_fraction_static, vLLM's
    #: gpu_memory_utilization; on CPU, vLLM's share of host memory; the embedded engine's KV budget is this share
    #: of the GPU less its weights, on CPU of the host memory available at its start); None: the engine's default
    memory_fraction: float | None = None
    #: engine-specific keywords passed verbatim to the backend (YAML mapping); they win over the above
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    #: CPU threads per engine process (None: on CPU, the machine's cores shared among the engines, since
    #: the step's phases take turns and nothing else computes while the engines generate; with async rollout
    #: shared with the trainer's ranks too; on GPU, 1)
    engine_threads: int | None = None
    #: restarts of one engine in a row (it died each time before finishing its prompts) before the run stops
    max_engine_restarts: int = 3
    #: free engine memory while training (None: on with --train.colocate_all, else off)
    sleep_engines_while_training: bool | None = None
    #: "sync": a step generates, then trains (on-policy); "async": the engines generate the batches of the next
    #: steps while the trainer trains (off-policy by at most max_staleness weight versions; colocated
    #: placement stays sync, the engines and the trainer sharing devices)
    mode: str = "sync"
    #: async: a batch is trained at most this many weight versions after the oldest weights that sampled it
    max_staleness: int = 1
    #: async: a weight sync cuts the generations in flight short, and they continue with the new weights
    #: (engines that cannot abort a generate finish it first)
    partial_rollout: bool = True
    #: which engine serves a session (rlhf_sg.serve.router): "sticky_least_loaded" (a session stays on its engine,
    #: a new one goes to the least loaded), "round_robin" or "consistent_hash"
    routing: str = "sticky_least_loaded"


@dataclass
class TrainConfig:
    #: gae (PPO with a critic), reinforce (REINFORCE++), grpo, dr_grpo, rloo, reinforce_baseline
    advantage_estimator: str = "gae"
    actor_num_ranks: int = 2
    critic_num_ranks: int = 1
    ref_num_ranks: int = 1
    #: ref model ZeRO-3 parameters offloaded to CPU memory (GPU runs)
    ref_offload: bool = False
    max_steps: int = 20
    ppo_epochs: int = 1
    #: optimizer steps per rollout batch (the batch is split evenly)
    num_minibatches: int = 1
    #: real tokens of a micro-batch on ONE rank: an SP group of N takes micro-batches of N x it, each rank 1 / N of
    #: every row (microbatch_tokens); a sequence must fit it whole, or as a rank's share of it under SP
    max_tokens_per_microbatch: int = 4096
    #: the rows of one prompt (a GRPO group) compute the prompt once in the log-prob and value forwards and
    #: their backward: one packed segment [prompt | response_1 | response_2 | ...] whose responses attend to the
    #: prompt and to themselves only (same results up to rounding; models with recurrent layers or ALiBi
    #: take one sequence per row instead, see the README's model families). Needs an attention that takes a mask
    #: (sdpa, eager); with flash_attention_2 (varlen, no tree mask) every row computes its own prompt. On sdpa the
    #: ranks compute the segments block by block (each response over its prompt and itself, not the mask's square;
    #: packing.SharedPromptBlocks), a group one segment however long (its prompt computed once, no [L, L] mask built)
    share_prompts: bool = True
    #: at model load, every actor / critic / reference / reward rank runs three short sequences through the
    #: layouts its forwards use (packed two to a row; shared prompts) and alone: a difference beyond float
    #: rounding makes that model take one sequence per row, with a warning (a second line of defence behind the
    #: layer-type and module-tree checks); if even that differs, the run stops
    packing_probe: bool = True
    #: the actor's separate old-log-prob forward each step (None: only when needed, i.e. ppo_epochs or
    #: num_minibatches > 1, or the KL penalty in the rewards; otherwise the single update's forward gives them)
    recompute_old_logp: bool | None = None
    #: recompute activations in the backward of actor and critic (less memory, ~30% more compute)
    gradient_checkpointing: bool = False
    #: sequence parallelism (Ulysses, rlhf_sg/parallel/): every packed row of the actor, critic, reference, reward
    #: model and teacher groups split over this many ranks of the group, each attention computed per head over the
    #: whole row; each group's ranks = data-parallel ranks x this. The heads of every model must split (checked here);
    #: what the SP groups do not run yet (routing replay among them) is refused by its flag before Ray starts
    sequence_parallel_size: int = 1
    #: the actor's SP size in place of sequence_parallel_size (None: that); e.g. the actor's long rows split over 4
    #: ranks and the critic's over 2
    actor_sequence_parallel_size: int | None = None
    #: the critic's SP size (None: sequence_parallel_size)
    critic_sequence_parallel_size: int | None = None
    #: the reference's SP size (None: sequence_parallel_size)
    ref_sequence_parallel_size: int | None = None
    #: the reward model's SP size (--reward.kind model; None: sequence_parallel_size)
    reward_sequence_parallel_size: int | None = None
    #: the teacher's SP size (--distill.teacher; None: sequence_parallel_size)
    teacher_sequence_parallel_size: int | None = None
    #: a model group of one rank under ZeRO-3 too (true) or unpartitioned (false, the default: DeepSpeed stage 0, or
    #: stage 1 with bfloat16, where one rank partitions nothing; no gathers, same numbers); groups of several ranks
    #: stay ZeRO-3. A checkpoint written under the other setting is converted on resume (rlhf_sg/checkpoint_convert.py)
    single_rank_zero3: bool = False
    #: zero every dropout of the actor, critic, reference and reward models (the config's *dropout / *pdrop
    #: rates and nn.Dropout modules): scoring and update forwards then see the same function, so the PPO ratio
    #: of a fresh batch is exactly 1 (TRL does the same by default); false keeps the model's dropout in updates
    disable_dropout: bool = True
    #: stop the run after this many steps in a row whose optimizer updates were all skipped for a NaN / Inf
    #: loss or gradient (a skipped update leaves the weights as they were)
    max_nonfinite_steps: int = 3
    actor_lr: float = 1e-5
    critic_lr: float = 1e-5
    #: learning-rate schedule of actor and critic over the run's optimizer steps: constant, linear or cosine
    #: (decay to 0 at the last step), after a linear warmup over lr_warmup_ratio of the steps
    lr_scheduler: str = "constant"
    lr_warmup_ratio: float = 0.0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    #: the policy loss: ppo (PPO's clipped surrogate on each token's ratio), gspo (that clip on the sequence ratio,
    #: GSPO), cispo (the clipped ratio as a stop-gradient weight on log pi, CISPO), sapo (a soft gate instead of the
    #: clip, SAPO), gmpo (the geometric mean of a sequence's token ratios, clipped in log space, GMPO)
    policy_loss: str = "ppo"
    #: the importance ratio pi / pi_old of each token, or of its sequence (exp of the mean log-ratio over the
    #: sequence's own tokens); none: the loss's own (sequence for gspo and gmpo, token for the others); cispo and
    #: sapo take either
    ratio_level: str | None = None
    #: the clip range; none: the loss's own: ppo 0.2 / 0.2, gspo 3e-4 / 4e-4, cispo 1 / 5 (clip_low 1: no lower
    #: bound), gmpo 0.4 / 0.4 (bounds of the log-ratio); sapo has no clip
    clip_low: float | None = None
    clip_high: float | None = None
    #: PPO's dual clip (ppo only)
    dual_clip: float | None = None
    #: SAPO's gate temperatures where the advantage is positive / not (sapo only)
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    value_clip: float | None = 0.5
    gamma: float = 1.0
    lam: float = 0.95
    #: KL to the reference: coefficient (0 = no reference model), estimator, and where it goes
    kl_coef: float = 0.01
    #: k1, k2 or k3 (None: k1 in the rewards, k3 in the loss; see :func:`kl_estimator`). k1 is refused in the
    #: loss, where its expected gradient is 0, unless kl_straight_through gives the loss k2's gradient
    kl_estimator: str | None = None
    kl_mode: str = "reward"  # "reward" (penalty in the rewards) | "loss" (a term of the actor loss)
    #: kl_mode loss: the KL term keeps the estimator's value with k2's gradient, importance-weighted by
    #: min(pi / pi_old, 10) (OpenRLHF's unbiased_gradient): its expected gradient is that of KL(policy || ref)
    kl_straight_through: bool = False
    kl_target: float | None = None
    kl_horizon: int = 10000
    entropy_coef: float = 0.0
    #: mixture-of-experts models (Qwen3-MoE, Qwen3-Next, Mixtral, GPT-OSS, ...): the router load-balancing loss
    #: (Switch Transformer's, as the model computes it) added to the actor loss with this coefficient, over the
    #: real tokens of each micro-batch (shared prompts counted once per sample, as unshared), logged as
    #: actor/router_aux_loss. None: what the model applies in its own training, its config's router_aux_loss_coef
    #: when output_router_logits is on, else 0 (off). A value > 0 needs a model with routers
    router_aux_loss_coef: float | None = None
    #: mixture-of-experts models: rollout routing replay (R3). The engine returns the experts every MoE layer
    #: chose for each token it sampled with, and the actor's forwards (old log-probs and the update) take those
    #: experts in place of their routers' own top-k, gate weights still from the live router scores (the router
    #: trains). Needs a backend with supports_routed_experts (the embedded engine); the actor's forwards then run
    #: the packed layout (each sequence's prompt its own). Logged on or off: rollout/k3_kl_engine_vs_trainer and
    #: rollout/frac_logp_gap_over_ln2
    routing_replay: bool = False
    #: how every loss term is reduced: token_mean, seq_mean (each row's token mean, then the rows' mean),
    #: seq_mean_token_sum (verl: each row's token sum, then the rows' mean), seq_mean_token_sum_norm (Dr.GRPO:
    #: that over the constant --rollout.max_new_tokens); none: the policy loss's own (seq_mean for the sequence
    #: losses gspo and gmpo, token_mean for the others)
    loss_aggregation: str | None = None
    #: how gae / reinforce / reinforce_baseline normalise their advantages over the batch's tokens: whiten,
    #: center (subtract the mean only: OpenRLHF's no_std_norm) or none (the group estimators never whiten)
    advantage_norm: str = "whiten"
    #: take the completions the engines cut at --rollout.max_new_tokens out of the actor's and critic's
    #: losses and their normaliser (their scores still count in their group's baseline); the truncation
    #: rate is logged as rollout/truncated_frac either way
    mask_truncated: bool = False
    #: clip each score to [-score_clip, score_clip] before any baseline or shaping (every estimator)
    score_clip: float | None = None
    #: truncated importance sampling against the engine's log-probs (None: off in sync rollout, 2.0 with
    #: --rollout.mode async, where samples come from older weights)
    tis_cap: float | None = None
    #: a lower bound of the TIS weight (None: none; needs a cap in force)
    tis_low: float | None = None
    #: truncate (clamp the weight into [tis_low, tis_cap]) or mask (tokens whose weight falls outside count 0:
    #: ICEPOP)
    tis_mode: str = "truncate"
    #: AReaL's decoupled PPO loss (rlhf_sg.algorithms.decoupled_policy_loss): the clip against the trainer's old
    #: log-probs recomputed at the step's start (the proximal policy), each token's loss weighted by pi_prox / pi_behav
    #: against the engine's log-probs (the behaviour policy); for async rollout with --rollout.max_staleness > 1.
    #: Replaces TIS (no --train.tis_cap with it)
    decoupled_loss: bool = False
    #: with decoupled_loss, tokens whose weight pi_prox / pi_behav exceeds this count 0 (None: no cap)
    decoupled_weight_cap: float | None = None
    #: drop groups whose scores are all equal (no signal for group estimators) and draw more prompts until
    #: the step's batch is full again (DAPO's dynamic sampling); needs n_samples_per_prompt >= 2
    dynamic_filtering: bool = False
    #: with dynamic_filtering, at most this many generation rounds per step; if the batch is still not full,
    #: it is filled up with filtered groups (logged as rollout/unfiltered_groups), which run through the
    #: forwards but stay out of the losses and their normaliser: they would only dilute the step's gradient
    dynamic_filtering_max_draws: int = 4
    #: with dynamic_filtering, also drop a group whose mean score is not strictly inside (lo, hi) (OpenRLHF's
    #: dynamic_filtering_range; e.g. 0,1 for pass/fail scores); groups are judged on the scores the
    #: advantages use (after the overlong penalty and --train.score_clip). Empty: off
    dynamic_filtering_range: list[float] = field(default_factory=list)
    #: critic-only steps before the actor starts training (PPO)
    critic_warmup_steps: int = 0
    seed: int = 42
    #: CPU: gloo + DeepSpeed's CPU accelerator; GPU: nccl
    device: str = "cpu"
    #: how a group's ranks are placed on Ray nodes: PACK (fill a node first), SPREAD (across nodes), STRICT_*
    placement_strategy: str = "PACK"
    #: colocation: reference rank i shares actor rank i's device (needs ref_num_ranks == actor_num_ranks)
    colocate_actor_ref: bool = False
    #: colocation: reward-model rank i shares critic rank i's device (needs reward.num_ranks == critic_num_ranks)
    colocate_critic_reward: bool = False
    #: everything on the actor's devices: every model rank i and engine i share device i (one tp-1 engine per
    #: actor rank); engines sleep while training, training states leave the device while engines generate
    colocate_all: bool = False
    #: move actor/critic ZeRO-3 states (params, grads, Adam) to host memory while the engines generate
    #: (None: on with colocate_all; GPU only, a no-op on CPU where they already live in host memory)
    offload_states_while_generating: bool | None = None
    #: torch threads per model-worker rank (None: on CPU the cores shared among the ranks that compute at the same
    #: time, the engines too with async rollout (Layout.worker_threads); on GPU 1)
    worker_threads: int | None = None
    #: seconds any remote call / collective may take before the run stops with a message
    timeout_s: float = 900.0


@dataclass
class DataConfig:
    #: JSONL / Parquet file, or a `datasets` save_to_disk directory
    prompt_data: str = ""
    input_key: str = "prompt"
    #: passed to the reward function as `label` (e.g. the reference answer); None = no label
    label_key: str | None = None
    apply_chat_template: bool = False
    max_prompt_len: int = 1024
    #: skip (and count) malformed rows instead of stopping at the first one
    skip_bad_rows: bool = False
    #: a prompt over max_prompt_len tokens: "error" (stop, naming the row), "drop" it, or "truncate" it to its
    #: last max_prompt_len tokens; dropped / truncated prompts are counted in the log
    overlong_prompts: str = "error"
    shuffle: bool = True
    #: a vision-language policy's rows: the key listing each prompt's images (rlhf_sg.vision.data)
    image_key: str = "images"
    #: fetch images named by an http(s) URL (off: such a row is refused, naming it)
    allow_image_urls: bool = False


@dataclass
class RewardConfig:
    #: "function" (a Python rule), "model" (a reward model group), "remote" (HTTP scorer)
    kind: str = "function"
    #: module:function taking (prompts, completions, labels) -> list of floats; or a built-in verifiable reward
    #: (math_answer, exact_match, think_format) or a weighted sum NAME=WEIGHT,... (rlhf_sg/verifiable.py)
    function: str | None = None
    url: str | None = None
    #: name of the environment variable holding the remote scorer's bearer token (the token itself never
    #: goes in a flag or YAML file: those reach shell history and <output_dir>/config.json)
    token_env: str | None = None
    #: PEM file of the CA that signed the remote scorer's certificate (https; a private CA). Certificates
    #: are always checked
    ca_file: str | None = None
    num_ranks: int = 1
    #: a reward function that raises, returns a non-number or no answer for a completion: "raise" (stop,
    #: naming the function and the sample) or "zero" (score it 0 and count it in reward/errors)
    on_error: str = "raise"
    #: seconds a reward function (or the remote scorer) may take for a step's batch (None: --train.timeout_s)
    timeout_s: float | None = None
    #: times a remote scorer that is down, slow or answers 5xx is asked again (waiting 1, 2, 4, ... s)
    retries: int = 3
    #: DAPO's overlong reward shaping: a completion longer than max_new_tokens - overlong_buffer_len tokens gets
    #: min(-(length - (max_new_tokens - buffer)) / buffer * overlong_penalty_factor, 0) added to its score
    #: (None: off)
    overlong_buffer_len: int | None = None
    overlong_penalty_factor: float = 1.0


@dataclass
class LogConfig:
    output_dir: str = "runs/rlhf_sg"
    save_steps: int = 0  # 0 = only at the end
    resume: bool = False
    tensorboard: bool = True
    wandb_project: str | None = None
    #: profile this step (0 = the first): one Chrome trace per actor rank in <output_dir>/profile (None = off)
    profile_step: int | None = None
    export_hf: bool = True
    progress_bar: bool = True


@dataclass
class EvalConfig:
    #: held-out prompts, in the training data's formats and keys (--data.input_key, --data.label_key);
    #: None: no evaluation
    prompt_data: str | None = None
    #: evaluate every `interval` steps (0: only before the first and after the last step, as asked below)
    interval: int = 0
    before_train: bool = True
    after_train: bool = True
    #: the first max_prompts prompts of the file (None: all)
    max_prompts: int | None = None
    n_samples: int = 1
    #: sampling temperature (None: --rollout.temperature); max_new_tokens (None: --rollout.max_new_tokens)
    temperature: float | None = None
    max_new_tokens: int | None = None
    #: also one greedy sample per prompt: eval/greedy_accuracy
    greedy: bool = False
    #: pass@k for each k <= n_samples (the unbiased estimator)
    k: list[int] = field(default_factory=lambda: [1])
    #: the reward function scoring evaluation samples (None: --reward.function); a built-in name or module:function
    reward_function: str | None = None
    #: a sample is correct when its score >= threshold
    threshold: float = 1.0


LORA_SYNC_MODES = ("merged", "adapter")


@dataclass
class LoraConfig:
    #: LoRA rank of the actor's adapters (0: off, the actor trains every weight)
    rank: int = 0
    #: the adapters' scale is alpha / rank (alpha / sqrt(rank) with rslora)
    alpha: float = 16.0
    #: dropout on the adapters' input; forced to 0 with --train.disable_dropout
    dropout: float = 0.0
    #: the modules given adapters: "all-linear" (every linear layer but the output head) or module names,
    #: comma-separated names (q_proj,v_proj)
    target_modules: str = "all-linear"
    rslora: bool = False
    #: how the engines get the policy: "merged" (W + scale * B @ A in the send buffer, every backend) or "adapter"
    #: (only the LoRA tensors; backends that declare they can load an adapter)
    sync_mode: str = "merged"
    #: start from this saved PEFT adapter directory (adapter_config.json + adapter_model.safetensors); the
    #: reference is then that adapter, frozen (a reference group runs it)
    init_adapter: str | None = None
    #: the final export (--log.export_hf) also writes the merged model, in <output_dir>/final_hf/merged
    export_merged: bool = False


@dataclass
class AgentConfig:
    #: multi-turn rollouts: the environment factory, module:factory, called as factory(tokenizer) once per
    #: trajectory (rlhf_sg.agent); None: single-turn rollouts
    env: str | None = None
    #: model turns per trajectory at most
    max_turns: int = 4
    #: tokens one model turn may sample (None: --rollout.max_new_tokens, the whole trajectory's budget)
    max_turn_tokens: int | None = None
    #: token ids that end a model turn (besides --rollout.stop_token_ids and EOS); they stay in the turn
    stop_token_ids: list[int] = field(default_factory=list)
    #: an observation that does not fit the budget left: "rollback" (dropped) or "truncate" (cut to fit); the
    #: trajectory ends either way ("overflow")
    overflow: str = "rollback"
    #: one environment step (a tool call) at most this long; then an error observation (kind "timeout")
    tool_timeout_s: float = 30.0
    #: threads running environment steps (daemon threads: a step that never returns does not hold the process at
    #: exit; past its timeout it is given up and another thread takes its place)
    env_workers: int = 8
    #: steps given up at their timeout whose threads still run, at most; one more stops the run (a tool that never
    #: returns: give it a deadline of its own)
    max_hung_steps: int = 64
    #: an observation is cut to this many tokens
    max_observation_tokens: int = 256
    #: an error observation's message is cut to this many characters
    max_error_chars: int = 200
    #: what the reward function sees: "model" (the model's turns only) or "all" (observations included)
    reward_text: str = "model"
    #: the environment's own reward: "ignore", "add" (to the reward function's score) or "replace" it
    env_reward: str = "ignore"
    #: agent harness rollouts: an async function, module:function, (base_url, api_key, prompt) -> reward | None, run
    #: once per sample against the trainer's OpenAI-compatible endpoint (rlhf_sg.serve.harness); its calls become
    #: the rows and its return value (or the reward it posted) the score. Exclusive with env
    harness: str | None = None
    #: harness runs at once, at most
    harness_workers: int = 8
    #: one harness run at most this long; then its sample is unscored
    harness_timeout_s: float = 600.0
    #: compare each turn boundary with the tokenizer's chat template (the glue after the end-of-turn token at the
    #: start of the observation): "off", "warn" (log and count, agent/template_mismatch) or "strict" (stop the run)
    template_check: str = "warn"


@dataclass
class PerfConfig:
    #: per-phase FLOP and bandwidth accounting (perf/* metrics, README "Each phase against the machine's limit")
    accounting: bool = True
    #: one device's dense matmul peak in TFLOP/s at --model.dtype (None: the device table on GPU, measured on CPU)
    peak_tflops: float | None = None
    #: one device's memory bandwidth in GB/s (None: the device table on GPU, measured on CPU)
    peak_bandwidth_gbs: float | None = None


@dataclass
class DistillConfig:
    #: on-policy distillation: the teacher, a local HF causal-LM directory with the policy's tokenizer (vocabulary,
    #: special tokens and padded vocab size, checked before Ray starts); it scores the policy's sampled tokens and
    #: each token's advantage gets coef * (log pi_teacher - log pi_old) (the negative reverse KL, discount 0).
    #: None: no distillation
    teacher: str | None = None
    #: ranks of the teacher group (a forward-only model, run like the reference)
    num_ranks: int = 1
    #: weight of the teacher's per-token term in the advantages
    coef: float = 1.0
    #: the teacher's term is the whole advantage: the advantage estimator is not run (no critic is started) and
    #: the reward, when one is set, is scored and logged but not trained on; the KL penalty in the rewards
    #: (--train.kl_mode reward) is added per token. A run with only needs no --reward.function
    only: bool = False


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    log: LogConfig = field(default_factory=LogConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    perf: PerfConfig = field(default_factory=PerfConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}
ALIASES = {
    "--backend": "rollout.backend",
    "--model": "model.pretrain",
    "--prompt-data": "data.prompt_data",
    "--algo": "train.advantage_estimator",
    "--output-dir": "log.output_dir",
    "--max-steps": "train.max_steps",
}


# ---- filling ------------------------------------------------------------------------------------------


def _section_classes() -> dict[str, type]:
    hints = typing.get_type_hints(Config)
    return {name: hints[name] for name in SECTIONS}


def _coerce(flag: str, typ: Any, raw: Any) -> Any:
    """Turn a YAML value or a CLI string into ``typ``; errors name the flag."""
    origin = typing.get_origin(typ)
    args = typing.get_args(typ)
    if origin in (typing.Union, types.UnionType):
        if raw is None or (isinstance(raw, str) and raw.lower() in ("none", "null")):
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(flag, inner[0], raw)
    try:
        if typ is bool:
            if isinstance(raw, bool):
                return raw
            if str(raw).lower() in ("1", "true", "yes", "on"):
                return True
            if str(raw).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if typ is int:
            if isinstance(raw, float) and not raw.is_integer():
                raise ValueError
            return int(float(raw)) if isinstance(raw, str) and "e" in raw.lower() else int(raw)
        if typ is float:
            return float(raw)
        if typ is str:
            return str(raw)
        if origin is list:
            items = raw if isinstance(raw, list) else [x for x in str(raw).replace(",", " ").split() if x]
            return [_coerce(flag, args[0], x) for x in items]
        if origin is dict:
            if isinstance(raw, dict):
                return dict(raw)
            import json

            value = json.loads(raw)
            if not isinstance(value, dict):
                raise TypeError
            return value
    except (ValueError, TypeError, OverflowError) as e:
        raise ConfigError(f"{flag}: cannot read {raw!r} as {getattr(typ, '__name__', typ)}") from e
    return raw


def dotted_keys() -> list[str]:
    """Every setting as ``section.key``."""
    return [f"{s}.{f.name}" for s, cls in _section_classes().items() for f in dataclasses.fields(cls)]


def _closest(name: str, candidates: list[str]) -> str | None:
    """What ``name`` was meant to be: the candidate with the same key in another section (or with a section,
    where ``name`` has none), else the one it most likely misspells (difflib), else None."""
    key = name.rpartition(".")[2]
    same_key = next((c for c in candidates if c.rpartition(".")[2] == key), None)
    if same_key is not None:
        return same_key
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return close[0] if close else None


#: PEFT LoRA options no rollout engine serves from a synced adapter or merge (vLLM refuses DoRA and
#: modules_to_save; per-module ranks and alphas would need a rank per engine module): refused by name
LORA_REFUSED = {
    "use_dora": "DoRA (a learned magnitude per output channel)",
    "modules_to_save": "modules_to_save (fully trained copies of whole modules)",
    "rank_pattern": "rank_pattern (a rank per module)",
    "alpha_pattern": "alpha_pattern (an alpha per module)",
}


def _refused_lora_option(key: str, where: str) -> ConfigError:
    return ConfigError(f"{where}: {LORA_REFUSED[key]} is not supported: the engines are given one rank, one alpha "
                       "and plain LoRA on linear layers; drop it (use --lora.rank, --lora.alpha, "
                       "--lora.target_modules)")


def _did_you_mean(dotted: str) -> str:
    close = _closest(dotted, dotted_keys())
    return f" (did you mean {close!r}?)" if close else ""


def apply_overrides(cfg: Config, overrides: dict[str, Any], source: str) -> Config:
    """Set dotted keys (``rollout.backend``) on ``cfg``; unknown keys are errors naming ``source``."""
    classes = _section_classes()
    for dotted, raw in overrides.items():
        section, _, key = str(dotted).partition(".")
        if section not in classes or not key:
            raise ConfigError(f"{source}: unknown setting {dotted!r}{_did_you_mean(str(dotted))}; sections are "
                              f"{sorted(classes)}")
        hints = typing.get_type_hints(classes[section])
        if section == "lora" and key in LORA_REFUSED:
            raise _refused_lora_option(key, f"--{dotted}" if source == "flag" else f"{source}: {dotted}")
        if key not in hints:
            raise ConfigError(
                f"{source}: unknown setting {dotted!r}{_did_you_mean(str(dotted))}; {section} has {sorted(hints)}"
            )
        label = f"--{dotted}" if source == "flag" else f"{source}: {dotted}"
        setattr(getattr(cfg, section), key, _coerce(label, hints[key], raw))
    return cfg


def load_yaml(path: str) -> dict[str, Any]:
    """Flatten a YAML file of sections into dotted keys."""
    import yaml

    if not os.path.isfile(path):
        raise ConfigError(f"--config: file {path!r} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{where}: not valid YAML ({getattr(e, 'problem', None) or e}); sections of "
                          "`key: value` lines are expected") from None
    except (UnicodeDecodeError, OSError) as e:
        raise ConfigError(f"--config: cannot read {path!r} as UTF-8 text ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections ({', '.join(SECTIONS)})")
    flat: dict[str, Any] = {}
    for section, values in data.items():
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: section {section!r} must be a mapping, got {type(values).__name__}")
        for key, value in values.items():
            flat[f"{section}.{key}"] = value
    return flat


def build_parser(prog: str = "rlhf-sg train-ppo") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Train a policy with PPO / GRPO / Dr.GRPO / RLOO / REINFORCE++. Every setting is a dotted flag "
        "(--section.key value); a YAML file (--config) fills the same keys; flags win over the file.",
    )
    parser.add_argument("--config", help="YAML file with sections " + ", ".join(SECTIONS))
    for alias, dotted in ALIASES.items():
        parser.add_argument(alias, dest=dotted, default=argparse.SUPPRESS, help=f"alias of --{dotted}")
    for section, cls in _section_classes().items():
        group = parser.add_argument_group(section)
        defaults = cls()
        for f in dataclasses.fields(cls):
            default = getattr(defaults, f.name)
            group.add_argument(
                f"--{section}.{f.name}", dest=f"{section}.{f.name}", default=argparse.SUPPRESS, metavar="V",
                help=f"(default: {default!r})",
            )
    return parser


def parse_args(argv: list[str] | None = None) -> Config:
    """Config from CLI flags (and ``--config`` YAML); validated."""
    known, extra = build_parser().parse_known_args(argv)
    if extra:
        flag = next((a for a in extra if a.startswith("-")), None)
        if flag is None:
            raise ConfigError(f"unexpected argument {extra[0]!r}: settings are given as --section.key value")
        name = flag.split("=", 1)[0]
        if name.startswith("--lora.") and name[len("--lora."):] in LORA_REFUSED:
            raise _refused_lora_option(name[len("--lora."):], name)
        close = _closest(name.lstrip("-"), dotted_keys() + [a.lstrip("-") for a in ALIASES])
        hint = f" (did you mean --{close}?)" if close else ""
        raise ConfigError(f"unknown flag {name}{hint}; `rlhf-sg train-ppo --help` lists every setting")
    ns = vars(known)
    cfg = Config()
    path = ns.pop("config", None)
    if path:
        apply_overrides(cfg, load_yaml(path), path)
    apply_overrides(cfg, ns, "flag")
    validate(cfg)
    return cfg


# ---- validation ----------------------------------------------------------------------------------------


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _check_model_dir(flag: str, path: str) -> None:
    """A model directory's config.json reads as a JSON object and weights lie beside it."""
    import json

    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            ok = isinstance(json.load(f), dict)
    except (OSError, ValueError):
        ok = False
    _need(ok, f"{flag}: {os.path.join(path, 'config.json')!r} is not a JSON object; re-save the model with "
              "save_pretrained")
    _need(any(name.endswith((".safetensors", ".bin")) for name in os.listdir(path)),
          f"{flag}: {path!r} has a config.json but no weights (*.safetensors or *.bin); save the model with "
          "save_pretrained or point at the directory that holds them")


#: config.json keys that count a mixture-of-experts model's experts (Qwen-MoE / Qwen3-Next, Mixtral / GPT-OSS,
#: DeepSeek-style)
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def _has_experts(path: str) -> bool:
    """Whether the model directory's config.json (or its text_config) counts experts."""
    import json

    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    return any(isinstance(c, dict) and any(c.get(k) for k in _EXPERT_KEYS)
               for c in (config, config.get("text_config")))


def is_vision_language(path: str) -> bool:
    """Whether the model directory's config.json has a vision tower (``vision_config``)."""
    import json

    if not os.path.isfile(os.path.join(path, "config.json")):
        return False
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        return isinstance(json.load(f).get("vision_config"), dict)


def _model_type(path: str) -> str | None:
    """``model_type`` of the model directory's config.json (None without one)."""
    import json

    if not os.path.isfile(os.path.join(path, "config.json")):
        return None
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        return json.load(f).get("model_type")


#: what a vision-language policy's run does not carry images through yet: (the setting is on, the flag, why)
_VISION_NOT_YET = (
    (lambda c: c.rollout.backend not in ("hf", "vllm"), "--rollout.backend",
     "only the embedded engine (hf) and vLLM generate with images: SGLang 0.5.23 cannot load a Qwen-VL model here "
     "(its Qwen-VL image processor imports kernels of sgl-kernel's CPU build, not on PyPI, and its Qwen2-VL tower "
     "reads vision_config.in_chans, which transformers 5 names in_channels), so the SGLang backend passes no "
     "image_data; use --rollout.backend hf or vllm"),
    (lambda c: c.rollout.backend == "vllm" and _model_type(c.model.pretrain) not in ("qwen2_vl", "qwen2_5_vl"),
     "--rollout.backend vllm", "the vLLM backend hands images to vLLM for Qwen2-VL and Qwen2.5-VL models only; "
     "use --rollout.backend hf"),
    (lambda c: uses_critic_model(c), "--train.advantage_estimator",
     "a critic's values do not take images yet; use a critic-free estimator (grpo, dr_grpo, rloo, reinforce++)"),
    (lambda c: c.rollout.mode != "sync", "--rollout.mode", "async rollouts do not carry images yet; use sync"),
    (lambda c: bool(c.agent.env or c.agent.harness), "--agent.env / --agent.harness",
     "multi-turn rollouts do not carry images yet"),
    (lambda c: c.lora.rank > 0, "--lora.rank", "LoRA on a vision-language policy is not wired yet"),
    (lambda c: c.reward.kind == "model", "--reward.kind model", "a reward model does not see the images"),
    (lambda c: c.train.routing_replay, "--train.routing_replay", "routing replay does not carry images yet"),
    (lambda c: not c.model.freeze_vision_tower and c.train.actor_num_ranks > 1, "--model.freeze_vision_tower false",
     "a trained vision tower under ZeRO-3 with several ranks needs a gradient-carrying pass on text-only "
     "micro-batches, not built yet; keep the tower frozen or train on one rank"),
)


def _check_vision_policy(cfg: Config) -> None:
    """A vision-language policy: the settings whose paths do not carry images yet are refused, naming the flag."""
    for on, flag, why in _VISION_NOT_YET:
        _need(not on(cfg), f"{flag}: {cfg.model.pretrain!r} is a vision-language policy and {why}")


def _position_dependent_rope(path: str) -> tuple[str, int] | None:
    """(rope type, original_max_position_embeddings) when the model directory's RoPE picks its frequencies per
    forward from the longest sequence (``longrope``, ``dynamic``: see :func:`rlhf_sg.packing.check_rope_regime`)."""
    import json

    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    for c in (config, config.get("text_config")):
        if not isinstance(c, dict):
            continue
        params = c.get("rope_parameters") or c.get("rope_scaling")
        if not isinstance(params, dict):
            continue
        for entry in [params] + [v for v in params.values() if isinstance(v, dict)]:
            kind = entry.get("rope_type", entry.get("type"))
            if kind in ("longrope", "dynamic"):
                original = (c.get("original_max_position_embeddings") or entry.get("original_max_position_embeddings")
                            or c.get("max_position_embeddings"))
                return (kind, int(original)) if original else None
    return None


def _heads(path: str) -> tuple[int, int] | None:
    """(attention heads, key/value heads) from a model directory's config.json (or its text_config); None when
    it names none."""
    import json

    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    for c in (config, config.get("text_config")):
        if isinstance(c, dict) and isinstance(c.get("num_attention_heads"), int):
            return c["num_attention_heads"], c.get("num_key_value_heads") or c["num_attention_heads"]
    return None


def sequence_parallel_size(cfg: Config, role: str) -> tuple[str, int]:
    """``role``'s SP group size and the flag that sets it: ``--train.<role>_sequence_parallel_size`` where given
    (actor, critic, ref, reward, teacher), else ``--train.sequence_parallel_size``; 1 for the groups that do not
    split rows."""
    t = cfg.train
    if role not in ("actor", "critic", "ref", "reward", "teacher"):
        return "--train.sequence_parallel_size", 1
    own = getattr(t, f"{role}_sequence_parallel_size")
    if own is None:
        return "--train.sequence_parallel_size", t.sequence_parallel_size
    return f"--train.{role}_sequence_parallel_size", own


def scoring_groups(cfg: Config) -> list[str]:
    """The groups that run forwards over the batch's rows: the actor, and the critic, reference, teacher and reward
    model where the run has them."""
    groups = ["actor"]
    if uses_critic_model(cfg):
        groups.append("critic")
    if cfg.train.kl_coef > 0 and not ref_in_actor(cfg):
        groups.append("ref")
    if cfg.distill.teacher is not None:
        groups.append("teacher")
    if cfg.reward.kind == "model":
        groups.append("reward")
    return groups


def microbatch_tokens(cfg: Config, role: str) -> int:
    """The real tokens one micro-batch of ``role``'s group may hold. --train.max_tokens_per_microbatch counts what
    ONE rank holds; the ranks of an SP group of N split every row of their micro-batches, each holding 1 / N of it
    (:mod:`rlhf_sg.parallel`), so the group's micro-batch takes N times the budget."""
    return cfg.train.max_tokens_per_microbatch * sequence_parallel_size(cfg, role)[1]


def row_token_limit(cfg: Config) -> int:
    """The most tokens one rollout row may hold where nothing else caps it (a harness's row: its last call's prompt
    and completion): the engines' context, and one micro-batch of every group that scores it (N x the budget for an
    SP group of N, :func:`microbatch_tokens`)."""
    return min(cfg.rollout.max_model_len, *(microbatch_tokens(cfg, role) for role in scoring_groups(cfg)))


def _check_microbatch_budget(cfg: Config) -> None:
    """One full sequence (max_prompt_len + max_new_tokens) must fit one rank of every group that scores rows: whole
    where the group does not split rows, its 1 / N share (the row padded to a multiple of N) in an SP group of N."""
    budget, longest = cfg.train.max_tokens_per_microbatch, cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
    for role in scoring_groups(cfg):
        flag, n = sequence_parallel_size(cfg, role)
        share = -(-longest // n)
        if share <= budget:
            continue
        at_least = -(-longest // budget)
        if n == 1:
            raise ConfigError(
                f"--train.max_tokens_per_microbatch ({budget}) must hold one full sequence (max_prompt_len + "
                f"max_new_tokens = {longest}) on one rank of the {role} group; raise it to {longest}, or split the "
                f"rows over an SP group ({flag} N: a rank holds {longest} / N tokens of a row, N >= {at_least})")
        raise ConfigError(
            f"--train.max_tokens_per_microbatch ({budget}) must hold a rank's share of one full sequence "
            f"(max_prompt_len + max_new_tokens = {longest} over {flag} {n}: {share} tokens) in the {role} group; "
            f"raise it to {share}, or {flag} to at least {at_least}")


def _check_sequence_parallel(cfg: Config) -> None:
    """--train.sequence_parallel_size and the per-group sizes: each divides the ranks of the group it splits (actor,
    critic, reference, reward model, teacher) and that model's heads split over it; what the SP groups do not run
    yet is refused by the flag of a group that splits."""
    from rlhf_sg.parallel.heads import check_sequence_parallel_heads

    m, t, rw = cfg.model, cfg.train, cfg.reward
    _need(t.sequence_parallel_size >= 1,
          f"--train.sequence_parallel_size must be >= 1, got {t.sequence_parallel_size}")
    critic = t.advantage_estimator == "gae"
    groups = (("actor", "--train.actor_num_ranks", t.actor_num_ranks, m.pretrain, True),
              ("critic", "--train.critic_num_ranks", t.critic_num_ranks,
               m.critic_pretrain or m.reward_pretrain or m.pretrain, critic),
              ("ref", "--train.ref_num_ranks", t.ref_num_ranks, m.pretrain, t.kl_coef > 0),
              ("reward", "--reward.num_ranks", rw.num_ranks, m.reward_pretrain, rw.kind == "model"),
              ("teacher", "--distill.num_ranks", cfg.distill.num_ranks, cfg.distill.teacher,
               cfg.distill.teacher is not None))
    split = []  # (flag, size) of each group that splits its rows
    for role, ranks_flag, ranks, path, used in groups:
        flag, n = sequence_parallel_size(cfg, role)
        _need(n >= 1, f"{flag} must be >= 1, got {n}")
        if not used or n == 1:
            continue
        split.append((flag, n))
        _need(ranks % n == 0, f"{flag} {n}: {ranks_flag} {ranks} is not a multiple of it (a group's ranks are "
                              f"data-parallel ranks x {n}); set {ranks_flag} to a multiple of {n}")
        heads = _heads(path) if path and os.path.isfile(os.path.join(path, "config.json")) else None
        if heads is not None:
            check_sequence_parallel_heads(path, *heads, n, flag)
    if not split:
        return
    flag, n = split[0]
    policy = m.pretrain if m.pretrain and os.path.isfile(os.path.join(m.pretrain, "config.json")) else None
    # what the SP groups do not run yet: each refused by its flag
    refused = (
        ("--train.routing_replay", t.routing_replay, "routes are replayed per whole row, not per shard"),
        ("--model.pretrain (a mixture-of-experts model)", policy is not None and _has_experts(policy),
         "its router loss would see one shard's tokens"),
        ("--model.pretrain (a vision-language model)", policy is not None and is_vision_language(policy),
         "image features are not split across ranks"),
    )
    for what, hit, reason in refused:
        _need(not hit, f"{flag} {n} with {what}: {reason} (or set {flag} 1)")


def validate(cfg: Config) -> Config:
    """Everything checkable without starting Ray; raises ConfigError naming the flag."""
    m, r, t, d, rw = cfg.model, cfg.rollout, cfg.train, cfg.data, cfg.reward
    _need(bool(m.pretrain), "--model.pretrain is required: a local Hugging Face model directory")
    for flag, path in (("--model.pretrain", m.pretrain), ("--model.critic_pretrain", m.critic_pretrain),
                       ("--model.reward_pretrain", m.reward_pretrain), ("--distill.teacher", cfg.distill.teacher)):
        if path:
            _need(os.path.isfile(os.path.join(path, "config.json")),
                  f"{flag}: {path!r} is not a model directory (no config.json there); save the model with "
                  "save_pretrained or point at its directory")
            _check_model_dir(flag, path)
    for flag, path in (("--model.critic_pretrain", m.critic_pretrain), ("--model.reward_pretrain", m.reward_pretrain),
                       ("--distill.teacher", cfg.distill.teacher)):
        _need(not (path and is_vision_language(path)),
              f"{flag}: {path!r} is a vision-language model; only the policy (and its reference) take images in "
              "this trainer; give a text model here")
    if m.pretrain and is_vision_language(m.pretrain):
        _check_vision_policy(cfg)
    if (t.router_aux_loss_coef or 0) > 0 and m.pretrain and os.path.isfile(os.path.join(m.pretrain, "config.json")):
        _need(_has_experts(m.pretrain),
              f"--train.router_aux_loss_coef {t.router_aux_loss_coef}: {m.pretrain!r} is not a mixture-of-experts "
              f"model (its config.json has none of {list(_EXPERT_KEYS)}), so it has no router loss; leave the flag "
              "unset or set it to 0")
    for flag, path in (("--model.pretrain", m.pretrain), ("--model.critic_pretrain", m.critic_pretrain),
                       ("--model.reward_pretrain", m.reward_pretrain), ("--distill.teacher", cfg.distill.teacher)):
        rope = _position_dependent_rope(path) if path and os.path.isfile(os.path.join(path, "config.json")) else None
        longest = cfg.data.max_prompt_len + r.max_new_tokens
        _need(rope is None or longest <= rope[1],
              f"{flag}: {path!r} has a {rope and rope[0]} RoPE, which takes one set of frequencies per forward from "
              f"its longest sequence once one is over original_max_position_embeddings={rope and rope[1]}: a batch "
              f"with sequences on both sides would not give each what it gives alone. Sequences here reach "
              f"{longest} tokens; set --data.max_prompt_len + --rollout.max_new_tokens <= {rope and rope[1]}")
    _need(m.dtype in ("float32", "bfloat16"), f"--model.dtype must be float32 or bfloat16, got {m.dtype!r}")
    _need(m.attn_implementation in ("sdpa", "eager", "flash_attention_2"),
          f"--model.attn_implementation must be sdpa, eager or flash_attention_2, got {m.attn_implementation!r}")
    _need(t.advantage_estimator in advantage_estimators(),
          f"--train.advantage_estimator {t.advantage_estimator!r} unknown; choose one of {advantage_estimators()} "
          "(or register your own with rlhf_sg.advantages.register_advantage_estimator)")
    if advantage_estimator(t.advantage_estimator).needs_groups and not distill_only(cfg):
        _need(r.n_samples_per_prompt >= 2,
              f"--train.advantage_estimator {t.advantage_estimator} compares samples of the same prompt: set "
              f"--rollout.n_samples_per_prompt >= 2 (got {r.n_samples_per_prompt})")
    if t.dynamic_filtering:
        _need(r.n_samples_per_prompt >= 2,
              "--train.dynamic_filtering drops groups of samples of one prompt whose scores are all equal; with "
              f"--rollout.n_samples_per_prompt {r.n_samples_per_prompt} every group is one sample and would be "
              "dropped: set --rollout.n_samples_per_prompt >= 2 or turn --train.dynamic_filtering off")
    _need(t.dynamic_filtering_max_draws >= 1,
          f"--train.dynamic_filtering_max_draws must be >= 1, got {t.dynamic_filtering_max_draws}")
    _need(t.score_clip is None or t.score_clip > 0, f"--train.score_clip must be > 0 (got {t.score_clip})")
    _need(t.lr_scheduler in LR_SCHEDULERS,
          f"--train.lr_scheduler must be one of {list(LR_SCHEDULERS)}, got {t.lr_scheduler!r}")
    _need(r.max_engine_restarts >= 0, f"--rollout.max_engine_restarts must be >= 0, got {r.max_engine_restarts}")
    _need(t.max_nonfinite_steps >= 1, f"--train.max_nonfinite_steps must be >= 1, got {t.max_nonfinite_steps}")
    _need(0 <= t.lr_warmup_ratio < 1, f"--train.lr_warmup_ratio must be in [0, 1), got {t.lr_warmup_ratio}")
    _need(rw.on_error in ("raise", "zero"), f"--reward.on_error must be raise or zero, got {rw.on_error!r}")
    _need(rw.timeout_s is None or rw.timeout_s > 0, f"--reward.timeout_s must be > 0, got {rw.timeout_s}")
    _need(rw.retries >= 0, f"--reward.retries must be >= 0, got {rw.retries}")
    for literal in ("api_key", "admin_api_key"):
        _need(literal not in r.engine_kwargs,
              f"--rollout.engine_kwargs['{literal}']: keys never go in the config (it is saved to "
              f"<output_dir>/config.json); put the key in an environment variable and set "
              f"engine_kwargs['{literal}_env'] to its name")
    _need(r.memory_fraction is None or 0 < r.memory_fraction <= 1,
          f"--rollout.memory_fraction must be in (0, 1] (a share of each engine device), got {r.memory_fraction}")
    _need(t.kl_estimator is None or t.kl_estimator in KL_KINDS,
          f"--train.kl_estimator must be one of {list(KL_KINDS)}, got {t.kl_estimator!r}")
    _need(t.kl_mode in ("reward", "loss"), f"--train.kl_mode must be 'reward' or 'loss', got {t.kl_mode!r}")
    _need(not (t.kl_mode == "loss" and t.kl_estimator == "k1" and not t.kl_straight_through),
          "--train.kl_mode loss with --train.kl_estimator k1: k1's gradient is grad log pi, whose expectation "
          "under the policy is 0, so the KL term would not pull the policy toward the reference; use "
          "--train.kl_estimator k3 (the loss default) or k2, or add --train.kl_straight_through")
    _need(not t.kl_straight_through or t.kl_mode == "loss",
          "--train.kl_straight_through shapes the gradient of the KL term of the loss: it needs "
          "--train.kl_mode loss (in the rewards the KL has no gradient)")
    _need(t.kl_coef >= 0, f"--train.kl_coef must be >= 0, got {t.kl_coef}")
    _need(t.loss_aggregation is None or t.loss_aggregation in AGGREGATIONS,
          f"--train.loss_aggregation must be one of {list(AGGREGATIONS)}, got {t.loss_aggregation!r}")
    _need(t.advantage_norm in ADVANTAGE_NORMS,
          f"--train.advantage_norm must be one of {list(ADVANTAGE_NORMS)}, got {t.advantage_norm!r}")
    _need(t.tis_mode in TIS_MODES, f"--train.tis_mode must be one of {list(TIS_MODES)}, got {t.tis_mode!r}")
    _need(t.tis_low is None or (tis_cap(cfg) is not None and 0 <= t.tis_low < tis_cap(cfg)),
          f"--train.tis_low {t.tis_low}: a lower bound of the TIS weight needs a cap in force (--train.tis_cap, or "
          f"async rollout's {ASYNC_TIS_CAP}) above it, and must be >= 0; the cap is {tis_cap(cfg)}")
    rng = t.dynamic_filtering_range
    _need(not rng or (len(rng) == 2 and rng[0] < rng[1]),
          f"--train.dynamic_filtering_range takes two scores lo,hi with lo < hi (a group is kept when its mean score "
          f"is strictly inside), got {rng}")
    _need(not rng or t.dynamic_filtering, "--train.dynamic_filtering_range needs --train.dynamic_filtering")
    if rw.overlong_buffer_len is not None:
        _need(0 < rw.overlong_buffer_len <= r.max_new_tokens,
              f"--reward.overlong_buffer_len must be in (0, --rollout.max_new_tokens = {r.max_new_tokens}], got "
              f"{rw.overlong_buffer_len}")
    _need(rw.overlong_penalty_factor >= 0,
          f"--reward.overlong_penalty_factor must be >= 0, got {rw.overlong_penalty_factor}")
    for flag, v in (("--train.actor_num_ranks", t.actor_num_ranks), ("--train.critic_num_ranks", t.critic_num_ranks),
                    ("--train.ref_num_ranks", t.ref_num_ranks), ("--rollout.num_engines", r.num_engines),
                    ("--rollout.prompts_per_step", r.prompts_per_step), ("--train.max_steps", t.max_steps),
                    ("--train.ppo_epochs", t.ppo_epochs), ("--train.num_minibatches", t.num_minibatches),
                    ("--rollout.max_new_tokens", r.max_new_tokens),
                    ("--rollout.tensor_parallel_size", r.tensor_parallel_size),
                    ("--rollout.n_samples_per_prompt", r.n_samples_per_prompt),
                    ("--data.max_prompt_len", d.max_prompt_len), ("--train.kl_horizon", t.kl_horizon)):
        _need(v >= 1, f"{flag} must be >= 1, got {v}")
    _need(t.worker_threads is None or t.worker_threads >= 1,
          f"--train.worker_threads must be >= 1, got {t.worker_threads}")
    for flag, v, ok, allowed in (
        ("--train.actor_lr", t.actor_lr, t.actor_lr >= 0 and math.isfinite(t.actor_lr), ">= 0"),
        ("--train.critic_lr", t.critic_lr, t.critic_lr >= 0 and math.isfinite(t.critic_lr), ">= 0"),
        ("--train.weight_decay", t.weight_decay, t.weight_decay >= 0, ">= 0"),
        ("--train.max_grad_norm", t.max_grad_norm, t.max_grad_norm > 0, "> 0"),
        ("--train.gamma", t.gamma, 0 <= t.gamma <= 1, "in [0, 1]"),
        ("--train.lam", t.lam, 0 <= t.lam <= 1, "in [0, 1]"),
        ("--train.entropy_coef", t.entropy_coef, t.entropy_coef >= 0, ">= 0"),
        ("--train.sapo_tau_pos", t.sapo_tau_pos, t.sapo_tau_pos > 0 and math.isfinite(t.sapo_tau_pos), "> 0"),
        ("--train.sapo_tau_neg", t.sapo_tau_neg, t.sapo_tau_neg > 0 and math.isfinite(t.sapo_tau_neg), "> 0"),
        ("--train.router_aux_loss_coef", t.router_aux_loss_coef,
         t.router_aux_loss_coef is None or (t.router_aux_loss_coef >= 0 and math.isfinite(t.router_aux_loss_coef)),
         ">= 0 (or none: the model's own)"),
        ("--train.value_clip", t.value_clip, t.value_clip is None or t.value_clip > 0, "> 0 (or none)"),
        ("--train.kl_target", t.kl_target, t.kl_target is None or t.kl_target > 0, "> 0 (or none)"),
        ("--train.critic_warmup_steps", t.critic_warmup_steps, t.critic_warmup_steps >= 0, ">= 0"),
        ("--train.timeout_s", t.timeout_s, t.timeout_s > 0, "> 0"),
        ("--rollout.top_p", r.top_p, 0 < r.top_p <= 1, "in (0, 1]"),
        ("--rollout.top_k", r.top_k, r.top_k == -1 or r.top_k >= 1, "-1 (off) or >= 1"),
        ("--log.profile_step", cfg.log.profile_step, cfg.log.profile_step is None or cfg.log.profile_step >= 0,
         ">= 0 (or none)"),
    ):
        _need(ok, f"{flag} must be {allowed}, got {v}")
    _need(d.overlong_prompts in OVERLONG_PROMPTS,
          f"--data.overlong_prompts must be one of {list(OVERLONG_PROMPTS)}, got {d.overlong_prompts!r}")
    samples = r.prompts_per_step * r.n_samples_per_prompt
    _need(samples % t.num_minibatches == 0,
          f"--train.num_minibatches {t.num_minibatches} must divide "
          f"prompts_per_step x n_samples_per_prompt = {samples}")
    per_minibatch = samples // t.num_minibatches
    rank_flags = (("--train.actor_num_ranks", t.actor_num_ranks), ("--train.critic_num_ranks", t.critic_num_ranks))
    for flag, ranks in rank_flags:
        _need(per_minibatch >= ranks,
              f"{flag} {ranks}: each optimizer step has {per_minibatch} samples (prompts_per_step x "
              f"n_samples_per_prompt / num_minibatches), fewer than the ranks that must each train on one")
    # scoring-only groups split the whole batch: every rank needs at least one sample of it
    for flag, ranks, used in (("--train.ref_num_ranks", t.ref_num_ranks, t.kl_coef > 0),
                              ("--reward.num_ranks", rw.num_ranks, rw.kind == "model")):
        _need(not used or samples >= ranks,
              f"{flag} {ranks}: a step has {samples} samples (prompts_per_step x n_samples_per_prompt), fewer than "
              "the ranks that must each score one; lower it or raise --rollout.prompts_per_step")
    _check_policy_loss(cfg)
    _check_decoupled_loss(cfg)
    _check_sequence_parallel(cfg)
    _need(t.tis_cap is None or t.tis_cap > 0, f"--train.tis_cap must be > 0 (got {t.tis_cap})")
    _need(r.weight_transport in ("collective", "tensor", "disk"),
          f"--rollout.weight_transport must be collective, tensor or disk, got {r.weight_transport!r}")
    _need(r.bucket_bytes >= 2**16, f"--rollout.bucket_bytes must be >= 65536, got {r.bucket_bytes}")
    from rlhf_sg.serve.router import ROUTING_POLICIES

    _need(r.routing in ROUTING_POLICIES,
          f"--rollout.routing must be one of {list(ROUTING_POLICIES)}, got {r.routing!r}")
    _need(t.placement_strategy in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"),
          "--train.placement_strategy must be PACK, SPREAD, STRICT_PACK or STRICT_SPREAD, "
          f"got {t.placement_strategy!r}")
    _need(t.device in ("cpu", "cuda"), f"--train.device must be cpu or cuda, got {t.device!r}")
    _need(r.engine_threads is None or r.engine_threads >= 1,
          f"--rollout.engine_threads must be >= 1, got {r.engine_threads}")
    _need(r.temperature >= 0, f"--rollout.temperature must be >= 0, got {r.temperature}")
    _need(d.max_prompt_len + r.max_new_tokens <= r.max_model_len,
          f"--data.max_prompt_len ({d.max_prompt_len}) + --rollout.max_new_tokens ({r.max_new_tokens}) exceeds "
          f"--rollout.max_model_len ({r.max_model_len}); raise max_model_len or shorten one of them")
    _check_microbatch_budget(cfg)
    _need(bool(d.prompt_data), "--data.prompt_data is required: a JSONL / Parquet file or a datasets directory")
    _need(os.path.exists(d.prompt_data), f"--data.prompt_data: {d.prompt_data!r} does not exist")
    _need(rw.kind in ("function", "model", "remote"),
          f"--reward.kind must be function, model or remote, got {rw.kind!r}")
    if rw.kind == "function" and not (distill_only(cfg) and rw.function is None) and cfg.agent.harness is None:
        from rlhf_sg.verifiable import BUILTIN_REWARDS, is_builtin_spec

        _need(bool(rw.function), "--reward.function is required with --reward.kind function (module:function)")
        _need(":" in rw.function or is_builtin_spec(rw.function),
              f"--reward.function must look like module:function, name a built-in reward "
              f"({', '.join(sorted(BUILTIN_REWARDS))}) or a weighted sum NAME=WEIGHT,..., got {rw.function!r}")
    if rw.kind == "model":
        _need(bool(m.reward_pretrain), "--model.reward_pretrain is required with --reward.kind model")
    _validate_eval(cfg)
    _validate_agent(cfg)
    _validate_routing_replay(cfg)
    for flag, peak in (("--perf.peak_tflops", cfg.perf.peak_tflops),
                       ("--perf.peak_bandwidth_gbs", cfg.perf.peak_bandwidth_gbs)):
        _need(peak is None or (math.isfinite(peak) and peak > 0),
              f"{flag} must be a positive number (one device's peak), got {peak}")
    if rw.kind == "remote":
        _need(bool(rw.url) and rw.url.startswith(("http://", "https://")),
              f"--reward.url must be an http(s) URL with --reward.kind remote, got {rw.url!r}")
        if rw.token_env is not None:
            _need(rw.token_env.isascii() and rw.token_env.isidentifier(),
                  "--reward.token_env takes the NAME of an environment variable that holds the token (letters, "
                  "digits, underscores), not the token itself")
            _need(bool(os.environ.get(rw.token_env, "").strip()),
                  f"--reward.token_env: environment variable {rw.token_env} is not set (or empty); "
                  f"export {rw.token_env}=<token> before starting the run")
        if rw.ca_file is not None:
            _need(rw.url.startswith("https://"), f"--reward.ca_file needs an https --reward.url, got {rw.url!r}")
            _need(os.path.isfile(rw.ca_file), f"--reward.ca_file: {rw.ca_file!r} is not a file (a PEM certificate)")
    else:
        _need(rw.token_env is None and rw.ca_file is None,
              "--reward.token_env / --reward.ca_file apply to --reward.kind remote only")
    _need(cfg.log.save_steps >= 0, f"--log.save_steps must be >= 0, got {cfg.log.save_steps}")
    if t.recompute_old_logp is False:
        _need(t.ppo_epochs == 1 and t.num_minibatches == 1 and not (t.kl_coef > 0 and t.kl_mode == "reward"),
              "--train.recompute_old_logp false: the old log-probs can come from the update's own forward only "
              "with one update per batch (--train.ppo_epochs 1, --train.num_minibatches 1) and no KL penalty in "
              "the rewards (--train.kl_mode loss or --train.kl_coef 0)")
        _need(cfg.distill.teacher is None,
              "--train.recompute_old_logp false: --distill.teacher's advantages need the old log-probs before the "
              "update (log pi_teacher - log pi_old); drop the flag")
    _validate_distill(cfg)
    _validate_colocation(cfg)
    _validate_rollout_mode(cfg)
    _validate_lora(cfg)
    _validate_gpu_path(cfg)
    return cfg


def lora_scaling(alpha: float, rank: int, rslora: bool) -> float:
    """The LoRA update's scale: ``alpha / rank``, or ``alpha / sqrt(rank)`` with rsLoRA."""
    return alpha / (math.sqrt(rank) if rslora else rank)


def lora_target_modules(lora: LoraConfig) -> str | list[str]:
    """--lora.target_modules as PEFT takes it: ``"all-linear"`` or a list of module names."""
    if lora.target_modules.strip() == "all-linear":
        return "all-linear"
    return [m.strip() for m in lora.target_modules.split(",") if m.strip()]


#: modules --lora.target_modules may not name: the output head and the embeddings (see _validate_lora)
_LORA_REFUSED_TARGETS = ("lm_head", "embed_tokens", "wte", "word_embeddings")


def _validate_lora(cfg: Config) -> None:
    lo = cfg.lora
    if lo.rank == 0:
        _need(lo.init_adapter is None, "--lora.init_adapter needs --lora.rank > 0 (the adapter's rank)")
        return
    _need(lo.rank > 0, f"--lora.rank must be >= 0 (0: off), got {lo.rank}")
    _need(lo.alpha > 0, f"--lora.alpha must be > 0, got {lo.alpha}")
    _need(0.0 <= lo.dropout < 1.0, f"--lora.dropout must be in [0, 1), got {lo.dropout}")
    _need(bool(lora_target_modules(lo)), "--lora.target_modules is empty: give all-linear or module names "
                                         "(q_proj,k_proj,v_proj,o_proj)")
    embeddings = sorted(set(lora_target_modules(lo)) & set(_LORA_REFUSED_TARGETS)) if lo.target_modules.strip() != \
        "all-linear" else []
    _need(not embeddings,
          f"--lora.target_modules names {embeddings}: the log-probs apply the lm_head once per call with the "
          "chunked log-softmax inside, and a LoRA-wrapped head calls its own submodules per chunk, which under "
          "ZeRO-3 gathers them as many times as a rank has chunks (ranks would wait on each other); adapt the "
          "attention and MLP projections (all-linear leaves the head out)")
    _need(lo.sync_mode in LORA_SYNC_MODES,
          f"--lora.sync_mode must be one of {LORA_SYNC_MODES}, got {lo.sync_mode!r}")
    if lo.sync_mode == "adapter":
        cls = _backend_class(cfg, "--lora.sync_mode adapter")
        _need(getattr(cls, "supports_lora_adapter", False),
              f"--lora.sync_mode adapter: backend {cfg.rollout.backend!r} does not declare it can load a LoRA "
              "adapter (supports_lora_adapter); use --lora.sync_mode merged (every backend)")
    if lo.init_adapter is not None:
        import json

        path = os.path.join(lo.init_adapter, "adapter_config.json")
        _need(os.path.isfile(path), f"--lora.init_adapter: {lo.init_adapter!r} has no adapter_config.json; give a "
                                    "directory written by PEFT's save_pretrained or by rlhf_sg's export")
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
        for key in LORA_REFUSED:
            if saved.get(key):
                raise _refused_lora_option(key, f"--lora.init_adapter {path}")
        _need(saved.get("r") == lo.rank and float(saved.get("lora_alpha", -1)) == lo.alpha
              and bool(saved.get("use_rslora", False)) == lo.rslora,
              f"--lora.init_adapter {path}: r={saved.get('r')}, lora_alpha={saved.get('lora_alpha')}, "
              f"use_rslora={saved.get('use_rslora', False)}; set --lora.rank, --lora.alpha and --lora.rslora to "
              "match")


def _validate_gpu_path(cfg: Config) -> None:
    """Combinations that cannot work on GPU, refused before anything starts."""
    m, r, t = cfg.model, cfg.rollout, cfg.train
    if m.attn_implementation == "flash_attention_2":
        _need(t.device == "cuda", "--model.attn_implementation flash_attention_2 runs on CUDA only: use sdpa with "
                                  "--train.device cpu")
        _need(m.dtype != "float32", "--model.attn_implementation flash_attention_2 has fp16/bf16 kernels only: set "
                                    "--model.dtype bfloat16, or use --model.attn_implementation sdpa")
    if t.device != "cuda":
        return
    if t.colocate_all:
        # trainer rank i and engine i would be two ranks of one NCCL group on one GPU: NCCL refuses that
        # ("Duplicate GPU detected", ncclInvalidUsage)
        _need(r.weight_transport != "collective",
              "--train.colocate_all on CUDA puts trainer rank i and engine i on one GPU, where NCCL cannot make "
              "them one group (the collective transport): set --rollout.weight_transport tensor")
    if r.backend == "sglang":
        _need(m.dtype != "float32",
              "--rollout.backend sglang on CUDA: its attention kernels are fp16/bf16; set --model.dtype bfloat16")


def _flash_attn_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None


def _fused_adam_prebuilt() -> bool:
    """Whether DeepSpeed was installed with FusedAdam compiled (DS_BUILD_FUSED_ADAM=1); read from its
    git_version_info_installed.py without importing deepspeed (which would pick an accelerator)."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        return False
    path = os.path.join(spec.submodule_search_locations[0], "git_version_info_installed.py")
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except OSError:
        return False
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(n, "id", None) == "installed_ops" for n in node.targets):
            return bool(ast.literal_eval(node.value).get("fused_adam", False))
    return False


def _validate_eval(cfg: Config) -> None:
    e = cfg.eval
    if e.prompt_data is None:
        return
    from rlhf_sg.verifiable import is_builtin_spec

    _need(os.path.exists(e.prompt_data), f"--eval.prompt_data: {e.prompt_data!r} does not exist")
    _need(e.interval >= 0, f"--eval.interval must be >= 0 (0: only before and after training), got {e.interval}")
    _need(e.n_samples >= 1, f"--eval.n_samples must be >= 1, got {e.n_samples}")
    _need(e.max_prompts is None or e.max_prompts >= 1, f"--eval.max_prompts must be >= 1, got {e.max_prompts}")
    _need(bool(e.k) and all(1 <= k <= e.n_samples for k in e.k),
          f"--eval.k: each k must be in 1..--eval.n_samples ({e.n_samples}), got {e.k}")
    _need(e.temperature is None or e.temperature >= 0, f"--eval.temperature must be >= 0, got {e.temperature}")
    max_new = e.max_new_tokens or cfg.rollout.max_new_tokens
    _need(cfg.data.max_prompt_len + max_new <= cfg.rollout.max_model_len,
          f"--data.max_prompt_len ({cfg.data.max_prompt_len}) + --eval.max_new_tokens ({max_new}) exceeds "
          f"--rollout.max_model_len ({cfg.rollout.max_model_len})")
    if e.reward_function is not None:
        _need(":" in e.reward_function or is_builtin_spec(e.reward_function),
              f"--eval.reward_function must look like module:function or name a built-in reward, got "
              f"{e.reward_function!r}")
    else:
        _need(cfg.reward.kind == "function", f"--eval.prompt_data: evaluation scores with a reward function; with "
                                             f"--reward.kind {cfg.reward.kind} set --eval.reward_function")
        _need(cfg.reward.function is not None, "--eval.prompt_data: evaluation scores with a reward function and "
                                               "this run has none (--distill.only); set --eval.reward_function")


def _validate_harness(cfg: Config) -> None:
    a = cfg.agent
    _need(a.env is None, f"--agent.harness and --agent.env are exclusive: a sample is either a harness run against "
                         f"the endpoint or an environment's trajectory; drop one (got env {a.env!r})")
    _need(a.harness_workers >= 1, f"--agent.harness_workers must be >= 1, got {a.harness_workers}")
    _need(a.harness_timeout_s > 0, f"--agent.harness_timeout_s must be > 0, got {a.harness_timeout_s}")
    _need(not rollout_is_async(cfg), "--agent.harness runs with --rollout.mode sync only: the async producer does "
                                     "not drive the endpoint yet")
    _need(cfg.eval.prompt_data is None, "--agent.harness: evaluation (--eval.prompt_data) does not run harnesses "
                                        "yet; drop --eval.prompt_data")
    try:
        from rlhf_sg.serve.harness import load_harness
    except ImportError as e:
        raise ConfigError(f"--agent.harness needs the agents extra (fastapi, uvicorn): pip install -e "
                          f"\".[agents]\" ({e})") from None
    try:
        load_harness(a.harness)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _validate_agent(cfg: Config) -> None:
    a = cfg.agent
    if a.harness is not None:
        _validate_harness(cfg)
    if a.env is None:
        return
    from rlhf_sg.agent import load_env_factory

    try:
        load_env_factory(a.env)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _need(a.max_turns >= 1, f"--agent.max_turns must be >= 1, got {a.max_turns}")
    _need(a.max_turn_tokens is None or a.max_turn_tokens >= 1,
          f"--agent.max_turn_tokens must be >= 1 (or unset: --rollout.max_new_tokens), got {a.max_turn_tokens}")
    _need(a.overflow in ("rollback", "truncate"), f"--agent.overflow must be rollback or truncate, got {a.overflow!r}")
    _need(a.tool_timeout_s > 0, f"--agent.tool_timeout_s must be > 0, got {a.tool_timeout_s}")
    _need(a.env_workers >= 1, f"--agent.env_workers must be >= 1, got {a.env_workers}")
    _need(a.max_hung_steps >= 0, f"--agent.max_hung_steps must be >= 0, got {a.max_hung_steps}")
    _need(a.max_observation_tokens >= 1, f"--agent.max_observation_tokens must be >= 1, got {a.max_observation_tokens}")
    _need(a.max_error_chars >= 1, f"--agent.max_error_chars must be >= 1, got {a.max_error_chars}")
    _need(a.reward_text in ("model", "all"), f"--agent.reward_text must be model or all, got {a.reward_text!r}")
    _need(a.template_check in ("off", "warn", "strict"),
          f"--agent.template_check must be off, warn or strict, got {a.template_check!r}")
    _need(a.env_reward in ("ignore", "add", "replace"),
          f"--agent.env_reward must be ignore, add or replace, got {a.env_reward!r}")


def _jit_toolchain_missing() -> list[str]:
    """What DeepSpeed's JIT build of an op needs and this machine lacks: nvcc (under torch's CUDA_HOME) and ninja."""
    import shutil

    from torch.utils.cpp_extension import CUDA_HOME

    missing = []
    if CUDA_HOME is None or not os.path.isfile(os.path.join(CUDA_HOME, "bin", "nvcc")):
        missing.append("nvcc (a CUDA toolkit; set CUDA_HOME to it)")
    if shutil.which("ninja") is None:
        missing.append("ninja (pip install ninja)")
    return missing


#: DeepSpeed's op builder (``ops/op_builder/builder.py``, ``cuda_minor_mismatch_ok``): within each of these CUDA
#: major versions an nvcc and a torch of two listed minor versions still build ops together; any other difference
#: of major.minor raises ``CUDAMismatchException`` (unless DS_SKIP_CUDA_CHECK=1), so a CUDA 13 torch needs nvcc 13.x
#: of exactly its minor version
_DEEPSPEED_MIXABLE_CUDA = {
    10: ("10.0", "10.1", "10.2"),
    11: ("11.0", "11.1", "11.2", "11.3", "11.4", "11.5", "11.6", "11.7", "11.8"),
    12: ("12.0", "12.1", "12.2", "12.3", "12.4", "12.5", "12.6", "12.8", "12.9"),
}


def cuda_toolkit_clash(nvcc_version: str, torch_cuda: str) -> str | None:
    """Why DeepSpeed's JIT build of an op would refuse this nvcc for this torch, naming the toolkit to install;
    None when it builds (or when ``nvcc_version`` names no release). ``nvcc_version``: what ``nvcc -V`` prints
    ("... Cuda compilation tools, release 13.0, V13.0.88 ..."); ``torch_cuda``: ``torch.version.cuda`` ("13.0").
    Compared as DeepSpeed compares them: major.minor, patch versions ignored."""
    import re

    found = re.search(r"\brelease (\d+)\.(\d+)", nvcc_version)
    if found is None:
        return None
    nvcc = f"{found[1]}.{found[2]}"
    torch_version = ".".join(torch_cuda.split(".")[:2])
    mixable = _DEEPSPEED_MIXABLE_CUDA.get(int(found[1]), ())
    if nvcc == torch_version or (nvcc in mixable and torch_version in mixable):
        return None
    return (f"nvcc is CUDA {nvcc} and torch was built with CUDA {torch_version}, which DeepSpeed refuses to build "
            f"with (it lets minor versions differ only within CUDA 10, 11 and 12): install the CUDA "
            f"{torch_version} toolkit and point CUDA_HOME at it")


def _jit_cuda_versions() -> tuple[str, str | None]:
    """What ``nvcc -V`` under torch's CUDA_HOME prints ("" when it cannot run) and ``torch.version.cuda``."""
    import subprocess

    import torch
    from torch.utils.cpp_extension import CUDA_HOME

    try:
        nvcc = subprocess.run([os.path.join(CUDA_HOME or "", "bin", "nvcc"), "-V"], capture_output=True, text=True,
                              timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        nvcc = ""
    return nvcc, torch.version.cuda


def check_gpu_install(cfg: Config) -> None:
    """With ``--train.device cuda``, that what the run will load on GPU is installed on this machine:
    flash-attn when asked for, and DeepSpeed's FusedAdam (prebuilt, or the toolchain its JIT build needs, with
    an nvcc of the CUDA version torch was built with)."""
    if cfg.train.device != "cuda":
        return
    if cfg.model.attn_implementation == "flash_attention_2":
        _need(_flash_attn_importable(),
              "--model.attn_implementation flash_attention_2: the flash_attn package is not installed; install it "
              "(FLASH_ATTN=1 bash recipes/install/gpu.sh <engine>) or use --model.attn_implementation sdpa")
    if not _fused_adam_prebuilt():
        missing = _jit_toolchain_missing()
        _need(not missing,
              f"--train.device cuda trains with DeepSpeed's FusedAdam, which is not prebuilt here and whose JIT "
              f"build needs {' and '.join(missing)}; install them, or reinstall DeepSpeed with "
              "DS_BUILD_FUSED_ADAM=1 (recipes/install/gpu.sh does)")
        nvcc, torch_cuda = _jit_cuda_versions()
        if torch_cuda and os.environ.get("DS_SKIP_CUDA_CHECK", "0") != "1":
            clash = cuda_toolkit_clash(nvcc, torch_cuda)
            _need(clash is None, f"--train.device cuda trains with DeepSpeed's FusedAdam, which is not prebuilt "
                                 f"here and whose JIT build would fail: {clash}")


def _backend_class(cfg: Config, flag: str) -> type:
    """The class of ``--rollout.backend``, for a flag that needs one of its capabilities; a ConfigError naming
    ``flag`` when it cannot be looked up (an engine not installed here: the run could not start it anyway)."""
    from backends.registry import get_backend_class

    try:
        return get_backend_class(cfg.rollout.backend)
    except Exception as e:
        raise ConfigError(f"{flag}: cannot look up --rollout.backend {cfg.rollout.backend!r} ({e})") from e


def _routing_replay_refusal(path: str) -> str | None:
    """Why routing replay cannot serve the model at ``path`` (its routers, on a model built on the meta device from
    its config: no weights read), or None."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlhf_sg.moe import replay_refusal

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    return replay_refusal(model)


def _validate_routing_replay(cfg: Config) -> None:
    if not cfg.train.routing_replay:
        return
    m = cfg.model
    if m.pretrain and os.path.isfile(os.path.join(m.pretrain, "config.json")):
        _need(_has_experts(m.pretrain),
              f"--train.routing_replay: {m.pretrain!r} is not a mixture-of-experts model (its config.json has none of "
              f"{list(_EXPERT_KEYS)}): there are no routes to replay; drop the flag")
        refusal = _routing_replay_refusal(m.pretrain)
        _need(refusal is None, f"--train.routing_replay: {m.pretrain!r}: {refusal}; train without replay")
    cls = _backend_class(cfg, "--train.routing_replay")
    _need(getattr(cls, "supports_routed_experts", False),
          f"--train.routing_replay: backend {cfg.rollout.backend!r} does not return the experts it routed each token "
          "to (supports_routed_experts); use --rollout.backend hf, or train without replay")
    _need(not (getattr(cls, "name", "") == "sglang" and cfg.train.device != "cuda"),
          "--train.routing_replay with --rollout.backend sglang: SGLang captures routed experts on CUDA only (its "
          "capture pins host memory through CUDA); on CPU use --rollout.backend hf")
    _need(cfg.agent.env is None,
          "--train.routing_replay with --agent.env: the routes of a multi-turn trajectory's earlier turns are not "
          "carried through its observations yet; train the agent without replay")
    _need(cfg.agent.harness is None, "--train.routing_replay with --agent.harness: the endpoint does not record "
                                     "routed experts; train the harness without replay")
    _need(not (rollout_is_async(cfg) and cfg.rollout.partial_rollout),
          "--train.routing_replay with --rollout.mode async and --rollout.partial_rollout: a completion continued "
          "after a weight sync is not yet given the routes of both its parts; set --rollout.partial_rollout false")


def _validate_rollout_mode(cfg: Config) -> None:
    r = cfg.rollout
    _need(r.mode in ROLLOUT_MODES, f"--rollout.mode must be one of {list(ROLLOUT_MODES)}, got {r.mode!r}")
    _need(r.max_staleness >= 1, f"--rollout.max_staleness must be >= 1 (weight versions a batch may lag the "
                                f"trainer), got {r.max_staleness}; for on-policy training use --rollout.mode sync")
    if r.mode == "async" and not cfg.train.colocate_all:
        _need(r.sleep_engines_while_training is not True,
              "--rollout.mode async generates while the trainer trains: the engines cannot sleep then; drop "
              "--rollout.sleep_engines_while_training or use --rollout.mode sync")
        _need(not cfg.train.offload_states_while_generating,
              "--rollout.mode async trains while the engines generate: the training states cannot leave the "
              "device then; drop --train.offload_states_while_generating or use --rollout.mode sync")


#: --rollout.mode values
ROLLOUT_MODES = ("sync", "async")


def rollout_is_async(cfg: Config) -> bool:
    """Whether generation overlaps training: ``--rollout.mode async`` on separate placement (colocated engines
    and trainer share the devices, so such a run stays sync; the trainer says so at start)."""
    return cfg.rollout.mode == "async" and not cfg.train.colocate_all


#: the truncated-importance-sampling cap of an async run that sets none
ASYNC_TIS_CAP = 2.0


def shares_prompts(cfg: Config) -> bool:
    """Whether the trainer's forwards share prompts (``--train.share_prompts``): only with an attention that
    takes the tree mask (``sdpa``, ``eager``); flash-attn varlen kernels cannot keep sibling responses apart."""
    # routing replay: the engine routed each sample's prompt on its own, so each sample computes it
    return (cfg.train.share_prompts and cfg.model.attn_implementation in ("sdpa", "eager")
            and not cfg.train.routing_replay)


#: what a ratio level that a policy loss refuses would be instead
_RATIO_LEVEL_HINTS = {
    ("ppo", "sequence"): "PPO's clip on the sequence ratio is GSPO: set --train.policy_loss gspo (its clip range, "
                         "3e-4 / 4e-4, fits a sequence ratio; PPO's 0.2 would almost never bind)",
    ("gspo", "token"): "GSPO's clip on each token's ratio is PPO's: set --train.policy_loss ppo",
    ("gmpo", "token"): "GMPO's ratio is a geometric mean over each sequence by definition: leave --train.ratio_level "
                       "unset",
}
#: the estimators that give every token its own advantage (whitened over the batch's tokens)
_TOKEN_ADVANTAGES = ("gae", "reinforce", "reinforce_baseline")


def _check_policy_loss(cfg: Config) -> None:
    """The policy loss's rules: its ratio level, its clip range (each loss reads the bounds its own way) and the
    options only one loss has."""
    t = cfg.train
    _need(t.policy_loss in POLICY_LOSSES,
          f"--train.policy_loss must be one of {list(POLICY_LOSSES)}, got {t.policy_loss!r}")
    _need(t.ratio_level is None or t.ratio_level in RATIO_LEVELS,
          f"--train.ratio_level must be one of {list(RATIO_LEVELS)} (or none: the loss's own), got {t.ratio_level!r}")
    level = ratio_level(cfg)
    _need(level in LOSS_RATIO_LEVELS[t.policy_loss],
          f"--train.ratio_level {level} with --train.policy_loss {t.policy_loss}: "
          f"{_RATIO_LEVEL_HINTS.get((t.policy_loss, level))}")
    low, high = clip_range(cfg)
    if t.policy_loss == "sapo":
        _need(low is None and high is None,
              f"--train.clip_low / --train.clip_high ({low}, {high}): --train.policy_loss sapo has no clip (its soft "
              "gate's temperatures are --train.sapo_tau_pos and --train.sapo_tau_neg); unset them")
    elif t.policy_loss == "cispo":
        _need(0 <= low <= 1 and high >= 0,
              f"--train.clip_low must be in [0, 1] (1: no lower bound, cispo's own) and --train.clip_high >= 0 with "
              f"--train.policy_loss cispo (got {low}, {high})")
    elif t.policy_loss == "gmpo":
        _need(low >= 0 and high >= 0,
              f"--train.clip_low and --train.clip_high bound the log-ratio with --train.policy_loss gmpo (its own "
              f"0.4: ratios in (e^-0.4, e^0.4)); both must be >= 0 (got {low}, {high})")
    else:
        _need(0 <= low < 1 and high >= 0,
              f"--train.clip_low must be in [0, 1) and --train.clip_high >= 0 (got {low}, {high})")
    _need(t.dual_clip is None or t.dual_clip > 1, f"--train.dual_clip must be > 1 (got {t.dual_clip})")
    _need(t.dual_clip is None or t.policy_loss == "ppo",
          f"--train.dual_clip caps PPO's token loss where the advantage is negative: it needs --train.policy_loss ppo "
          f"(got {t.policy_loss}); unset it")
    _need(t.policy_loss != "gmpo" or t.advantage_estimator not in _TOKEN_ADVANTAGES,
          f"--train.policy_loss gmpo weighs each sequence by one advantage, but --train.advantage_estimator "
          f"{t.advantage_estimator} gives every token its own; use a group estimator (grpo, dr_grpo or rloo)")


def _check_decoupled_loss(cfg: Config) -> None:
    """The decoupled loss needs PPO's token clip, the engine's log-probs of the policy that sampled (no top-p / top-k
    truncation: the engines record log-probs before it), and no TIS weight on top of its own."""
    t, r = cfg.train, cfg.rollout
    _need(t.decoupled_weight_cap is None or t.decoupled_loss,
          "--train.decoupled_weight_cap caps the weight of --train.decoupled_loss; set that too, or unset the cap")
    if not t.decoupled_loss:
        return
    _need(t.policy_loss == "ppo",
          f"--train.decoupled_loss is PPO's clipped loss decoupled (AReaL); --train.policy_loss {t.policy_loss} has "
          f"no decoupled form here; use --train.policy_loss ppo, or drop --train.decoupled_loss")
    _need(t.tis_cap is None,
          f"--train.decoupled_loss weighs every token by pi_prox / pi_behav itself; --train.tis_cap {t.tis_cap} would "
          f"weigh it twice; unset --train.tis_cap (cap the weight with --train.decoupled_weight_cap)")
    _need(t.decoupled_weight_cap is None or t.decoupled_weight_cap > 0,
          f"--train.decoupled_weight_cap must be > 0 (or unset: no cap), got {t.decoupled_weight_cap}")
    _need(r.top_p == 1.0 and r.top_k == -1,
          f"--train.decoupled_loss needs the engines' log-probs of the behaviour policy, but with --rollout.top_p "
          f"{r.top_p} / --rollout.top_k {r.top_k} the engines sample from a truncated distribution and record the "
          f"log-probs before the truncation; set --rollout.top_p 1 --rollout.top_k -1, or drop --train.decoupled_loss")


def ratio_level(cfg: Config) -> str:
    """The ratio level in force: ``--train.ratio_level``, or the policy loss's own (sequence for gspo and gmpo)."""
    return cfg.train.ratio_level or LOSS_RATIO_LEVELS[cfg.train.policy_loss][0]


def clip_range(cfg: Config) -> tuple[float | None, float | None]:
    """(clip_low, clip_high) in force: ``--train.clip_low`` / ``--train.clip_high``, each else the policy loss's own
    (:data:`rlhf_sg.algorithms.LOSS_CLIP_DEFAULTS`; sapo has none: (None, None))."""
    low, high = LOSS_CLIP_DEFAULTS.get(cfg.train.policy_loss, (None, None))
    t = cfg.train
    return (low if t.clip_low is None else t.clip_low), (high if t.clip_high is None else t.clip_high)


def loss_aggregation(cfg: Config) -> str:
    """The loss aggregation in force: ``--train.loss_aggregation``, or the policy loss's own: seq_mean for the
    sequence losses (gspo, gmpo: the papers' mean over sequences), token_mean for the others."""
    if cfg.train.loss_aggregation is not None:
        return cfg.train.loss_aggregation
    return "seq_mean" if cfg.train.policy_loss in ("gspo", "gmpo") else "token_mean"


def kl_estimator(cfg: Config) -> str:
    """The KL estimator in force: ``--train.kl_estimator``, or k1 in the rewards (an unbiased value, as
    OpenRLHF and verl use there) and k3 in the loss (verl's default ``low_var_kl``: >= 0, with a gradient)."""
    if cfg.train.kl_estimator is not None:
        return cfg.train.kl_estimator
    return "k3" if cfg.train.kl_mode == "loss" else "k1"


def tis_cap(cfg: Config) -> float | None:
    """The TIS cap in force: ``--train.tis_cap``, or :data:`ASYNC_TIS_CAP` in an async run that sets none (and no
    ``--train.decoupled_loss``, whose own weight corrects for the engines' weights)."""
    if cfg.train.tis_cap is None and rollout_is_async(cfg) and not cfg.train.decoupled_loss:
        return ASYNC_TIS_CAP
    return cfg.train.tis_cap


def _validate_distill(cfg: Config) -> None:
    """On-policy distillation's rules; the teacher's tokenizer is compared with the policy's last (it loads both)."""
    d, t = cfg.distill, cfg.train
    if d.teacher is None:
        _need(not d.only, "--distill.only: there is no teacher to distill from; set --distill.teacher or drop the "
                          "flag")
        return
    _need(d.num_ranks >= 1, f"--distill.num_ranks must be >= 1, got {d.num_ranks}")
    samples = cfg.rollout.prompts_per_step * cfg.rollout.n_samples_per_prompt
    _need(samples >= d.num_ranks,
          f"--distill.num_ranks {d.num_ranks}: a step has {samples} samples (prompts_per_step x n_samples_per_prompt), "
          "fewer than the ranks that must each score one; lower it or raise --rollout.prompts_per_step")
    _need(math.isfinite(d.coef) and d.coef > 0,
          f"--distill.coef must be > 0 (the weight of the teacher's term in the advantages), got {d.coef}")
    _need(t.policy_loss != "gmpo",
          "--train.policy_loss gmpo weighs each sequence by one advantage, but --distill.teacher gives every token its "
          "own (log pi_teacher - log pi_old); use another policy loss (ppo, gspo, cispo, sapo)")
    if d.only:
        _need(not t.dynamic_filtering,
              "--train.dynamic_filtering drops groups by their scores, which --distill.only does not train on; drop "
              "one of the flags")
    from rlhf_sg.distill import check_teacher

    check_teacher(cfg.model.pretrain, d.teacher)


def _validate_colocation(cfg: Config) -> None:
    r, t, rw = cfg.rollout, cfg.train, cfg.reward
    uses_critic, uses_ref, uses_rm = uses_critic_model(cfg), t.kl_coef > 0, rw.kind == "model"
    uses_teacher = cfg.distill.teacher is not None
    if t.colocate_actor_ref:
        _need(uses_ref, "--train.colocate_actor_ref: there is no reference model to colocate (--train.kl_coef is 0)")
        _need(not ref_in_actor(cfg), "--train.colocate_actor_ref: there is no reference group to colocate: the LoRA "
                                     "actor computes the reference itself, its adapter disabled; drop the flag")
        _need(t.ref_num_ranks == t.actor_num_ranks,
              f"--train.colocate_actor_ref puts reference rank i on actor rank i's device: set --train.ref_num_ranks "
              f"to --train.actor_num_ranks ({t.actor_num_ranks}), got {t.ref_num_ranks}")
        _need(not uses_teacher or cfg.distill.num_ranks == t.actor_num_ranks,
              f"--train.colocate_actor_ref puts teacher rank i beside actor rank i, as the reference: set "
              f"--distill.num_ranks to --train.actor_num_ranks ({t.actor_num_ranks}), got {cfg.distill.num_ranks}")
    uses_ref = uses_ref and not ref_in_actor(cfg)
    if t.colocate_critic_reward:
        _need(uses_critic and uses_rm,
              "--train.colocate_critic_reward needs both a critic (an estimator such as gae) and a reward "
              f"model (--reward.kind model); got {t.advantage_estimator!r} and {rw.kind!r}")
        _need(rw.num_ranks == t.critic_num_ranks,
              f"--train.colocate_critic_reward puts reward rank i on critic rank i's device: set --reward.num_ranks "
              f"to --train.critic_num_ranks ({t.critic_num_ranks}), got {rw.num_ranks}")
    if t.colocate_all:
        n = t.actor_num_ranks
        for flag, ranks, used in (("--train.critic_num_ranks", t.critic_num_ranks, uses_critic),
                                  ("--train.ref_num_ranks", t.ref_num_ranks, uses_ref),
                                  ("--distill.num_ranks", cfg.distill.num_ranks, uses_teacher),
                                  ("--reward.num_ranks", rw.num_ranks, uses_rm),
                                  ("--rollout.num_engines", r.num_engines, True)):
            if used:
                _need(ranks == n, f"--train.colocate_all puts rank i of every group and engine i on device i: set "
                                  f"{flag} to --train.actor_num_ranks ({n}), got {ranks}")
        _need(r.tensor_parallel_size == 1,
              "--train.colocate_all places one engine per device: --rollout.tensor_parallel_size must be 1, got "
              f"{r.tensor_parallel_size} (for tensor-parallel engines use separate devices, no colocate_all)")
    if t.offload_states_while_generating and not t.colocate_all:
        _need(r.sleep_engines_while_training is not False,
              "--train.offload_states_while_generating frees the device for engines that share it; it makes no "
              "sense with --rollout.sleep_engines_while_training false and no colocate_all")


def engines_on_servers(cfg: Config) -> bool:
    """Whether the engines drive inference servers that run elsewhere (``--rollout.engine_kwargs`` with
    ``server_urls``): an engine actor then only talks HTTP and holds no device of this cluster."""
    return bool(cfg.rollout.engine_kwargs.get("server_urls"))


def devices_needed(cfg: Config) -> tuple[int, str]:
    """Devices the run's groups take, and how they add up: one per model rank, tensor_parallel_size per engine;
    a colocated set shares as many as its largest group has ranks (rank i of each on device i); engines that
    drive servers elsewhere (:func:`engines_on_servers`) none."""
    r, t = cfg.rollout, cfg.train
    sizes = {"actor": t.actor_num_ranks}
    if not engines_on_servers(cfg):
        sizes["engines"] = r.num_engines
    if uses_critic_model(cfg):
        sizes["critic"] = t.critic_num_ranks
    if t.kl_coef > 0 and not ref_in_actor(cfg):
        sizes["ref"] = t.ref_num_ranks
    if cfg.distill.teacher is not None:
        sizes["teacher"] = cfg.distill.num_ranks
    if cfg.reward.kind == "model":
        sizes["reward"] = cfg.reward.num_ranks
    if t.colocate_all:
        shared = [list(sizes)]
    else:
        shared = [s for s, on in ((["actor", "ref", "teacher"], t.colocate_actor_ref),
                                  (["critic", "reward"], t.colocate_critic_reward)) if on]
        shared = [[g for g in s if g in sizes] for s in shared]
    total, parts = 0, []
    for names in shared:
        n = max(sizes[g] for g in names)
        total += n
        parts.append(f"{n} shared by {'+'.join(names)}")
    for g, n in sizes.items():
        if any(g in s for s in shared):
            continue
        if g == "engines":
            total += n * r.tensor_parallel_size
            parts.append(f"{n} engines x tensor_parallel_size {r.tensor_parallel_size}")
        else:
            total += n
            parts.append(f"{n} {g}")
    return total, ", ".join(parts)


def _visible_gpus() -> int | None:
    """GPUs the run's Ray will have, where that is known before it starts: the cluster's if Ray already runs in
    this process; this machine's (torch.cuda.device_count(), after CUDA_VISIBLE_DEVICES) if the run will start
    its own local Ray; None (unknown) if it will join a cluster at RAY_ADDRESS."""
    import sys

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return int(ray.cluster_resources().get("GPU", 0))
    if (os.environ.get("RAY_ADDRESS") or "local") != "local":
        return None
    import torch

    return torch.cuda.device_count()


def check_devices(cfg: Config, visible: int | None = None) -> None:
    """With ``--train.device cuda``, that the GPUs the layout needs exist, before anything starts. ``visible``:
    the GPUs available (default: :func:`_visible_gpus`). A run that joins a Ray cluster (RAY_ADDRESS set) is
    not checked: the other nodes' GPUs are unknown until it connects, so a multi-node run is never refused
    here (if the cluster is too small, placement stops after --train.timeout_s). Not part of :func:`validate`,
    which checks the config alone, wherever it is read."""
    if cfg.train.device != "cuda":
        return
    if visible is None:
        visible = _visible_gpus()
        if visible is None:
            return
    _need(visible >= 1, "--train.device cuda: no CUDA device is visible (check CUDA_VISIBLE_DEVICES and the "
                        "driver), or run on CPU with --train.device cpu")
    tp = 0 if engines_on_servers(cfg) else cfg.rollout.tensor_parallel_size
    _need(tp <= visible, f"--rollout.tensor_parallel_size {tp} is larger than the {visible} GPUs visible: an "
                         f"engine spreads over tensor_parallel_size devices; set it to {visible} or less")
    need, parts = devices_needed(cfg)
    _need(need <= visible,
          f"the layout needs {need} GPUs ({parts}) but {visible} are visible; lower --train.*_num_ranks / "
          "--rollout.num_engines / --rollout.tensor_parallel_size, or share devices (--train.colocate_all, "
          "--train.colocate_actor_ref, --train.colocate_critic_reward), or join a larger Ray cluster (RAY_ADDRESS)")


def ref_in_actor(cfg: Config) -> bool:
    """Whether the reference log-probs come from the LoRA actor with its adapter disabled (no reference group):
    a fresh adapter (B = 0) starts as the base, so the base is the reference. From --lora.init_adapter, the
    reference is that adapter, frozen, in a reference group of its own."""
    return cfg.train.kl_coef > 0 and cfg.lora.rank > 0 and cfg.lora.init_adapter is None


def uses_critic_model(cfg: Config) -> bool:
    """Whether the run trains a critic: its advantage estimator reads values (``gae``) and runs (not with
    ``--distill.only``, whose advantages are the teacher's term alone)."""
    return advantage_estimator(cfg.train.advantage_estimator).needs_critic and not distill_only(cfg)


def distill_only(cfg: Config) -> bool:
    """Whether the advantages are on-policy distillation's alone (``--distill.only`` with a teacher): the advantage
    estimator is not run and the reward is logged, not trained on."""
    return cfg.distill.teacher is not None and cfg.distill.only


def sleep_engines(cfg: Config) -> bool:
    """Whether engines release their memory while the trainer trains (the setting, or colocate_all)."""
    s = cfg.rollout.sleep_engines_while_training
    return cfg.train.colocate_all if s is None else s


def offload_states(cfg: Config) -> bool:
    """Whether training states leave the device while the engines generate (the setting, or colocate_all)."""
    s = cfg.train.offload_states_while_generating
    return cfg.train.colocate_all if s is None else s


def optimizer_steps(cfg: Config, role: str) -> int:
    """Optimizer steps ``role`` ("actor" or "critic") takes over the whole run, what its LR schedule spans:
    ppo_epochs x num_minibatches per training step; the actor sits out the critic's warmup steps."""
    t = cfg.train
    steps = t.max_steps
    if role == "actor" and uses_critic_model(cfg):
        steps = max(0, steps - t.critic_warmup_steps)
    return steps * t.ppo_epochs * t.num_minibatches


def lr_warmup_steps(cfg: Config, role: str) -> int:
    """Warmup optimizer steps of ``role``: ``lr_warmup_ratio`` of :func:`optimizer_steps`, rounded."""
    return round(cfg.train.lr_warmup_ratio * optimizer_steps(cfg, role))
