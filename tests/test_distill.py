"""On-policy distillation (``--distill.*``). Without Ray: the per-token advantage on hand cases (alone, beside the KL
penalty, added to a GRPO advantage with a weight) through the pure function and the trainer's
``compute_advantages``; the teacher's tokenizer check against tiny models saved with another vocabulary, other
special tokens or another padded vocab size; the config's rules and the layout a teacher adds. One slow run through
the trainer: the teacher group's log-probs are the teacher's own and pull the policy toward it.

The batch of ``tests/test_advantages_spec.py``: two samples of one prompt, three columns, action tokens at columns
0-1 (row 0) and 1-2 (row 1); 9.0 (a value never to be read) on the masked columns."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rlhf_sg import algorithms as algo
from rlhf_sg.config import Config, ConfigError, devices_needed, uses_critic_model, validate
from rlhf_sg.experience import Experience
from rlhf_sg.tiny import build_tiny_model, build_tokenizer, save_tiny_model

MASK = torch.tensor([[1, 1, 0], [0, 1, 1]], dtype=torch.bool)
TEACHER = torch.tensor([[-0.5, -1.0, 9.0], [9.0, -2.0, -0.25]])
OLD = torch.tensor([[-1.0, -0.5, 9.0], [9.0, -0.5, -1.0]])
# teacher - old on the action tokens: row 0: 0.5, -0.5; row 1: -1.5, 0.75
KL = torch.tensor([[0.5, 1.0, 9.0], [9.0, 2.0, 0.5]])
SCORES = torch.tensor([3.0, 1.0])
#: GRPO's baselined scores of SCORES: (s - 2) / (unbiased std sqrt(2) + 1e-6)
B0 = 1 / (math.sqrt(2) + 1e-6)


def at_actions(rows):
    """[[row 0's two action values], [row 1's two]] -> the [2, 3] tensor, 0 on masked columns."""
    return torch.tensor([[rows[0][0], rows[0][1], 0.0], [0.0, rows[1][0], rows[1][1]]])


# ---- the advantage -------------------------------------------------------------------------------------------


def test_each_token_gets_its_own_teacher_log_ratio_times_the_coefficient():
    # discount 0: no token sees the tokens after it (a reward-to-go would give row 0: 0.0, -1.0)
    torch.testing.assert_close(algo.distill_advantages(TEACHER, OLD, MASK, coef=2.0),
                               at_actions([[1.0, -1.0], [-3.0, 1.5]]))
    torch.testing.assert_close(algo.distill_advantages(TEACHER, OLD, MASK), at_actions([[0.5, -0.5], [-1.5, 0.75]]))


def test_the_teacher_term_is_added_to_a_base_advantage_and_masked_columns_stay_zero():
    base = torch.tensor([[10.0, 20.0, float("nan")], [float("inf"), 30.0, 40.0]])
    torch.testing.assert_close(algo.distill_advantages(TEACHER, OLD, MASK, coef=0.5, base=base),
                               at_actions([[10.25, 19.75], [29.25, 40.375]]))


def test_shapes_must_match():
    with pytest.raises(ValueError, match=r"distill_advantages: logp has shape \(2, 2\) but teacher_logp has shape"):
        algo.distill_advantages(TEACHER, OLD[:, :2], MASK)


# ---- through the trainer: alone, or added to GRPO's advantage ----------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The policy and a teacher of the same family and tokenizer (another seed)."""
    root = tmp_path_factory.mktemp("distill_models")
    return save_tiny_model(str(root / "policy"), seed=0), save_tiny_model(str(root / "teacher"), seed=1)


@pytest.fixture
def make(models, tmp_path):
    policy, teacher = models
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1="}\n')

    def make_cfg(**overrides) -> Config:
        cfg = Config()
        cfg.model.pretrain, cfg.data.prompt_data, cfg.reward.function = policy, str(prompts), "m:f"
        cfg.distill.teacher = teacher
        cfg.rollout.n_samples_per_prompt = 2
        cfg.train.advantage_estimator = "grpo"
        cfg.log.output_dir = str(tmp_path / "run")
        for dotted, value in overrides.items():
            section, key = dotted.split("__")
            setattr(getattr(cfg, section), key, value)
        return cfg

    return make_cfg


def experience(scores=SCORES, kl=None):
    return Experience(sequences=torch.zeros(2, 4, dtype=torch.long), attention_mask=torch.ones(2, 4, dtype=torch.long),
                      action_mask=MASK, rollout_logp=torch.zeros(2, 3), scores=scores, old_logp=OLD,
                      teacher_logp=TEACHER, kl=kl)


def advantages_of(cfg, exp):
    from rlhf_sg.trainer import PPOTrainer

    trainer = PPOTrainer(validate(cfg))
    # with a teacher the old log-probs are computed before the advantages
    assert trainer.recomputes_old_logp == (cfg.distill.teacher is not None)
    trainer.compute_advantages(exp)
    return exp


def test_the_trainer_adds_the_weighted_teacher_term_to_grpos_advantage(make):
    exp = advantages_of(make(train__kl_coef=0.0, distill__coef=0.5), experience())
    # GRPO: every token of row 0 gets B0, of row 1 -B0; plus 0.5 x (teacher - old)
    torch.testing.assert_close(exp.advantages, at_actions([[B0 + 0.25, B0 - 0.25], [-B0 - 0.75, -B0 + 0.375]]))


def test_distill_only_is_the_teacher_term_and_the_kl_penalty_per_token_whatever_the_scores(make):
    cfg = make(distill__only=True, distill__coef=2.0, train__kl_coef=0.1, train__kl_mode="reward")
    exp = advantages_of(cfg, experience(kl=KL))
    # 2 x (teacher - old) - 0.1 x kl on each token, neither summed over later tokens
    torch.testing.assert_close(exp.advantages, at_actions([[1.0 - 0.05, -1.0 - 0.1], [-3.0 - 0.2, 1.5 - 0.05]]))
    assert exp.returns is None
    other = advantages_of(cfg, experience(scores=torch.tensor([-7.0, 5.0]), kl=KL))
    torch.testing.assert_close(other.advantages, exp.advantages)  # the reward is not trained on


def test_without_a_teacher_the_advantages_are_the_estimators(make):
    exp = experience()
    exp.teacher_logp = None
    exp = advantages_of(make(train__kl_coef=0.0, distill__teacher=None), exp)
    torch.testing.assert_close(exp.advantages, at_actions([[B0, B0], [-B0, -B0]]))


# ---- the teacher's tokenizer, checked before Ray ---------------------------------------------------------------


def save_with(path, tokenizer=None, **config_kw):
    """A tiny model saved with ``tokenizer`` (default: the character tokenizer) and config overrides."""
    model = build_tiny_model(seed=2, **config_kw)
    model.save_pretrained(str(path), safe_serialization=True)
    (tokenizer or build_tokenizer()).save_pretrained(str(path))
    return str(path)


def test_a_teacher_with_the_policys_tokenizer_is_accepted(make):
    validate(make())


def test_a_teacher_with_another_vocabulary_is_refused_naming_what_differs(make, tmp_path):
    tok = build_tokenizer()
    tok.add_tokens(["<think>"])
    teacher = save_with(tmp_path / "t", tok)
    with pytest.raises(ConfigError) as info:
        validate(make(distill__teacher=teacher))
    text = str(info.value)
    assert text.startswith(f"--distill.teacher: {teacher!r} does not share the tokenizer of --model.pretrain ")
    assert (": vocabulary: 101 tokens in the policy's, 102 in the teacher's, 1 (token, id) pairs in one only (first: "
            "'<think>' -> 101 in the teacher's only). The teacher scores") in text
    assert text.endswith("choose a teacher saved with the policy's tokenizer and vocab_size")


def test_a_teacher_with_another_eos_is_refused(make, tmp_path):
    tok = build_tokenizer()
    tok.eos_token = "<bos>"
    teacher = save_with(tmp_path / "t", tok)
    with pytest.raises(ConfigError, match=r"eos_token_id: 2 in the policy's, 1 in the teacher's") as info:
        validate(make(distill__teacher=teacher))
    assert "vocabulary:" not in str(info.value) and "padded vocab size (" not in str(info.value)


def test_a_teacher_with_another_padded_vocab_size_is_refused(make, tmp_path):
    teacher = save_with(tmp_path / "t", vocab_size=128)  # the same tokenizer, 128 embedding rows instead of 101
    with pytest.raises(ConfigError) as info:
        validate(make(distill__teacher=teacher))
    assert (f"{make().model.pretrain!r}: padded vocab size (config.json vocab_size, the embedding's rows): 101 in "
            "the policy's, 128 in the teacher's. The teacher scores") in str(info.value)  # the only difference


def test_a_teacher_without_a_tokenizer_is_named(make, tmp_path):
    teacher = tmp_path / "t"
    build_tiny_model().save_pretrained(str(teacher), safe_serialization=True)
    with pytest.raises(ConfigError, match=r"^--distill.teacher: .* has no tokenizer"):
        validate(make(distill__teacher=str(teacher)))


# ---- the config's rules ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, message", [
    ({"distill__teacher": None, "distill__only": True},
     "--distill.only: there is no teacher to distill from; set --distill.teacher or drop the flag"),
    ({"distill__num_ranks": 0}, "--distill.num_ranks must be >= 1, got 0"),
    ({"distill__num_ranks": 9, "rollout__prompts_per_step": 4},
     "--distill.num_ranks 9: a step has 8 samples (prompts_per_step x n_samples_per_prompt), fewer than the ranks "
     "that must each score one; lower it or raise --rollout.prompts_per_step"),
    ({"distill__coef": 0.0},
     "--distill.coef must be > 0 (the weight of the teacher's term in the advantages), got 0.0"),
    ({"distill__coef": float("nan")},
     "--distill.coef must be > 0 (the weight of the teacher's term in the advantages), got nan"),
    ({"train__policy_loss": "gmpo"},
     "--train.policy_loss gmpo weighs each sequence by one advantage, but --distill.teacher gives every token its "
     "own (log pi_teacher - log pi_old); use another policy loss (ppo, gspo, cispo, sapo)"),
    ({"distill__only": True, "train__dynamic_filtering": True},
     "--train.dynamic_filtering drops groups by their scores, which --distill.only does not train on; drop one of "
     "the flags"),
    ({"train__recompute_old_logp": False, "train__kl_coef": 0.0},
     "--train.recompute_old_logp false: --distill.teacher's advantages need the old log-probs before the update "
     "(log pi_teacher - log pi_old); drop the flag"),
    ({"train__colocate_all": True, "rollout__num_engines": 2, "train__ref_num_ranks": 2},
     "--train.colocate_all puts rank i of every group and engine i on device i: set --distill.num_ranks to "
     "--train.actor_num_ranks (2), got 1"),
    ({"train__colocate_actor_ref": True, "train__ref_num_ranks": 2},
     "--train.colocate_actor_ref puts teacher rank i beside actor rank i, as the reference: set --distill.num_ranks "
     "to --train.actor_num_ranks (2), got 1"),
    ({"distill__only": True, "reward__function": None, "eval__prompt_data": "PROMPTS"},
     "--eval.prompt_data: evaluation scores with a reward function and this run has none (--distill.only); set "
     "--eval.reward_function"),
    ({"reward__function": None}, "--reward.function is required with --reward.kind function (module:function)"),
])
def test_each_rule_refuses_its_input(make, overrides, message):
    cfg = make(**overrides)
    if cfg.eval.prompt_data == "PROMPTS":
        cfg.eval.prompt_data = cfg.data.prompt_data
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    assert str(info.value) == message


def test_a_teacher_path_that_is_no_model_is_named(make, tmp_path):
    with pytest.raises(ConfigError, match=r"^--distill.teacher: .* is not a model directory \(no config.json there\)"):
        validate(make(distill__teacher=str(tmp_path)))


def test_distill_only_needs_no_reward_function_no_groups_and_starts_no_critic(make):
    cfg = validate(make(distill__only=True, reward__function=None, train__advantage_estimator="gae",
                        rollout__n_samples_per_prompt=1, train__kl_coef=0.0))
    assert not uses_critic_model(cfg)
    assert uses_critic_model(make(train__advantage_estimator="gae"))  # with a reward's advantage, GAE's critic


def test_the_flags_and_yaml_section_fill_the_config(make, tmp_path):
    from rlhf_sg.config import parse_args

    base = make()
    run = tmp_path / "run.yaml"
    run.write_text(f"model:\n  pretrain: {base.model.pretrain}\ndata:\n  prompt_data: {base.data.prompt_data}\n"
                   f"reward:\n  function: m:f\ndistill:\n  teacher: {base.distill.teacher}\n  coef: 0.5\n")
    cfg = parse_args(["--config", str(run), "--distill.only", "true", "--distill.num_ranks", "2"])
    assert (cfg.distill.teacher, cfg.distill.coef, cfg.distill.only, cfg.distill.num_ranks) == (
        base.distill.teacher, 0.5, True, 2)
    assert json.loads(json.dumps(cfg.to_dict()))["distill"]["teacher"] == base.distill.teacher


def test_the_recipes_runs_differ_only_in_the_teacher(models, tmp_path):
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes"))
    from distill_cpu import run_config

    policy, teacher = models
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    (tmp_path / "held_out.jsonl").write_text('{"prompt": "2+2=", "answer": "4"}\n')
    grpo = validate(run_config(policy, str(prompts), str(tmp_path / "grpo"), 3, 16))
    distill = validate(run_config(policy, str(prompts), str(tmp_path / "distill"), 3, 16, teacher))
    assert (distill.distill.teacher, distill.distill.only, grpo.distill.teacher) == (teacher, True, None)
    assert (grpo.eval.interval, grpo.eval.n_samples) == (1, 16)  # held-out pass@1 after every step
    distill.distill, distill.log = grpo.distill, grpo.log
    assert distill == grpo


# ---- the layout a teacher adds ------------------------------------------------------------------------------------


def test_the_teacher_group_is_placed_like_the_reference(make):
    from rlhf_sg.trainer.layout import Layout

    layout = Layout(validate(make(distill__num_ranks=2, train__kl_coef=0.0)))
    assert layout.group_sizes() == {"actor": 2, "engines": 1, "teacher": 2}
    spec = layout.worker_spec("teacher")
    assert (spec.role, spec.model_path, spec.world_size, spec.train, spec.zero_stage, spec.lora) == (
        "teacher", make().distill.teacher, 2, False, 3, None)
    assert Layout(make()).worker_spec("teacher").zero_stage == 0  # one rank: unpartitioned, as the reference
    colocated = Layout(validate(make(distill__num_ranks=2, train__colocate_actor_ref=True, train__ref_num_ranks=2)))
    assert colocated.colocation() == [["actor", "ref", "teacher"]]
    everything = make(distill__num_ranks=2, train__colocate_all=True, train__ref_num_ranks=2, rollout__num_engines=2)
    assert Layout(validate(everything)).colocation() == [["actor", "ref", "teacher", "engines"]]
    assert devices_needed(make(train__kl_coef=0.0)) == (4, "2 actor, 1 engines x tensor_parallel_size 1, 1 teacher")
    assert devices_needed(everything) == (2, "2 shared by actor+engines+ref+teacher")


# ---- end to end: the teacher's log-probs reach the advantages and pull the policy ----------------------------------


@pytest.mark.slow
def test_a_run_distills_toward_the_teacher_through_its_own_log_probs(ray_cluster, task, tmp_path):
    """Three ``--distill.only`` steps on the quickstart's task with a teacher that answers 7 to every problem, the
    teacher a group of 2 ranks splitting its rows (one SP group of 2): the teacher log-probs of each step's samples
    are the teacher model's own forward on them (one rank, each row alone), the advantages are the
    teacher's log-ratio, and the trained policy gives the teacher's answer a higher log-prob on every problem (the
    logged reverse KL, estimated on each step's 32 samples, moves by less than its noise in three steps)."""
    import arith_task
    from test_trainer_e2e import make_cfg
    from transformers import AutoModelForCausalLM

    from rlhf_sg.trainer import PPOTrainer, train

    seven = build_tiny_model(size="tiny", seed=3)
    arith_task.warm_start(seven, build_tokenizer(), 20, lr=1e-2, batch_size=32,
                          data=[(p, "7") for p, _ in arith_task.problems()])
    teacher = save_tiny_model(str(tmp_path / "teacher"), model=seven)
    seen: list[Experience] = []

    class Keep(PPOTrainer):
        def on_experience(self, experience):
            seen.append(experience)

    cfg = make_cfg(task, str(tmp_path / "run"), steps=3, algo="grpo", distill__teacher=teacher, distill__only=True,
                   train__kl_coef=0.0, train__actor_lr=1e-3, rollout__prompts_per_step=4, eval__prompt_data=None,
                   perf__accounting=False, train__actor_num_ranks=1, log__export_hf=True, distill__num_ranks=2,
                   train__teacher_sequence_parallel_size=2)
    history = train(cfg, Keep)
    assert all(h["time/teacher"] > 0 and h["distill/reverse_kl"] > 0 for h in history)

    def says_seven(path):
        """The model's mean log-prob of answering 7 first, over every problem of the task."""
        model, tok = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), build_tokenizer()
        prompts = [tok(p, add_special_tokens=False)["input_ids"] for p, _ in arith_task.problems()]
        with torch.no_grad():
            return sum(torch.log_softmax(model(torch.tensor([ids])).logits[0, -1], -1)[tok.convert_tokens_to_ids("7")]
                       .item() for ids in prompts) / len(prompts)

    # the policy now says what the teacher says (the reward's answers fall out of favour), measured on every problem
    assert says_seven(str(tmp_path / "run" / "final_hf")) > says_seven(task[0]) + 1.0

    model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval()
    for exp in (seen[0], seen[-1]):
        mask = exp.action_mask
        torch.testing.assert_close(exp.advantages, torch.where(mask, exp.teacher_logp - exp.old_logp, 0.0))
        P = exp.sequences.shape[1] - exp.response_width
        for b in (0, exp.batch_size - 1):
            ids = exp.sequences[b][exp.attention_mask[b].bool()]
            prompt, n = int(exp.attention_mask[b, :P].sum()), int(mask[b].sum())
            with torch.no_grad():
                logp = torch.log_softmax(model(ids[None]).logits[0].float(), dim=-1)
            own = logp[prompt - 1 : prompt - 1 + n].gather(1, ids[prompt : prompt + n, None])[:, 0]
            torch.testing.assert_close(exp.teacher_logp[b, :n], own, rtol=0, atol=1e-4)
