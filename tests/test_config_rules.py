"""Every validation rule of the run config, each with an input that breaks it alone and the exact message
(the flag, the value and what to do), and the input at each boundary that passes; and how flag and YAML
values are read (``_coerce``, ``apply_overrides``, ``load_yaml``)."""

import re

import pytest

from rlhf_sg.config import (
    Config,
    ConfigError,
    _coerce,
    apply_overrides,
    kl_estimator,
    load_yaml,
    optimizer_steps,
    validate,
)
from rlhf_sg.tiny import save_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(str(tmp_path_factory.mktemp("m")))


@pytest.fixture(scope="module")
def base(model_dir, tmp_path_factory):
    """A valid config (the defaults plus a model, a prompt file and a reward function) and the empty directory."""
    prompts = tmp_path_factory.mktemp("data") / "p.jsonl"
    prompts.write_text('{"prompt": "1+1="}\n')
    empty = str(tmp_path_factory.mktemp("not_a_model"))

    def make(overrides: dict) -> Config:
        cfg = Config()
        cfg.model.pretrain, cfg.data.prompt_data, cfg.reward.function = model_dir, str(prompts), "m:f"
        for dotted, value in overrides.items():
            section, _, key = dotted.partition(".")
            value = ({"MODEL": model_dir, "EMPTY": empty, "__PROMPTS__": str(prompts)}.get(value, value)
                     if isinstance(value, str) else value)
            setattr(getattr(cfg, section), key, value)
        return cfg

    make.empty = empty
    return make


RULES = [
    ({'model.pretrain': ''},
     '--model.pretrain is required: a local Hugging Face model directory'),
    ({'model.critic_pretrain': 'EMPTY'},
     "--model.critic_pretrain: <EMPTY> is not a model directory (no config.json there); save the model "
     "with save_pretrained or point at its directory"),
    ({'model.reward_pretrain': 'EMPTY'},
     "--model.reward_pretrain: <EMPTY> is not a model directory (no config.json there); save the model "
     "with save_pretrained or point at its directory"),
    ({'model.dtype': 'float16'},
     "--model.dtype must be float32 or bfloat16, got 'float16'"),
    ({'model.attn_implementation': 'flash'},
     "--model.attn_implementation must be sdpa, eager or flash_attention_2, got 'flash'"),
    ({'train.advantage_estimator': 'ppo2'},
     "--train.advantage_estimator 'ppo2' unknown; choose one of ['gae', 'reinforce', 'grpo', 'dr_grpo', "
     "'rloo', 'reinforce_baseline'] (or register your own with "
     "rlhf_sg.advantages.register_advantage_estimator)"),
    ({'train.advantage_estimator': 'grpo', 'rollout.n_samples_per_prompt': 1},
     '--train.advantage_estimator grpo compares samples of the same prompt: set '
     '--rollout.n_samples_per_prompt >= 2 (got 1)'),
    ({'train.dynamic_filtering': True, 'rollout.n_samples_per_prompt': 1},
     '--train.dynamic_filtering drops groups of samples of one prompt whose scores are all equal; with '
     '--rollout.n_samples_per_prompt 1 every group is one sample and would be dropped: set '
     '--rollout.n_samples_per_prompt >= 2 or turn --train.dynamic_filtering off'),
    ({'train.dynamic_filtering_max_draws': 0},
     '--train.dynamic_filtering_max_draws must be >= 1, got 0'),
    ({'train.score_clip': 0},
     '--train.score_clip must be > 0 (got 0)'),
    ({'train.lr_scheduler': 'step'},
     "--train.lr_scheduler must be one of ['constant', 'linear', 'cosine'], got 'step'"),
    ({'train.lr_warmup_ratio': 1.0},
     '--train.lr_warmup_ratio must be in [0, 1), got 1.0'),
    ({'train.lr_warmup_ratio': -0.1},
     '--train.lr_warmup_ratio must be in [0, 1), got -0.1'),
    ({'rollout.memory_fraction': 0},
     '--rollout.memory_fraction must be in (0, 1] (a share of each engine device), got 0'),
    ({'rollout.memory_fraction': 1.5},
     '--rollout.memory_fraction must be in (0, 1] (a share of each engine device), got 1.5'),
    ({'train.kl_estimator': 'k9'},
     "--train.kl_estimator must be one of ['k1', 'k2', 'k3'], got 'k9'"),
    ({'train.kl_mode': 'both'},
     "--train.kl_mode must be 'reward' or 'loss', got 'both'"),
    ({'train.kl_mode': 'loss', 'train.kl_estimator': 'k1'},
     "--train.kl_mode loss with --train.kl_estimator k1: k1's gradient is grad log pi, whose expectation "
     "under the policy is 0, so the KL term would not pull the policy toward the reference; use "
     "--train.kl_estimator k3 (the loss default) or k2, or add --train.kl_straight_through"),
    ({'train.kl_straight_through': True},
     "--train.kl_straight_through shapes the gradient of the KL term of the loss: it needs "
     "--train.kl_mode loss (in the rewards the KL has no gradient)"),
    ({'train.kl_coef': -0.1},
     '--train.kl_coef must be >= 0, got -0.1'),
    ({'train.loss_aggregation': 'sum'},
     "--train.loss_aggregation must be one of ['token_mean', 'seq_mean', 'seq_mean_token_sum', "
     "'seq_mean_token_sum_norm'], got 'sum'"),
    ({'train.advantage_norm': 'std'},
     "--train.advantage_norm must be one of ['whiten', 'center', 'none'], got 'std'"),
    ({'train.tis_mode': 'clip'},
     "--train.tis_mode must be one of ['truncate', 'mask'], got 'clip'"),
    ({'train.tis_low': 0.5},
     "--train.tis_low 0.5: a lower bound of the TIS weight needs a cap in force (--train.tis_cap, or async "
     "rollout's 2.0) above it, and must be >= 0; the cap is None"),
    ({'train.tis_low': 2.0, 'train.tis_cap': 2.0},
     "--train.tis_low 2.0: a lower bound of the TIS weight needs a cap in force (--train.tis_cap, or async "
     "rollout's 2.0) above it, and must be >= 0; the cap is 2.0"),
    ({'train.dynamic_filtering': True, 'rollout.n_samples_per_prompt': 2, 'train.dynamic_filtering_range': [1.0, 0.0]},
     "--train.dynamic_filtering_range takes two scores lo,hi with lo < hi (a group is kept when its mean score is "
     "strictly inside), got [1.0, 0.0]"),
    ({'train.dynamic_filtering_range': [0.0, 1.0]},
     "--train.dynamic_filtering_range needs --train.dynamic_filtering"),
    ({'reward.overlong_buffer_len': 0},
     "--reward.overlong_buffer_len must be in (0, --rollout.max_new_tokens = 64], got 0"),
    ({'reward.overlong_penalty_factor': -1.0},
     "--reward.overlong_penalty_factor must be >= 0, got -1.0"),
    ({'data.overlong_prompts': 'cut'},
     "--data.overlong_prompts must be one of ['error', 'drop', 'truncate'], got 'cut'"),
    ({'train.num_minibatches': 5},
     '--train.num_minibatches 5 must divide prompts_per_step x n_samples_per_prompt = 32'),
    ({'rollout.prompts_per_step': 1, 'rollout.n_samples_per_prompt': 1},
     '--train.actor_num_ranks 2: each optimizer step has 1 samples (prompts_per_step x '
     'n_samples_per_prompt / num_minibatches), fewer than the ranks that must each train on one'),
    ({'rollout.prompts_per_step': 1, 'rollout.n_samples_per_prompt': 1, 'train.actor_num_ranks': 1,
      'train.critic_num_ranks': 2},
     '--train.critic_num_ranks 2: each optimizer step has 1 samples (prompts_per_step x '
     'n_samples_per_prompt / num_minibatches), fewer than the ranks that must each train on one'),
    ({'train.clip_low': -0.1},
     '--train.clip_low must be in [0, 1) and --train.clip_high >= 0 (got -0.1, 0.2)'),
    ({'train.clip_low': 1.0},
     '--train.clip_low must be in [0, 1) and --train.clip_high >= 0 (got 1.0, 0.2)'),
    ({'train.clip_high': -0.1},
     '--train.clip_low must be in [0, 1) and --train.clip_high >= 0 (got 0.2, -0.1)'),
    ({'train.dual_clip': 1.0},
     '--train.dual_clip must be > 1 (got 1.0)'),
    ({'train.policy_loss': 'grpo'},
     "--train.policy_loss must be one of ['ppo', 'gspo', 'cispo', 'sapo', 'gmpo'], got 'grpo'"),
    ({'train.ratio_level': 'row'},
     "--train.ratio_level must be one of ['token', 'sequence'] (or none: the loss's own), got 'row'"),
    ({'train.ratio_level': 'sequence'},
     "--train.ratio_level sequence with --train.policy_loss ppo: PPO's clip on the sequence ratio is GSPO: set "
     "--train.policy_loss gspo (its clip range, 3e-4 / 4e-4, fits a sequence ratio; PPO's 0.2 would almost never "
     "bind)"),
    ({'train.policy_loss': 'gspo', 'train.ratio_level': 'token'},
     "--train.ratio_level token with --train.policy_loss gspo: GSPO's clip on each token's ratio is PPO's: set "
     "--train.policy_loss ppo"),
    ({'train.policy_loss': 'gmpo', 'train.ratio_level': 'token'},
     "--train.ratio_level token with --train.policy_loss gmpo: GMPO's ratio is a geometric mean over each sequence "
     "by definition: leave --train.ratio_level unset"),
    ({'train.policy_loss': 'gspo', 'train.clip_high': -0.1},
     '--train.clip_low must be in [0, 1) and --train.clip_high >= 0 (got 0.0003, -0.1)'),
    ({'train.policy_loss': 'cispo', 'train.clip_low': 1.5},
     "--train.clip_low must be in [0, 1] (1: no lower bound, cispo's own) and --train.clip_high >= 0 with "
     "--train.policy_loss cispo (got 1.5, 5.0)"),
    ({'train.policy_loss': 'gmpo', 'train.clip_low': -0.1},
     "--train.clip_low and --train.clip_high bound the log-ratio with --train.policy_loss gmpo (its own 0.4: ratios "
     "in (e^-0.4, e^0.4)); both must be >= 0 (got -0.1, 0.4)"),
    ({'train.policy_loss': 'sapo', 'train.clip_high': 0.2},
     "--train.clip_low / --train.clip_high (None, 0.2): --train.policy_loss sapo has no clip (its soft gate's "
     "temperatures are --train.sapo_tau_pos and --train.sapo_tau_neg); unset them"),
    ({'train.policy_loss': 'gspo', 'train.dual_clip': 3.0},
     "--train.dual_clip caps PPO's token loss where the advantage is negative: it needs --train.policy_loss ppo "
     "(got gspo); unset it"),
    ({'train.policy_loss': 'gmpo'},
     "--train.policy_loss gmpo weighs each sequence by one advantage, but --train.advantage_estimator gae gives "
     "every token its own; use a group estimator (grpo, dr_grpo or rloo)"),
    ({'train.tis_cap': 0},
     '--train.tis_cap must be > 0 (got 0)'),
    ({'rollout.weight_transport': 'pigeon'},
     "--rollout.weight_transport must be collective, tensor or disk, got 'pigeon'"),
    ({'rollout.bucket_bytes': 65535},
     '--rollout.bucket_bytes must be >= 65536, got 65535'),
    ({'train.placement_strategy': 'FILL'},
     "--train.placement_strategy must be PACK, SPREAD, STRICT_PACK or STRICT_SPREAD, got 'FILL'"),
    ({'train.device': 'tpu'},
     "--train.device must be cpu or cuda, got 'tpu'"),
    ({'rollout.engine_threads': 0},
     '--rollout.engine_threads must be >= 1, got 0'),
    ({'rollout.temperature': -0.1},
     '--rollout.temperature must be >= 0, got -0.1'),
    ({'data.max_prompt_len': 1985},
     '--data.max_prompt_len (1985) + --rollout.max_new_tokens (64) exceeds --rollout.max_model_len '
     '(2048); raise max_model_len or shorten one of them'),
    ({'train.max_tokens_per_microbatch': 1087},
     '--train.max_tokens_per_microbatch (1087) must hold one full sequence (max_prompt_len + max_new_tokens = 1088) '
     'on one rank of the actor group; raise it to 1088, or split the rows over an SP group '
     '(--train.sequence_parallel_size N: a rank holds 1088 / N tokens of a row, N >= 2)'),
    ({'data.prompt_data': ''},
     '--data.prompt_data is required: a JSONL / Parquet file or a datasets directory'),
    ({'data.prompt_data': '/nonexistent.jsonl'},
     "--data.prompt_data: '/nonexistent.jsonl' does not exist"),
    ({'reward.kind': 'human'},
     "--reward.kind must be function, model or remote, got 'human'"),
    ({'reward.function': None},
     '--reward.function is required with --reward.kind function (module:function)'),
    ({'reward.function': 'nocolon'},
     "--reward.function must look like module:function, name a built-in reward (exact_match, math_answer, "
     "think_format) or a weighted sum NAME=WEIGHT,..., got 'nocolon'"),
    ({'reward.kind': 'model'},
     '--model.reward_pretrain is required with --reward.kind model'),
    ({'eval.prompt_data': '/nonexistent_eval.jsonl'},
     "--eval.prompt_data: '/nonexistent_eval.jsonl' does not exist"),
    ({'eval.prompt_data': '__PROMPTS__', 'eval.k': [1, 4], 'eval.n_samples': 2},
     '--eval.k: each k must be in 1..--eval.n_samples (2), got [1, 4]'),
    ({'eval.prompt_data': '__PROMPTS__', 'eval.reward_function': 'nocolon'},
     "--eval.reward_function must look like module:function or name a built-in reward, got 'nocolon'"),
    ({'perf.peak_tflops': 0.0},
     '--perf.peak_tflops must be a positive number (one device\'s peak), got 0.0'),
    ({'perf.peak_bandwidth_gbs': float('nan')},
     '--perf.peak_bandwidth_gbs must be a positive number (one device\'s peak), got nan'),
    ({'reward.kind': 'remote', 'reward.url': 'ftp://x'},
     "--reward.url must be an http(s) URL with --reward.kind remote, got 'ftp://x'"),
    ({'log.save_steps': -1},
     '--log.save_steps must be >= 0, got -1'),
    ({'train.recompute_old_logp': False, 'train.ppo_epochs': 2},
     "--train.recompute_old_logp false: the old log-probs can come from the update's own forward only "
     "with one update per batch (--train.ppo_epochs 1, --train.num_minibatches 1) and no KL penalty in "
     "the rewards (--train.kl_mode loss or --train.kl_coef 0)"),
    ({'train.recompute_old_logp': False, 'train.num_minibatches': 2},
     "--train.recompute_old_logp false: the old log-probs can come from the update's own forward only "
     "with one update per batch (--train.ppo_epochs 1, --train.num_minibatches 1) and no KL penalty in "
     "the rewards (--train.kl_mode loss or --train.kl_coef 0)"),
    ({'train.recompute_old_logp': False},
     "--train.recompute_old_logp false: the old log-probs can come from the update's own forward only "
     "with one update per batch (--train.ppo_epochs 1, --train.num_minibatches 1) and no KL penalty in "
     "the rewards (--train.kl_mode loss or --train.kl_coef 0)"),
    ({'train.colocate_actor_ref': True, 'train.kl_coef': 0},
     '--train.colocate_actor_ref: there is no reference model to colocate (--train.kl_coef is 0)'),
    ({'train.colocate_actor_ref': True, 'train.ref_num_ranks': 1},
     "--train.colocate_actor_ref puts reference rank i on actor rank i's device: set "
     "--train.ref_num_ranks to --train.actor_num_ranks (2), got 1"),
    ({'train.colocate_critic_reward': True},
     "--train.colocate_critic_reward needs both a critic (an estimator such as gae) and a reward model "
     "(--reward.kind model); got 'gae' and 'function'"),
    ({'train.colocate_critic_reward': True, 'reward.kind': 'model', 'model.reward_pretrain': 'MODEL',
      'reward.num_ranks': 2},
     "--train.colocate_critic_reward puts reward rank i on critic rank i's device: set --reward.num_ranks "
     "to --train.critic_num_ranks (1), got 2"),
    ({'train.colocate_critic_reward': True, 'reward.kind': 'model', 'model.reward_pretrain': 'MODEL',
      'train.advantage_estimator': 'grpo'},
     "--train.colocate_critic_reward needs both a critic (an estimator such as gae) and a reward model "
     "(--reward.kind model); got 'grpo' and 'model'"),
    ({'train.colocate_all': True},
     '--train.colocate_all puts rank i of every group and engine i on device i: set '
     '--train.critic_num_ranks to --train.actor_num_ranks (2), got 1'),
    ({'train.colocate_all': True, 'train.critic_num_ranks': 2},
     '--train.colocate_all puts rank i of every group and engine i on device i: set --train.ref_num_ranks '
     'to --train.actor_num_ranks (2), got 1'),
    ({'train.colocate_all': True, 'train.critic_num_ranks': 2, 'train.ref_num_ranks': 2},
     '--train.colocate_all puts rank i of every group and engine i on device i: set --rollout.num_engines '
     'to --train.actor_num_ranks (2), got 1'),
    ({'train.colocate_all': True, 'train.critic_num_ranks': 2, 'train.ref_num_ranks': 2, 'rollout.num_engines': 2,
      'reward.kind': 'model', 'model.reward_pretrain': 'MODEL'},
     '--train.colocate_all puts rank i of every group and engine i on device i: set --reward.num_ranks to '
     '--train.actor_num_ranks (2), got 1'),
    ({'train.colocate_all': True, 'train.critic_num_ranks': 2, 'train.ref_num_ranks': 2, 'rollout.num_engines': 2,
      'rollout.tensor_parallel_size': 2},
     '--train.colocate_all places one engine per device: --rollout.tensor_parallel_size must be 1, got 2 '
     '(for tensor-parallel engines use separate devices, no colocate_all)'),
    ({'train.offload_states_while_generating': True, 'rollout.sleep_engines_while_training': False},
     '--train.offload_states_while_generating frees the device for engines that share it; it makes no '
     'sense with --rollout.sleep_engines_while_training false and no colocate_all'),
]


@pytest.mark.parametrize("overrides, message", RULES, ids=[",".join(o) for o, _ in RULES])
def test_each_rule_refuses_its_input_with_the_exact_message(base, overrides, message):
    with pytest.raises(ConfigError) as info:
        validate(base(overrides))
    assert str(info.value) == message.replace("<EMPTY>", repr(base.empty))


def test_the_base_config_is_valid(base):
    assert validate(base({})) is not None


PASSING_BOUNDARIES = [
    {"eval.prompt_data": "__PROMPTS__", "eval.k": [1, 4], "eval.n_samples": 4, "eval.reward_function": "math_answer"},
    {"train.advantage_estimator": "grpo", "rollout.n_samples_per_prompt": 2},
    {"train.dynamic_filtering": True, "rollout.n_samples_per_prompt": 2},
    {"train.dynamic_filtering_max_draws": 1},
    {"train.score_clip": 0.5},
    {"train.lr_warmup_ratio": 0.0},
    {"train.lr_warmup_ratio": 0.99},
    {"rollout.memory_fraction": 1.0},
    {"rollout.memory_fraction": 0.01},
    {"train.kl_coef": 0.0},
    {"train.kl_mode": "loss"},
    {"train.kl_mode": "loss", "train.kl_estimator": "k2"},
    {"train.kl_mode": "loss", "train.kl_estimator": "k1", "train.kl_straight_through": True},
    {"train.kl_mode": "reward", "train.kl_estimator": "k1"},
    {"train.loss_aggregation": "seq_mean"},
    {"train.loss_aggregation": "seq_mean_token_sum_norm"},
    {"train.advantage_norm": "none"},
    {"train.tis_low": 0.0, "train.tis_cap": 2.0, "train.tis_mode": "mask"},
    {"train.dynamic_filtering": True, "rollout.n_samples_per_prompt": 2, "train.dynamic_filtering_range": [0.0, 1.0]},
    {"reward.overlong_buffer_len": 64, "reward.overlong_penalty_factor": 0.0},
    {"train.mask_truncated": True},
    {"rollout.prompts_per_step": 1, "rollout.n_samples_per_prompt": 2, "train.actor_num_ranks": 2},
    {"rollout.prompts_per_step": 1, "rollout.n_samples_per_prompt": 1, "train.actor_num_ranks": 1},
    {"train.num_minibatches": 4, "train.actor_num_ranks": 8},
    {"train.clip_low": 0.0, "train.clip_high": 0.0},
    {"train.clip_low": 0.99},
    {"train.dual_clip": 1.01},
    {"train.policy_loss": "gspo"},
    {"train.policy_loss": "gspo", "train.loss_aggregation": "token_mean", "train.clip_low": 0.0},
    {"train.policy_loss": "cispo", "train.clip_low": 1.0, "train.clip_high": 0.0},
    {"train.policy_loss": "cispo", "train.ratio_level": "sequence", "train.tis_cap": 2.0},
    {"train.policy_loss": "sapo", "train.ratio_level": "sequence"},
    {"train.policy_loss": "gmpo", "train.advantage_estimator": "grpo", "rollout.n_samples_per_prompt": 2,
     "train.clip_low": 0.0, "train.clip_high": 0.0},
    {"train.tis_cap": 0.01},
    {"rollout.weight_transport": "tensor"},
    {"rollout.weight_transport": "disk"},
    {"rollout.bucket_bytes": 65536},
    {"train.placement_strategy": "STRICT_SPREAD"},
    {"train.device": "cuda"},
    {"rollout.engine_threads": 1},
    {"rollout.temperature": 0.0},
    {"data.max_prompt_len": 1984},
    {"train.max_tokens_per_microbatch": 1088},
    {"reward.kind": "model", "model.reward_pretrain": "MODEL"},
    {"reward.kind": "remote", "reward.url": "https://scorer.example/score", "reward.function": None},
    {"reward.kind": "remote", "reward.url": "http://localhost:8000", "reward.function": None},
    {"log.save_steps": 0},
    {"model.critic_pretrain": "MODEL", "model.dtype": "bfloat16", "model.attn_implementation": "eager"},
    {"train.recompute_old_logp": False, "train.kl_mode": "loss"},
    {"train.recompute_old_logp": False, "train.kl_coef": 0.0},
    {"train.recompute_old_logp": True, "train.ppo_epochs": 2},
    {"train.colocate_actor_ref": True, "train.ref_num_ranks": 2},
    {"train.colocate_critic_reward": True, "reward.kind": "model", "model.reward_pretrain": "MODEL"},
    # colocate_all: groups a run does not have need no matching size (grpo: no critic; kl 0: no reference)
    {"train.colocate_all": True, "train.advantage_estimator": "grpo", "train.kl_coef": 0.0, "rollout.num_engines": 2},
    {"train.colocate_all": True, "train.critic_num_ranks": 2, "train.ref_num_ranks": 2, "rollout.num_engines": 2,
     "reward.kind": "model", "model.reward_pretrain": "MODEL", "reward.num_ranks": 2},
    {"train.offload_states_while_generating": True, "rollout.sleep_engines_while_training": True},
    {"train.offload_states_while_generating": True, "train.colocate_all": True, "train.critic_num_ranks": 2,
     "train.ref_num_ranks": 2, "rollout.num_engines": 2, "rollout.sleep_engines_while_training": False},
]


@pytest.mark.parametrize("overrides", PASSING_BOUNDARIES, ids=[",".join(o) for o in PASSING_BOUNDARIES])
def test_each_rule_lets_its_boundary_through(base, overrides):
    validate(base(overrides))


AT_LEAST_ONE = ["train.actor_num_ranks", "train.critic_num_ranks", "train.ref_num_ranks", "rollout.num_engines",
                "rollout.prompts_per_step", "train.max_steps", "train.ppo_epochs", "train.num_minibatches",
                "rollout.max_new_tokens", "train.worker_threads", "rollout.tensor_parallel_size",
                "rollout.n_samples_per_prompt", "data.max_prompt_len", "train.kl_horizon"]


@pytest.mark.parametrize("dotted", AT_LEAST_ONE)
def test_counts_must_be_at_least_one(base, dotted):
    with pytest.raises(ConfigError) as info:
        validate(base({dotted: 0}))
    assert str(info.value) == f"--{dotted} must be >= 1, got 0"


RANGES = [  # (setting, a value that breaks it, the rule, values that pass)
    ("train.actor_lr", -1e-6, ">= 0", [0.0]),
    ("train.actor_lr", float("inf"), ">= 0", []),
    ("train.critic_lr", -1e-6, ">= 0", [0.0]),
    ("train.critic_lr", float("nan"), ">= 0", []),
    ("train.weight_decay", -0.1, ">= 0", [0.0]),
    ("train.max_grad_norm", 0.0, "> 0", [0.01]),
    ("train.gamma", 1.01, "in [0, 1]", [0.0, 1.0]),
    ("train.gamma", -0.01, "in [0, 1]", []),
    ("train.lam", 1.01, "in [0, 1]", [0.0, 1.0]),
    ("train.lam", -0.01, "in [0, 1]", []),
    ("train.entropy_coef", -0.01, ">= 0", [0.0]),
    ("train.sapo_tau_pos", 0.0, "> 0", [0.01]),
    ("train.sapo_tau_neg", float("inf"), "> 0", [0.01]),
    ("train.value_clip", 0.0, "> 0 (or none)", [None, 0.01]),
    ("train.kl_target", 0.0, "> 0 (or none)", [None, 0.01]),
    ("train.critic_warmup_steps", -1, ">= 0", [0]),
    ("train.timeout_s", 0.0, "> 0", [0.5]),
    ("rollout.top_p", 0.0, "in (0, 1]", [1.0, 0.01]),
    ("rollout.top_p", 1.01, "in (0, 1]", []),
    ("rollout.top_k", 0, "-1 (off) or >= 1", [-1, 1]),
    ("rollout.top_k", -2, "-1 (off) or >= 1", []),
    ("log.profile_step", -1, ">= 0 (or none)", [None, 0]),
]


@pytest.mark.parametrize("dotted, bad, rule, good", RANGES, ids=[f"{r[0]}={r[1]}" for r in RANGES])
def test_ranges_refuse_the_value_outside_and_take_the_boundary(base, dotted, bad, rule, good):
    with pytest.raises(ConfigError) as info:
        validate(base({dotted: bad}))
    assert str(info.value) == f"--{dotted} must be {rule}, got {bad}"
    for value in good:
        validate(base({dotted: value}))


# ---- reading values ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("raw, expected", [
    ("1", True), ("TRUE", True), ("yes", True), ("On", True), (True, True),
    ("0", False), ("false", False), ("NO", False), ("off", False), (False, False),
])
def test_booleans_are_read_from_the_usual_words(raw, expected):
    assert _coerce("--log.tensorboard", bool, raw) is expected


def test_optional_values_read_none_and_their_inner_type():
    for raw in (None, "none", "None", "NULL", "null"):
        assert _coerce("--train.dual_clip", float | None, raw) is None
    assert _coerce("--train.dual_clip", float | None, "3") == 3.0
    with pytest.raises(ConfigError) as info:
        _coerce("--train.dual_clip", float | None, "big")
    assert str(info.value) == "--train.dual_clip: cannot read 'big' as float"


def test_integers_take_exponents_and_refuse_fractions():
    assert _coerce("--rollout.bucket_bytes", int, "1e6") == 1_000_000
    assert _coerce("--rollout.bucket_bytes", int, "1E3") == 1000
    assert _coerce("--rollout.bucket_bytes", int, "12") == 12
    assert _coerce("--rollout.bucket_bytes", int, 3.0) == 3
    for raw in (2.5, "2.5", "many"):
        with pytest.raises(ConfigError) as info:
            _coerce("--rollout.bucket_bytes", int, raw)
        assert str(info.value) == f"--rollout.bucket_bytes: cannot read {raw!r} as int"
    with pytest.raises(ConfigError) as info:
        _coerce("--log.tensorboard", bool, "maybe")
    assert str(info.value) == "--log.tensorboard: cannot read 'maybe' as bool"


def test_lists_and_mappings():
    assert _coerce("--rollout.stop_token_ids", list[int], "5, 7 9") == [5, 7, 9]
    assert _coerce("--rollout.stop_token_ids", list[int], ["5", 7]) == [5, 7]
    assert _coerce("--rollout.stop_token_ids", list[int], "") == []
    with pytest.raises(ConfigError) as info:
        _coerce("--rollout.stop_token_ids", list[int], "5,x")
    assert str(info.value) == "--rollout.stop_token_ids: cannot read '5,x' as list"
    kwargs = {"a": 1}
    got = _coerce("--rollout.engine_kwargs", dict[str, int], kwargs)
    assert got == kwargs and got is not kwargs  # a copy: the YAML's mapping is not shared
    assert _coerce("--rollout.engine_kwargs", dict[str, int], '{"b": 2}') == {"b": 2}


def test_dotted_keys_need_a_known_section_and_key():
    cfg = Config()
    apply_overrides(cfg, {"train.max_steps": "7"}, "flag")
    assert cfg.train.max_steps == 7
    for dotted in ("train", "nosuch.key", "train.actor_lr.x"):
        with pytest.raises(ConfigError, match=f"^flag: unknown setting {dotted!r}"):
            apply_overrides(Config(), {dotted: "1"}, "flag")
    with pytest.raises(ConfigError, match=r"^run.yaml: unknown setting 'train.nosuch'.*; train has \[.*'actor_lr'"):
        apply_overrides(Config(), {"train.nosuch": 1}, "run.yaml")


def test_yaml_files_must_be_mappings_of_mappings(tmp_path):
    missing = str(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError) as info:
        load_yaml(missing)
    assert str(info.value) == f"--config: file {missing!r} does not exist"
    top = tmp_path / "top.yaml"
    top.write_text("- a\n- b\n")
    with pytest.raises(ConfigError) as info:
        load_yaml(str(top))
    assert str(info.value) == (f"{top}: the top level must be a mapping of sections "
                               "(model, rollout, train, data, reward, log, eval, agent, lora, perf, distill)")
    section = tmp_path / "section.yaml"
    section.write_text("train: [1, 2]\n")
    with pytest.raises(ConfigError) as info:
        load_yaml(str(section))
    assert str(info.value) == f"{section}: section 'train' must be a mapping, got list"
    good = tmp_path / "good.yaml"
    good.write_text("train:\n  max_steps: 3\nlog:\n  resume: true\n")
    assert load_yaml(str(good)) == {"train.max_steps": 3, "log.resume": True}


def test_a_critic_warmup_longer_than_the_run_leaves_the_actor_no_steps(base):
    cfg = base({"train.max_steps": 3, "train.critic_warmup_steps": 5, "train.ppo_epochs": 2})
    assert optimizer_steps(cfg, "actor") == 0
    assert optimizer_steps(cfg, "critic") == 3 * 2


# ---- flags: help, unknown flags, YAML errors -----------------------------------------------------------------
def test_help_names_every_setting_with_its_default():
    from rlhf_sg.config import build_parser

    parser = build_parser()
    assert parser.prog == "rlhf-sg train-ppo"
    text = parser.format_help()
    assert text.startswith("usage: rlhf-sg train-ppo")
    assert "\ntrain:\n" in text and "\nrollout:\n" in text  # one group per section
    flat = " ".join(text.split())
    assert ("Train a policy with PPO / GRPO / Dr.GRPO / RLOO / REINFORCE++. Every setting is a dotted flag "
            "(--section.key value); a YAML file (--config) fills the same keys; flags win over the file.") in flat
    assert ("--config CONFIG YAML file with sections model, rollout, train, data, reward, log, eval, agent, lora, "
            "perf, distill") in flat
    assert "--train.value_clip V (default: 0.5)" in flat and "--rollout.backend V (default: 'hf')" in flat
    assert "--backend ROLLOUT.BACKEND alias of --rollout.backend" in flat
    ns = parser.parse_args(["--train.max_steps", "3", "--algo", "rloo"])
    assert vars(ns) == {"config": None, "train.max_steps": "3", "train.advantage_estimator": "rloo"}


@pytest.mark.parametrize("argv, message", [
    (["--train.max_stepz", "3"], "unknown flag --train.max_stepz (did you mean --train.max_steps?); "),
    (["--train.actor_lr=1e-6", "--rollout.temprature=1"],
     "unknown flag --rollout.temprature (did you mean --rollout.temperature?); "),
    (["--data.promt_data", "x"], "unknown flag --data.promt_data (did you mean --data.prompt_data?); "),
    (["--zzzzzz", "1"], "unknown flag --zzzzzz; "),
    (["stray"], "unexpected argument 'stray': settings are given as --section.key value"),
])
def test_unknown_flags_are_named_with_the_closest_setting(argv, message):
    from rlhf_sg.config import parse_args

    with pytest.raises(ConfigError) as info:
        parse_args(argv)
    text = str(info.value)
    assert text.startswith(message)
    if "unknown flag" in message:
        assert text.endswith("; `rlhf-sg train-ppo --help` lists every setting")


def test_unknown_yaml_keys_suggest_the_closest_setting():
    with pytest.raises(ConfigError) as info:
        apply_overrides(Config(), {"train.actor_lrr": 1}, "run.yaml")
    assert str(info.value).startswith("run.yaml: unknown setting 'train.actor_lrr' (did you mean 'train.actor_lr'?); "
                                      "train has [")
    with pytest.raises(ConfigError) as info:  # the same key in another section
        apply_overrides(Config(), {"model.max_steps": 1}, "run.yaml")
    assert "(did you mean 'train.max_steps'?)" in str(info.value)
    with pytest.raises(ConfigError) as info:
        apply_overrides(Config(), {"qqq.www": 1}, "flag")
    assert str(info.value) == ("flag: unknown setting 'qqq.www'; sections are "
                               "['agent', 'data', 'distill', 'eval', 'log', 'lora', 'model', 'perf', 'reward', "
                               "'rollout', 'train']")
    with pytest.raises(ConfigError) as info:  # a flag's value names the flag
        apply_overrides(Config(), {"train.max_steps": "many"}, "flag")
    assert str(info.value) == "--train.max_steps: cannot read 'many' as int"
    with pytest.raises(ConfigError) as info:  # a file's value names the file and the key
        apply_overrides(Config(), {"train.max_steps": "many"}, "run.yaml")
    assert str(info.value) == "run.yaml: train.max_steps: cannot read 'many' as int"


def test_broken_yaml_names_the_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  max_steps: 3\n  lr: [1, 2\n")
    with pytest.raises(ConfigError) as info:
        load_yaml(str(bad))
    text = str(info.value)
    assert text.startswith(f"{bad} line 4: not valid YAML (") and text.endswith(
        "); sections of `key: value` lines are expected")
    assert "expected ',' or ']'" in text
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("train:\n  name: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=f"^--config: cannot read {re.escape(repr(str(latin)))} as UTF-8 text"):
        load_yaml(str(latin))
    accented = tmp_path / "utf8.yaml"
    accented.write_text("log:\n  output_dir: runs/caf\u00e9\n", encoding="utf-8")
    assert load_yaml(str(accented)) == {"log.output_dir": "runs/caf\u00e9"}


def test_parse_args_reads_flags_after_the_yaml_file(tmp_path, base):
    cfg0 = base({})
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text(f"model:\n  pretrain: {cfg0.model.pretrain}\ndata:\n  prompt_data: {cfg0.data.prompt_data}\n"
                         "reward:\n  function: m:f\ntrain:\n  max_steps: 4\n  ppo_epochs: 2\n")
    from rlhf_sg.config import parse_args

    cfg = parse_args(["--config", str(yaml_file), "--train.max_steps", "9"])
    assert cfg.train.max_steps == 9 and cfg.train.ppo_epochs == 2


# ---- devices ---------------------------------------------------------------------------------------------------
def test_devices_add_up_by_layout(base):
    from rlhf_sg.config import devices_needed

    # gae: actor 2, critic 1, reference 1 (kl 0.01), engines 1 x tp 2
    assert devices_needed(base({"rollout.tensor_parallel_size": 2})) == (
        6, "2 actor, 1 engines x tensor_parallel_size 2, 1 critic, 1 ref")
    # grpo, no KL, a reward model: no critic, no reference
    assert devices_needed(base({"train.advantage_estimator": "grpo", "train.kl_coef": 0.0, "reward.kind": "model",
                                "model.reward_pretrain": "MODEL", "reward.num_ranks": 3})) == (
        6, "2 actor, 1 engines x tensor_parallel_size 1, 3 reward")
    # actor and reference share; critic and reward share as many as the larger has ranks
    assert devices_needed(base({"train.colocate_actor_ref": True, "train.ref_num_ranks": 2,
                                "train.colocate_critic_reward": True, "reward.kind": "model",
                                "model.reward_pretrain": "MODEL", "train.critic_num_ranks": 3,
                                "reward.num_ranks": 3})) == (
        6, "2 shared by actor+ref, 3 shared by critic+reward, 1 engines x tensor_parallel_size 1")
    # everything on the actor's devices
    assert devices_needed(base({"train.colocate_all": True, "train.critic_num_ranks": 2, "train.ref_num_ranks": 2,
                                "rollout.num_engines": 2})) == (2, "2 shared by actor+engines+critic+ref")


def test_device_check_on_cuda_only_and_by_what_is_visible(base, monkeypatch):
    from rlhf_sg import config as config_module
    from rlhf_sg.config import check_devices

    cfg = base({"train.device": "cuda"})  # needs 2 actor + 1 critic + 1 ref + 1 engine = 5
    check_devices(base({}), visible=0)  # on CPU nothing is checked
    check_devices(cfg, visible=5)  # exactly enough
    with pytest.raises(ConfigError) as info:
        check_devices(cfg, visible=4)
    assert str(info.value).startswith("the layout needs 5 GPUs (2 actor, 1 engines x tensor_parallel_size 1, "
                                      "1 critic, 1 ref) but 4 are visible; lower --train.*_num_ranks")
    with pytest.raises(ConfigError, match="^--train.device cuda: no CUDA device is visible"):
        check_devices(cfg, visible=0)
    with pytest.raises(ConfigError, match="^--rollout.tensor_parallel_size 3 is larger than the 2 GPUs visible: "):
        check_devices(base({"train.device": "cuda", "rollout.tensor_parallel_size": 3}), visible=2)
    check_devices(base({"train.device": "cuda", "rollout.tensor_parallel_size": 2, "train.actor_num_ranks": 1,
                        "train.kl_coef": 0.0, "train.advantage_estimator": "grpo"}), visible=3)
    # visible=None: this machine's GPUs when the run starts its own Ray, unknown (no check) when it joins one
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(config_module, "_visible_gpus", lambda: 1)
    with pytest.raises(ConfigError, match="^the layout needs 5 GPUs"):
        check_devices(cfg)
    monkeypatch.setattr(config_module, "_visible_gpus", lambda: None)
    check_devices(cfg)


def test_visible_gpus_are_known_only_for_a_local_ray(monkeypatch):
    import sys

    import torch

    from rlhf_sg.config import _visible_gpus

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    if "ray" in sys.modules:
        monkeypatch.setattr(sys.modules["ray"], "is_initialized", lambda: False)
    for address in (None, "local"):
        if address is None:
            monkeypatch.delenv("RAY_ADDRESS", raising=False)
        else:
            monkeypatch.setenv("RAY_ADDRESS", address)
        assert _visible_gpus() == 3
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert _visible_gpus() is None

    class RunningRay:
        @staticmethod
        def is_initialized():
            return True

        @staticmethod
        def cluster_resources():
            return {"CPU": 8.0, "GPU": 4.0}

    monkeypatch.setitem(sys.modules, "ray", RunningRay)
    assert _visible_gpus() == 4
    RunningRay.cluster_resources = staticmethod(lambda: {"CPU": 8.0})
    assert _visible_gpus() == 0


@pytest.mark.parametrize("setting, colocate_all, expected", [(None, True, True), (None, False, False),
                                                             (False, True, False), (True, False, True)])
def test_sleep_and_offload_follow_colocate_all_unless_set(base, setting, colocate_all, expected):
    from rlhf_sg.config import offload_states, sleep_engines

    cfg = base({"rollout.sleep_engines_while_training": setting, "train.offload_states_while_generating": setting,
                "train.colocate_all": colocate_all})
    assert sleep_engines(cfg) is expected and offload_states(cfg) is expected


def test_to_dict_is_every_section():
    d = Config().to_dict()
    assert list(d) == ["model", "rollout", "train", "data", "reward", "log", "eval", "agent", "lora", "perf",
                       "distill"]
    assert d["train"]["value_clip"] == 0.5 and d["rollout"]["stop_token_ids"] == []


# ---- more rules with their exact messages and boundaries; reading flags, files and model directories --------


SMALL = {'rollout.prompts_per_step': 1, 'rollout.n_samples_per_prompt': 2}
MORE_RULES = [
    ({**SMALL, 'train.ref_num_ranks': 3},
     '--train.ref_num_ranks 3: a step has 2 samples (prompts_per_step x n_samples_per_prompt), fewer than the '
     'ranks that must each score one; lower it or raise --rollout.prompts_per_step'),
    ({**SMALL, 'reward.kind': 'model', 'model.reward_pretrain': 'MODEL', 'reward.num_ranks': 3},
     '--reward.num_ranks 3: a step has 2 samples (prompts_per_step x n_samples_per_prompt), fewer than the '
     'ranks that must each score one; lower it or raise --rollout.prompts_per_step'),
    ({'train.max_nonfinite_steps': 0},
     '--train.max_nonfinite_steps must be >= 1, got 0'),
]


@pytest.mark.parametrize("overrides, message", MORE_RULES, ids=[",".join(o) for o, _ in MORE_RULES])
def test_more_rules_refuse_their_input_with_the_exact_message(base, overrides, message):
    with pytest.raises(ConfigError) as info:
        validate(base(overrides))
    assert str(info.value) == message


@pytest.mark.parametrize("overrides", [
    {**SMALL, 'train.ref_num_ranks': 2},  # exactly one sample per reference rank
    {**SMALL, 'train.ref_num_ranks': 3, 'train.kl_coef': 0.0},  # no KL: the reference does not score
    {**SMALL, 'reward.num_ranks': 3},  # a reward function: the reward ranks do not score
    {**SMALL, 'reward.kind': 'model', 'model.reward_pretrain': 'MODEL', 'reward.num_ranks': 2},
    {'train.max_nonfinite_steps': 1},
    {'model.attn_implementation': 'flash_attention_2', 'model.dtype': 'bfloat16', 'train.device': 'cuda'},
    {'model.attn_implementation': 'eager'},
])
def test_more_rules_let_their_boundary_through(base, overrides):
    validate(base(overrides))


def test_a_model_directory_needs_a_json_object_and_weights_beside_it(base, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # an empty working directory: the weights are looked for in the model directory
    model = tmp_path / "critic"
    model.mkdir()
    for text in ("[1, 2]", "{not json"):
        (model / "config.json").write_text(text)
        with pytest.raises(ConfigError) as info:
            validate(base({"model.critic_pretrain": str(model)}))
        assert str(info.value) == (f"--model.critic_pretrain: {str(model / 'config.json')!r} is not a JSON object; "
                                   "re-save the model with save_pretrained")
    (model / "config.json").write_text("{}")
    with pytest.raises(ConfigError) as info:
        validate(base({"model.critic_pretrain": str(model)}))
    assert str(info.value) == (f"--model.critic_pretrain: {str(model)!r} has a config.json but no weights "
                               "(*.safetensors or *.bin); save the model with save_pretrained or point at the "
                               "directory that holds them")
    for weights in ("pytorch_model.bin", "model.safetensors"):
        (model / weights).write_bytes(b"")
        validate(base({"model.critic_pretrain": str(model)}))
        (model / weights).unlink()


def test_settings_with_two_dots_or_a_misspelled_section_are_named():
    with pytest.raises(ConfigError) as info:
        apply_overrides(Config(), {"train.max_steps.x": 1}, "run.yaml")
    assert str(info.value).startswith("run.yaml: unknown setting 'train.max_steps.x'") and "; train has [" in str(
        info.value)
    with pytest.raises(ConfigError) as info:
        apply_overrides(Config(), {"trian.max_steps": 1}, "run.yaml")
    assert str(info.value) == ("run.yaml: unknown setting 'trian.max_steps' (did you mean 'train.max_steps'?); "
                               "sections are ['agent', 'data', 'distill', 'eval', 'log', 'lora', 'model', 'perf', "
                               "'reward', 'rollout', 'train']")


def test_yaml_errors_quote_the_parsers_problem(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  max_steps: 3\n  lr: [1, 2\n")
    with pytest.raises(ConfigError) as info:
        load_yaml(str(bad))
    assert str(info.value) == (f"{bad} line 4: not valid YAML (expected ',' or ']', but got '<stream end>'); "
                               "sections of `key: value` lines are expected")
    control = tmp_path / "control.yaml"  # an error without a line mark: the whole error is quoted
    control.write_text("a: \x07\n")
    with pytest.raises(ConfigError) as info:
        load_yaml(str(control))
    text = str(info.value)
    assert text.startswith(f"{control}: not valid YAML (unacceptable character #x0007: special characters are not "
                           "allowed")
    assert text.endswith("); sections of `key: value` lines are expected")


def test_flag_values_name_the_flag_and_unknown_flags_keep_their_whole_name(tmp_path):
    from rlhf_sg.config import parse_args

    with pytest.raises(ConfigError) as info:
        parse_args(["--train.max_steps", "many"])
    assert str(info.value) == "--train.max_steps: cannot read 'many' as int"
    with pytest.raises(ConfigError) as info:  # the name ends at the first '='
        parse_args(["--train.max_stepz=a=b"])
    assert str(info.value).startswith("unknown flag --train.max_stepz (did you mean --train.max_steps?); ")


def test_device_check_messages_say_what_to_do(base):
    from rlhf_sg.config import check_devices

    cfg = base({"train.device": "cuda"})
    for visible, message in [
        (0, "--train.device cuda: no CUDA device is visible (check CUDA_VISIBLE_DEVICES and the driver), or run on "
            "CPU with --train.device cpu"),
        (4, "the layout needs 5 GPUs (2 actor, 1 engines x tensor_parallel_size 1, 1 critic, 1 ref) but 4 are "
            "visible; lower --train.*_num_ranks / --rollout.num_engines / --rollout.tensor_parallel_size, or share "
            "devices (--train.colocate_all, --train.colocate_actor_ref, --train.colocate_critic_reward), or join a "
            "larger Ray cluster (RAY_ADDRESS)"),
    ]:
        with pytest.raises(ConfigError) as info:
            check_devices(cfg, visible=visible)
        assert str(info.value) == message


COLOCATED = {'train.colocate_all': True, 'train.critic_num_ranks': 2, 'train.ref_num_ranks': 2,
             'rollout.num_engines': 2}
ROLLOUT_MODE_RULES = [
    ({'rollout.mode': 'eager'}, "--rollout.mode must be one of ['sync', 'async'], got 'eager'"),
    ({'rollout.max_staleness': 0},
     '--rollout.max_staleness must be >= 1 (weight versions a batch may lag the trainer), got 0; for on-policy '
     'training use --rollout.mode sync'),
    ({'rollout.mode': 'async', 'rollout.sleep_engines_while_training': True},
     '--rollout.mode async generates while the trainer trains: the engines cannot sleep then; drop '
     '--rollout.sleep_engines_while_training or use --rollout.mode sync'),
    ({'rollout.mode': 'async', 'train.offload_states_while_generating': True},
     '--rollout.mode async trains while the engines generate: the training states cannot leave the device then; '
     'drop --train.offload_states_while_generating or use --rollout.mode sync'),
]


@pytest.mark.parametrize("overrides, message", ROLLOUT_MODE_RULES, ids=[",".join(o) for o, _ in ROLLOUT_MODE_RULES])
def test_rollout_mode_rules_refuse_their_input_with_the_exact_message(base, overrides, message):
    with pytest.raises(ConfigError) as info:
        validate(base(overrides))
    assert str(info.value) == message


@pytest.mark.parametrize("overrides", [
    {'rollout.mode': 'async', 'rollout.max_staleness': 1},
    {'rollout.mode': 'async', 'rollout.sleep_engines_while_training': False},
    {'rollout.mode': 'sync', 'rollout.sleep_engines_while_training': True},  # sync: engines may sleep
    {'rollout.mode': 'sync', 'train.offload_states_while_generating': True,
     'rollout.sleep_engines_while_training': True},
    # colocated engines and trainer share the devices: such a run stays sync, sleeping and offloading as usual
    {**COLOCATED, 'rollout.mode': 'async', 'rollout.sleep_engines_while_training': True,
     'train.offload_states_while_generating': True},
])
def test_rollout_mode_rules_let_their_boundary_through(base, overrides):
    validate(base(overrides))


def test_misspelled_names_are_matched_by_their_key_first():
    from rlhf_sg.config import parse_args

    # a key alone, or in the wrong section, or under a wrong sub-key: the setting with that key
    with pytest.raises(ConfigError) as info:
        parse_args(["--lam", "0.9"])
    assert str(info.value).startswith("unknown flag --lam (did you mean --train.lam?); ")
    with pytest.raises(ConfigError) as info:  # an alias's name under a section: the alias
        parse_args(["--train.algo", "rloo"])
    assert str(info.value).startswith("unknown flag --train.algo (did you mean --algo?); ")
    for dotted in ("model.lam", "train.x.lam"):
        with pytest.raises(ConfigError) as info:
            apply_overrides(Config(), {dotted: 1}, "run.yaml")
        assert f"unknown setting {dotted!r} (did you mean 'train.lam'?)" in str(info.value)


SETTING_RULES = [
    ({'rollout.max_engine_restarts': -1}, '--rollout.max_engine_restarts must be >= 0, got -1'),
    ({'reward.on_error': 'skip'}, "--reward.on_error must be raise or zero, got 'skip'"),
    ({'reward.timeout_s': 0}, '--reward.timeout_s must be > 0, got 0'),
    ({'reward.retries': -1}, '--reward.retries must be >= 0, got -1'),
    ({'rollout.engine_kwargs': {'api_key': 'k'}},
     "--rollout.engine_kwargs['api_key']: keys never go in the config (it is saved to <output_dir>/config.json); put "
     "the key in an environment variable and set engine_kwargs['api_key_env'] to its name"),
    ({'rollout.engine_kwargs': {'admin_api_key': 'k'}},
     "--rollout.engine_kwargs['admin_api_key']: keys never go in the config (it is saved to <output_dir>/config.json); "
     "put the key in an environment variable and set engine_kwargs['admin_api_key_env'] to its name"),
]


@pytest.mark.parametrize("overrides, message", SETTING_RULES, ids=[",".join(o) for o, _ in SETTING_RULES])
def test_setting_rules_refuse_their_input_with_the_exact_message(base, overrides, message):
    with pytest.raises(ConfigError) as info:
        validate(base(overrides))
    assert str(info.value) == message


@pytest.mark.parametrize("overrides", [
    {'rollout.max_engine_restarts': 0}, {'reward.on_error': 'zero'}, {'reward.on_error': 'raise'},
    {'reward.timeout_s': 0.5}, {'reward.retries': 0}, {'rollout.engine_kwargs': {'api_key_env': 'KEY'}},
    {'train.placement_strategy': 'SPREAD'}, {'train.placement_strategy': 'STRICT_PACK'},
])
def test_setting_rules_let_their_boundary_through(base, overrides):
    validate(base(overrides))


def test_async_runs_and_their_tis_cap(base):
    from rlhf_sg.config import ASYNC_TIS_CAP, rollout_is_async, tis_cap

    assert ASYNC_TIS_CAP == 2.0
    separate, colocated = base({'rollout.mode': 'async'}), base({**COLOCATED, 'rollout.mode': 'async'})
    assert (rollout_is_async(separate), rollout_is_async(colocated), rollout_is_async(base({}))) == (True, False, False)
    # the cap in force: the one set, else 2.0 in an async run, else none
    assert (tis_cap(separate), tis_cap(colocated), tis_cap(base({}))) == (2.0, None, None)
    assert tis_cap(base({'rollout.mode': 'async', 'train.tis_cap': 5.0})) == 5.0
    assert tis_cap(base({'train.tis_cap': 3.0})) == 3.0


# a remote reward: its token comes from an environment variable named in the config, its CA from a file
REMOTE = {'reward.kind': 'remote', 'reward.url': 'https://scorer.example/score', 'reward.function': None}
TOKEN_VAR = "RLHF_SG_TEST_REWARD_TOKEN"


@pytest.fixture
def ca_file(tmp_path):
    path = tmp_path / "ca.pem"
    path.write_text("-----BEGIN CERTIFICATE-----\n")
    return str(path)


@pytest.mark.parametrize("token_env", ["sk-live-123abc", "TOKÉN", "1TOKEN", "MY TOKEN"])
def test_remote_reward_token_env_takes_a_variable_name_not_the_token(base, monkeypatch, token_env):
    # ASCII but not a name (a pasted key, a leading digit, a space); a name but not ASCII: each refused,
    # even when a variable of that spelling is set
    monkeypatch.setenv(token_env, "secret")
    with pytest.raises(ConfigError) as info:
        validate(base({**REMOTE, 'reward.token_env': token_env}))
    assert str(info.value) == ("--reward.token_env takes the NAME of an environment variable that holds the token "
                               "(letters, digits, underscores), not the token itself")


@pytest.mark.parametrize("value", [None, "", "  \n"], ids=["unset", "empty", "blank"])
def test_remote_reward_token_env_must_name_a_variable_that_is_set(base, monkeypatch, value):
    if value is None:
        monkeypatch.delenv(TOKEN_VAR, raising=False)
    else:
        monkeypatch.setenv(TOKEN_VAR, value)
    with pytest.raises(ConfigError) as info:
        validate(base({**REMOTE, 'reward.token_env': TOKEN_VAR}))
    assert str(info.value) == (f"--reward.token_env: environment variable {TOKEN_VAR} is not set (or empty); "
                               f"export {TOKEN_VAR}=<token> before starting the run")


def test_remote_reward_ca_file_needs_https_and_an_existing_file(base, ca_file, tmp_path):
    with pytest.raises(ConfigError) as info:
        validate(base({**REMOTE, 'reward.url': 'http://localhost:8000', 'reward.ca_file': ca_file}))
    assert str(info.value) == "--reward.ca_file needs an https --reward.url, got 'http://localhost:8000'"
    for missing in (str(tmp_path / "nope.pem"), str(tmp_path)):  # absent, or a directory
        with pytest.raises(ConfigError) as info:
            validate(base({**REMOTE, 'reward.ca_file': missing}))
        assert str(info.value) == f"--reward.ca_file: {missing!r} is not a file (a PEM certificate)"


@pytest.mark.parametrize("kind", ["function", "model"])
@pytest.mark.parametrize("setting", ["token_env", "ca_file", "both"])
def test_token_env_and_ca_file_belong_to_a_remote_reward_only(base, monkeypatch, ca_file, kind, setting):
    monkeypatch.setenv(TOKEN_VAR, "t0ken")
    extra = {'model.reward_pretrain': 'MODEL'} if kind == "model" else {}
    given = {'token_env': {'reward.token_env': TOKEN_VAR}, 'ca_file': {'reward.ca_file': ca_file}}
    given['both'] = given['token_env'] | given['ca_file']
    with pytest.raises(ConfigError) as info:
        validate(base({'reward.kind': kind, **extra, **given[setting]}))
    assert str(info.value) == "--reward.token_env / --reward.ca_file apply to --reward.kind remote only"


def test_a_remote_reward_with_a_token_variable_and_a_ca_file_is_valid(base, monkeypatch, ca_file):
    monkeypatch.setenv(TOKEN_VAR, "t0ken")
    monkeypatch.setenv("_T2", " x ")  # a name may start with an underscore; the value only needs a non-space
    validate(base({**REMOTE, 'reward.token_env': TOKEN_VAR, 'reward.ca_file': ca_file}))
    validate(base({**REMOTE, 'reward.token_env': '_T2'}))
    validate(base({**REMOTE, 'reward.ca_file': ca_file}))
    cfg = validate(base({**REMOTE, 'reward.url': 'http://localhost:8000'}))  # neither: plain http is fine
    assert cfg.reward.token_env is None and cfg.reward.ca_file is None


def test_one_worker_thread_is_enough(base):
    # the count's boundary: 1 passes (0 is refused in test_counts_must_be_at_least_one)
    assert validate(base({'train.worker_threads': 1})).train.worker_threads == 1
    with pytest.raises(ConfigError) as info:
        validate(base({'train.worker_threads': 0}))
    assert str(info.value) == "--train.worker_threads must be >= 1, got 0"


@pytest.mark.parametrize("share, attn, shared", [
    (True, "sdpa", True), (True, "eager", True), (True, "flash_attention_2", False), (False, "sdpa", False),
    (False, "eager", False),
])
def test_prompts_are_shared_only_when_asked_and_the_attention_takes_a_mask(base, share, attn, shared):
    from rlhf_sg.config import shares_prompts

    flash = {'model.dtype': 'bfloat16', 'train.device': 'cuda'} if attn == "flash_attention_2" else {}
    cfg = validate(base({'train.share_prompts': share, 'model.attn_implementation': attn, **flash}))
    assert shares_prompts(cfg) is shared


@pytest.mark.parametrize("mode, estimator, expected", [("reward", None, "k1"), ("loss", None, "k3"),
                                                       ("reward", "k3", "k3"), ("loss", "k2", "k2")])
def test_the_kl_estimator_defaults_by_mode_and_a_set_one_is_kept(base, mode, estimator, expected):
    """Unset, the rewards keep k1 (as before) and the loss gets k3, whose gradient is not 0 in expectation."""
    cfg = validate(base({"train.kl_mode": mode, "train.kl_estimator": estimator}))
    assert kl_estimator(cfg) == expected
