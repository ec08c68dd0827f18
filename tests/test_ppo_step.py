"""The PPO step against the reference recipes: sampling seeds, dynamic sampling, weight versions, the
advantage inputs, scoring forwards without dropout, metrics over ranks, and the learning-rate schedule.

Pure parts run here directly; the rollout parts drive two real embedded engines on Ray; the worker parts
run a real ZeRO-3 rank in a spawned process (DeepSpeed keeps process-wide state)."""

import dataclasses
import json
import os

import pytest
import torch
from zero3_rank import FRESH_UPDATE, PLAIN_UPDATE, activation_faults, actor_rank, in_fresh_process, one_step

from rlhf_sg.config import Config, validate
from rlhf_sg.tiny import save_tiny_model
from rlhf_sg.trainer import (
    PPOTrainer,
    build_rollout_batch,
    check_weight_versions,
    has_signal,
    rollout_seed,
    select_groups,
)

N = 2  # samples per prompt in these tests


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(str(tmp_path_factory.mktemp("ppo_step_model")), arch="qwen2", size="tiny")


#: prompt texts whose samples the test reward scores differently (the others all score 0)
SIGNAL = {"1+1=", "7+2="}
TEXTS = ["3+3=", "1+1=", "4+0=", "5+1=", "7+2=", "2+2="]


def position_reward(prompts, completions, labels):
    """A group with signal for the prompts in SIGNAL (score = the sample's index in its group), else 0."""
    return [float(i % N) if p in SIGNAL else 0.0 for i, p in enumerate(prompts)]


def make_cfg(model_dir, tmp_path, **train) -> Config:
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in TEXTS))
    cfg = Config()
    cfg.model.pretrain = model_dir
    cfg.data.prompt_data = str(data)
    cfg.data.shuffle = False
    cfg.data.max_prompt_len = 16
    cfg.reward.function = "test_ppo_step:position_reward"
    cfg.rollout.prompts_per_step = 2
    cfg.rollout.n_samples_per_prompt = N
    cfg.rollout.max_new_tokens = 8
    cfg.rollout.num_engines = 2
    cfg.train.actor_num_ranks = cfg.train.critic_num_ranks = 1
    cfg.train.advantage_estimator = "grpo"
    cfg.log.output_dir = str(tmp_path / "run")
    for k, v in train.items():
        setattr(cfg.train, k, v)
    return validate(cfg)


# ---- 1. sampling seeds ----------------------------------------------------------------------------------------


def test_rollout_seed_differs_across_engines_steps_and_draws_and_repeats():
    seeds = {(s, d, e): rollout_seed(42, s, d, e) for s in range(3) for d in range(3) for e in range(4)}
    assert len(set(seeds.values())) == len(seeds)  # no two engines, steps or draws share a stream
    assert all(0 <= v < 2**63 for v in seeds.values())
    assert rollout_seed(42, 1, 0, 1) == seeds[(1, 0, 1)]  # a repeated run gets the same seeds
    assert rollout_seed(43, 1, 0, 1) != seeds[(1, 0, 1)]


@pytest.fixture(scope="module")
def engines(ray_cluster, model_dir):
    """Two real embedded engines on the session's Ray, as the trainer starts them."""
    from backends.base import BackendConfig
    from rlhf_sg.engine_actor import start_engine_actors

    config = BackendConfig(model_path=model_dir, dtype="float32", max_model_len=64, seed=42, num_threads=1)
    actors = start_engine_actors("hf", config, 2, num_cpus=1.0, start_timeout_s=300)
    yield actors
    for actor in actors:
        ray_cluster.kill(actor)


def _rollout(cfg, engines):
    """The trainer's rollout room wired to running engines, its prompt stream and the test reward."""
    from rlhf_sg.data import PromptStream, load_prompts, load_tokenizer
    from rlhf_sg.trainer.rollout import RolloutMaker

    tokenizer = load_tokenizer(cfg.model.pretrain)
    prompts, _ = load_prompts(cfg.data.prompt_data, tokenizer, max_prompt_len=cfg.data.max_prompt_len)
    stream = PromptStream(prompts, cfg.rollout.prompts_per_step, cfg.train.seed, shuffle=False)

    def score(prompts, completions, experience):
        n = cfg.rollout.n_samples_per_prompt
        return torch.tensor(position_reward([prompts[i // n].text for i in range(len(completions))], None, None))

    return RolloutMaker(cfg, engines, stream, tokenizer.eos_token_id, tokenizer.eos_token_id, score)


@pytest.mark.slow
def test_engines_sample_the_same_prompt_differently_and_a_rerun_repeats(model_dir, tmp_path, engines):
    """The same prompt at the same position on two engines gets different samples (each engine's call has its
    own seed); the same step generated again gets the same samples; the next draw of the step new ones."""
    from rlhf_sg.data import Prompt

    cfg = make_cfg(model_dir, tmp_path)
    cfg.rollout.n_samples_per_prompt = 4
    cfg.rollout.temperature = 1.5
    rollout = _rollout(cfg, engines)
    prompt = rollout.stream.prompts[0]
    same = [prompt, Prompt(token_ids=list(prompt.token_ids), text=prompt.text)]  # prompt 0 of engine 0 and 1

    def sample(draw=0):
        completions = rollout.generate(same, step=3, draw=draw)
        return [c.token_ids for c in completions[:4]], [c.token_ids for c in completions[4:]]

    on_engine0, on_engine1 = sample()
    assert on_engine0 != on_engine1
    assert sample() == (on_engine0, on_engine1)
    assert sample(draw=1)[0] != on_engine0


# ---- 5. dynamic sampling ----------------------------------------------------------------------------------------


def test_select_groups_takes_groups_with_signal_first_then_fills_up():
    assert select_groups([False, True, False, True, True], 2) == ([1, 3], 0)
    assert select_groups([False, True, False], 2) == ([1, 0], 1)
    assert select_groups([False, False], 2) == ([0, 1], 2)
    assert has_signal(torch.tensor([0.0, 1.0])) and not has_signal(torch.tensor([0.5, 0.5]))


@pytest.mark.slow
@pytest.mark.parametrize("max_draws, draws, filler", [(4, 3, 0), (2, 2, 1)])
def test_dynamic_sampling_draws_prompts_until_the_batch_is_full(model_dir, tmp_path, engines, max_draws, draws,
                                                                  filler):
    """Prompts come in pairs (3+3 1+1) (4+0 5+1) (7+2 2+2); only 1+1 and 7+2 have signal. The batch of two
    groups is full after the third draw; capped at two draws, one group without signal fills it."""
    from rlhf_sg.timing import StepTimer

    cfg = make_cfg(model_dir, tmp_path, dynamic_filtering=True, dynamic_filtering_max_draws=max_draws)
    timer = StepTimer(sync=lambda: None)
    timer.start_step()
    prompts, batch, metrics = _rollout(cfg, engines).make(timer, step=0, weight_version=0)
    expected = ["1+1=", "7+2="] if not filler else ["1+1=", "3+3="]
    assert [p.text for p in prompts] == expected
    assert batch.batch_size == 2 * N
    assert batch.scores.tolist() == [float(i % N) if expected[i // N] in SIGNAL else 0.0 for i in range(2 * N)]
    assert metrics["rollout/sample_draws"] == draws
    assert metrics["rollout/unfiltered_groups"] == filler
    # a filler group runs through the forwards but stays out of the losses and their normaliser
    assert batch.loss_rows.tolist() == [True] * N + [not filler] * N
    assert batch.truncated is not None
    assert metrics["rollout/groups_kept_frac"] == pytest.approx((2 if draws == 3 else 1) / (2 * draws))
    assert timer.end_step()["generate"] > 0


# ---- 9. weight versions -----------------------------------------------------------------------------------------


def test_rollout_batch_carries_each_samples_weight_version_and_a_mismatch_is_refused():
    batch = build_rollout_batch([[5, 6], [7]], [[8], [9, 10]], [[-1.0], [-1.0, -2.0]], 0, weight_versions=[3, 3])
    assert batch.weight_version.tolist() == [3, 3]
    check_weight_versions([3, 3], 3)
    with pytest.raises(RuntimeError, match=r"sampled with weight version\(s\) \[2\], but the trainer's policy is "
                                           r"version 3"):
        check_weight_versions([3, 2], 3)


@pytest.mark.slow
def test_completions_from_other_weights_are_refused_on_policy(model_dir, tmp_path, engines):
    from rlhf_sg.timing import StepTimer

    rollout = _rollout(make_cfg(model_dir, tmp_path), engines)
    timer = StepTimer(sync=lambda: None)
    timer.start_step()
    with pytest.raises(RuntimeError, match="on-policy step"):
        rollout.make(timer, step=1, weight_version=1)  # the engines still hold version 0: they missed a sync


# ---- 2, 7. advantages from the trainer's scores -----------------------------------------------------------------


def _experience(scores, mask, kl=None, values=None):
    """An experience holding only what the advantage path reads (the sequences are placeholders)."""
    from rlhf_sg.experience import Experience

    B, T = mask.shape
    return Experience(sequences=torch.zeros(B, T + 1, dtype=torch.long), attention_mask=torch.ones(B, T + 1),
                      action_mask=mask, rollout_logp=torch.zeros(B, T), scores=torch.tensor(scores), kl=kl,
                      values=values)


@pytest.mark.parametrize("algo", ["grpo", "dr_grpo", "rloo", "reinforce_baseline", "reinforce"])
def test_score_clip_applies_to_every_estimator(model_dir, tmp_path, algo):
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]], dtype=torch.bool)

    def advantages(scores, score_clip):
        trainer = PPOTrainer(make_cfg(model_dir, tmp_path, advantage_estimator=algo, score_clip=score_clip,
                                      kl_coef=0.0))
        experience = _experience(scores, mask)
        trainer.compute_advantages(experience)
        return experience.advantages

    # clipped to 1, the first group is constant: no advantage
    clipped = advantages([5.0, 1.2, -4.0, 0.0], 1.0)
    torch.testing.assert_close(clipped, advantages([1.0, 1.0, -1.0, 0.0], None))
    assert not torch.allclose(clipped, advantages([5.0, 1.2, -4.0, 0.0], None))


def test_trainer_reinforce_baseline_is_the_token_whitened_recipe(model_dir, tmp_path):
    from rlhf_sg.algorithms import reinforce_baseline_advantages

    trainer = PPOTrainer(make_cfg(model_dir, tmp_path, advantage_estimator="reinforce_baseline", kl_coef=0.1))
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    kl = torch.tensor([[0.2, -0.1, 0.4], [0.3, 0.1, 0.0], [0.5, 0.0, 0.0], [-0.2, 0.0, 0.1]])
    scores = [1.0, 0.0, 2.0, -1.0]
    experience = _experience(scores, mask, kl=kl)
    trainer.compute_advantages(experience)
    torch.testing.assert_close(experience.advantages,
                               reinforce_baseline_advantages(torch.tensor(scores), kl, mask, N, 0.1))
    tokens = experience.advantages[mask]
    assert abs(tokens.mean().item()) < 1e-6 and tokens.std(unbiased=False).item() == pytest.approx(1.0, abs=1e-4)


def _reward_to_go(x: torch.Tensor) -> torch.Tensor:
    """sum_{t' >= t} x[:, t'] (gamma = 1), by reversed cumulative sum."""
    return x.flip(1).cumsum(1).flip(1)


def _whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    tokens = x[mask]
    return torch.where(mask, (x - tokens.mean()) / (tokens.var(unbiased=False).sqrt() + 1e-8), 0.0)


@pytest.mark.parametrize("kl_mode", ["reward", "loss"])
@pytest.mark.parametrize("algo", ["gae", "reinforce", "grpo", "dr_grpo", "rloo", "reinforce_baseline"])
def test_trainer_advantages_carry_the_kl_penalty_only_in_reward_mode(model_dir, tmp_path, algo, kl_mode):
    """Each estimator's advantages from the trainer, against the recipe written out with gamma = lam = 1: the
    per-token KL penalty -coef * kl is summed to the end of the response (reward to go) on top of the
    baselined score, then whitened over the batch's tokens where the estimator whitens (gae, reinforce,
    reinforce_baseline); in loss mode the same KL reaches no advantage."""
    coef = 0.3
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    kl = torch.tensor([[0.2, -0.1, 0.4], [0.3, 0.1, 0.0], [0.5, 0.0, 0.0], [-0.2, 0.6, 0.1]])
    values = torch.tensor([[0.1, 0.2, 0.3], [0.0, -0.4, 0.0], [0.5, 0.0, 0.0], [0.2, 0.2, -0.1]]) * mask
    scores = torch.tensor([1.0, 0.0, 2.0, -1.0])
    trainer = PPOTrainer(make_cfg(model_dir, tmp_path, advantage_estimator=algo, kl_coef=coef, kl_mode=kl_mode,
                                  gamma=1.0, lam=1.0))
    experience = _experience(scores.tolist(), mask, kl=kl, values=values if algo == "gae" else None)
    trainer.compute_advantages(experience)

    penalty = -coef * kl * mask if kl_mode == "reward" else torch.zeros_like(kl)
    groups = scores.view(-1, N)
    baselined = {
        "gae": scores, "reinforce": scores,
        "grpo": ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-6)).reshape(-1),
        "dr_grpo": (groups - groups.mean(1, keepdim=True)).reshape(-1),
        "rloo": (groups - groups.flip(1)).reshape(-1),  # two samples: the other one is the baseline
        "reinforce_baseline": (groups - groups.mean(1, keepdim=True)).reshape(-1),
    }[algo]
    last = torch.tensor([2, 1, 0, 2])
    rewards = penalty.clone()
    rewards[torch.arange(4), last] += baselined
    to_go = _reward_to_go(rewards) * mask
    expected = {"gae": _whiten(to_go - values, mask), "reinforce": _whiten(to_go, mask),
                "reinforce_baseline": _whiten(to_go, mask)}.get(algo, to_go)
    torch.testing.assert_close(experience.advantages, expected, rtol=0, atol=1e-5)
    if algo == "gae":
        torch.testing.assert_close(experience.returns, to_go, rtol=0, atol=1e-6)  # the critic's targets


def test_a_registered_estimator_is_selectable_and_gets_the_kl_shaped_rewards(model_dir, tmp_path, request):
    """A user's estimator, registered by name, is accepted by the config, run by the trainer, and shapes its
    sequence scores with the run's KL penalty through ``token_rewards``."""
    from rlhf_sg import advantages
    from rlhf_sg.advantages import advantage_estimators, register_advantage_estimator
    from rlhf_sg.config import ConfigError

    seen = {}
    request.addfinalizer(lambda: advantages._REGISTRY.pop("test_doubled", None))

    @register_advantage_estimator("test_doubled", needs_groups=True)
    def doubled(inputs):
        seen["kl_coef"] = inputs.kl_coef
        return inputs.token_rewards(2 * inputs.scores), None

    with pytest.raises(ValueError, match="already registered"):
        register_advantage_estimator("test_doubled")(doubled)
    assert "test_doubled" in advantage_estimators()
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    kl = torch.tensor([[0.5, 1.0], [2.0, 0.0]])
    trainer = PPOTrainer(make_cfg(model_dir, tmp_path, advantage_estimator="test_doubled", kl_coef=0.1))
    experience = _experience([1.0, 3.0], mask, kl=kl)
    trainer.compute_advantages(experience)
    assert seen["kl_coef"] == pytest.approx(0.1)
    torch.testing.assert_close(experience.advantages, torch.tensor([[-0.05, 2.0 - 0.1], [6.0 - 0.2, 0.0]]))
    with pytest.raises(ConfigError, match="'test_doubled' compares samples of the same prompt|n_samples_per_prompt"):
        cfg = make_cfg(model_dir, tmp_path)
        cfg.train.advantage_estimator = "test_doubled"
        cfg.rollout.n_samples_per_prompt = 1
        validate(cfg)
    with pytest.raises(ConfigError, match="unknown; choose one of .*register your own"):
        make_cfg(model_dir, tmp_path, advantage_estimator="test_not_registered")


# ---- worker-level: a real ZeRO-3 rank in a spawned process -------------------------------------------------------









def _scoring_after_an_update(model_path: str) -> dict:
    import torch.distributed as dist

    from rlhf_sg.packing import response_logprobs

    worker, batch, plan = actor_rank(model_path, disable_dropout=False)
    try:
        worker.train_actor(batch, one_step(plan, batch), FRESH_UPDATE)  # leaves the model as the update used it
        first = worker.forward(batch, plan)[1]
        second = worker.forward(batch, plan)[1]
        width = batch.response_width
        with torch.no_grad():
            worker.module.eval()
            evaluated = response_logprobs(worker.engine, batch.sequences, batch.attention_mask, width)
            worker.module.train()
            dropped = [response_logprobs(worker.engine, batch.sequences, batch.attention_mask, width)
                       for _ in range(2)]
        return {"first": first, "second": second, "eval": evaluated * batch.action_mask,
                "train_mode_differs": not torch.equal(dropped[0], dropped[1])}
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_scoring_forwards_run_without_dropout_after_an_update(tmp_path):
    """On a model with attention dropout, the old log-probs a forward returns after an update are the
    eval-mode (dropout-free) ones: repeatable, and equal to an explicit eval-mode forward; in train mode the
    same forward differs from call to call."""
    from rlhf_sg.tiny import build_tiny_model

    model = build_tiny_model("qwen2", "tiny", seed=0)
    model.config.attention_dropout = 0.5
    path = save_tiny_model(str(tmp_path / "m"), model=model)
    out = in_fresh_process(_scoring_after_an_update, path)
    assert out["train_mode_differs"]  # the dropout is real
    assert torch.equal(out["first"], out["second"])
    torch.testing.assert_close(out["first"], out["eval"], rtol=0, atol=1e-6)


def _first_update_ratio(model_path: str, disable_dropout: bool) -> dict:
    """The first update of a step: old log-probs from the scoring forward (eval mode), then the update (train
    mode); its PPO ratio metrics."""
    import torch.distributed as dist

    worker, batch, plan = actor_rank(model_path, disable_dropout=disable_dropout)
    try:
        batch.old_logp = worker.forward(batch, plan)[1]
        return worker.train_actor(batch, one_step(plan, batch), PLAIN_UPDATE)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_first_update_ratio_is_one_on_a_model_with_dropout(tmp_path):
    """On a model with attention and hidden dropout, the trainer's ranks run without dropout (as TRL's
    ``disable_dropout``): the update's train-mode forward equals the eval-mode scoring forward, so the ratio of
    the first minibatch is exactly 1. With the model's dropout kept, it is not."""
    from rlhf_sg.tiny import build_tiny_model

    model = build_tiny_model("qwen2", "tiny", seed=0)
    model.config.attention_dropout = 0.3
    path = save_tiny_model(str(tmp_path / "m"), model=model)
    without = in_fresh_process(_first_update_ratio, path, True)
    assert without["actor/ratio_mean"] == 1.0 and without["actor/ppo_kl"] == 0.0
    assert without["actor/clip_frac"] == 0.0
    kept = in_fresh_process(_first_update_ratio, path, False)
    assert kept["actor/ratio_mean"] != 1.0 and kept["actor/ppo_kl"] != 0.0


def test_without_dropout_zeroes_every_rate_of_a_config_nested_ones_included():
    from transformers import Qwen2Config

    from rlhf_sg.workers import without_dropout

    config = Qwen2Config(attention_dropout=0.2)
    config.resid_pdrop, config.hidden_dropout, config.layer_norm_eps = 0.1, 0.05, 1e-6
    config.text_config = Qwen2Config(attention_dropout=0.4)
    assert sorted(without_dropout(config)) == ["attention_dropout", "hidden_dropout", "resid_pdrop",
                                               "text_config.attention_dropout"]
    assert config.attention_dropout == config.resid_pdrop == config.hidden_dropout == 0.0
    assert config.text_config.attention_dropout == 0.0 and config.layer_norm_eps == 1e-6


def _lr_run(model_path: str, ckpt: str, resume: bool) -> dict:
    """Four single-step updates under a linear schedule with 2 warmup of 6 steps, checkpointed after the
    second; or, with resume, the checkpoint loaded and the last two updates."""
    import torch.distributed as dist

    worker, batch, plan = actor_rank(model_path, lr_scheduler="linear", lr_warmup_steps=2, lr_total_steps=6)
    try:
        lrs = []
        if resume:
            worker.load_checkpoint(ckpt, "step2")
        for update in range(2 if resume else 4):
            lrs.append(worker.train_actor(batch, one_step(plan, batch), FRESH_UPDATE)["actor/lr"])
            if not resume and update == 1:
                worker.save_checkpoint(ckpt, "step2", {"step": 2})
        return {"lrs": lrs, "logp": worker.forward(batch, plan)[1]}
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_lr_schedule_warms_up_decays_and_resumes_exactly(tmp_path):
    from rlhf_sg.tiny import save_tiny_model as save

    path = save(str(tmp_path / "m"), arch="qwen2", size="tiny")
    ckpt = str(tmp_path / "ckpt")
    full = in_fresh_process(_lr_run, path, ckpt, False)
    # transformers' linear schedule: k / warmup during the warmup, then (total - k) / (total - warmup)
    assert full["lrs"] == pytest.approx([0.0, 0.5e-2, 1e-2, 0.75e-2])
    resumed = in_fresh_process(_lr_run, path, ckpt, True)
    assert resumed["lrs"] == pytest.approx(full["lrs"][2:], abs=1e-12)
    torch.testing.assert_close(resumed["logp"], full["logp"], rtol=0, atol=1e-6)


def _cuda_rng_round_trip(model_path: str, ckpt: str) -> bool:
    import torch.distributed as dist

    os.environ["DS_ACCELERATOR"] = "cuda"
    from rlhf_sg.distributed import free_port
    from rlhf_sg.workers import ModelWorker, WorkerSpec

    spec = WorkerSpec(role="actor", model_path=model_path, world_size=1, master_addr="127.0.0.1",
                      master_port=free_port(), train=True, device="cuda", timeout_s=120)
    worker = ModelWorker(dataclasses.asdict(spec), 0)
    try:
        worker.save_checkpoint(ckpt, "t", {})
        before = torch.rand(4, device="cuda")
        worker.load_checkpoint(ckpt, "t")
        return torch.equal(before, torch.rand(4, device="cuda"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.gpu
def test_checkpoint_restores_the_cuda_rng(tmp_path):
    """On a GPU, a checkpoint keeps the CUDA generator: the draws after loading repeat those after saving."""
    path = save_tiny_model(str(tmp_path / "m"), arch="qwen2", size="tiny")
    assert in_fresh_process(_cuda_rng_round_trip, path, str(tmp_path / "ckpt"))


# ---- 8. metrics over ranks --------------------------------------------------------------------------------------


def _reduce_on_rank(rank: int, port: int, queue) -> None:
    import datetime

    import torch.distributed as dist

    from rlhf_sg.workers import allreduce_weighted_means

    # the store is the parent's, already listening: neither rank waits on the other to open it (a client that comes
    # first would otherwise retry with growing back-off)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        # rank 0: a mean of 1.0 over 3 tokens; rank 1: 5.0 over 1 token (the means times the tokens)
        tokens = torch.tensor(3.0 if rank == 0 else 1.0)
        mean = torch.tensor(1.0 if rank == 0 else 5.0)
        queue.put((rank, allreduce_weighted_means({"clip_frac": mean * tokens}, {"clip_frac": tokens}, 60)))
    finally:
        dist.destroy_process_group()


def test_metrics_are_token_weighted_means_over_every_rank():
    import multiprocessing

    import torch.distributed as dist

    ctx = multiprocessing.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    queue = ctx.Queue()
    procs = [ctx.Process(target=_reduce_on_rank, args=(r, store.port, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    # (1.0 x 3 + 5.0 x 1) / 4 tokens on both ranks, not rank 0's 1.0 nor the unweighted 3.0
    assert results == {0: {"clip_frac": 2.0}, 1: {"clip_frac": 2.0}}


# ---- minibatches of the PPO epochs ---------------------------------------------------------------------------------


def grouped_experience(groups: int = 4, n: int = 4, P: int = 3, T: int = 4):
    """``groups`` prompts x ``n`` samples, a group's rows interleaved with the others' (row b has prompt b % groups),
    prompts and responses of several lengths."""
    from rlhf_sg.experience import Experience

    B = groups * n
    seq = torch.zeros(B, P + T, dtype=torch.long)
    mask = torch.zeros(B, P + T, dtype=torch.long)
    for b in range(B):
        g, plen, rlen = b % groups, 1 + (b % groups) % P, 1 + (b // groups + b) % T
        seq[b, P - plen:P], mask[b, P - plen:P] = 10 + g, 1
        seq[b, P:P + rlen], mask[b, P:P + rlen] = 30 + b % 7, 1
    return Experience(sequences=seq, attention_mask=mask, action_mask=mask[:, P:].bool(),
                      rollout_logp=torch.zeros(B, T))


def minibatches(steps_per_rank):
    """Per optimizer step: the rows of all ranks' micro-batches, and each rank's normaliser."""
    out = []
    for k in range(len(steps_per_rank[0])):
        rows = [r for steps in steps_per_rank for micro in steps[k].plan for r in micro]
        assert len(rows) == len(set(rows)), f"optimizer step {k} plans a row twice: {rows}"
        out.append((sorted(rows), {steps[k].normalizer for steps in steps_per_rank}))
    return out


@pytest.mark.parametrize("share_prompts", [False, True])
@pytest.mark.parametrize("world,num_minibatches,normalize_rows", [(1, 1, False), (1, 2, False), (2, 2, True),
                                                                   (2, 4, False), (1, 4, True)])
def test_every_epoch_trains_every_row_once_and_each_step_is_normalised_by_its_own_tokens(
        share_prompts, world, num_minibatches, normalize_rows):
    import random

    from rlhf_sg.trainer.ppo import update_plans

    exp, t = grouped_experience(), Config().train
    t.ppo_epochs, t.num_minibatches, t.max_tokens_per_microbatch = 3, num_minibatches, 12
    steps = update_plans(exp, world, t, random.Random(0), normalize_rows=normalize_rows, share_prompts=share_prompts)
    assert [len(s) for s in steps] == [3 * num_minibatches] * world
    mbs = minibatches(steps)
    for epoch in range(3):
        epoch_rows = [r for rows, _ in mbs[epoch * num_minibatches:(epoch + 1) * num_minibatches] for r in rows]
        assert sorted(epoch_rows) == list(range(16))
    for rows, norms in mbs:
        assert len(rows) == 16 // num_minibatches
        tokens = len(rows) if normalize_rows else int(exp.action_mask[rows].sum())
        assert norms == {tokens / world}


def test_with_shared_prompts_a_minibatch_holds_whole_prompt_groups_in_a_shuffled_pairing():
    """As verl's actor update splits the batch into minibatches of whole prompts (ppo_mini_batch_size counts
    prompts, each with its n samples), so every prompt is computed once in its minibatch; the pairing of groups
    still changes from epoch to epoch. Without shared prompts the rows are shuffled one by one (OpenRLHF's
    replay-buffer shuffle), which splits groups."""
    import random

    from rlhf_sg.trainer.ppo import update_plans

    exp, t = grouped_experience(), Config().train
    t.ppo_epochs, t.num_minibatches = 8, 2
    groups = [frozenset(range(g, 16, 4)) for g in range(4)]
    pairings, split = set(), False
    for share in (True, False):
        steps = update_plans(exp, 1, t, random.Random(1), share_prompts=share)
        for rows, _ in minibatches(steps):
            whole = [g for g in groups if g <= set(rows)]
            if share:
                assert set().union(*whole) == set(rows), f"minibatch {rows} splits a prompt group"
                pairings.add(frozenset(whole))
            else:
                split |= len(whole) < 2
    assert len(pairings) > 2, "the groups were not shuffled between epochs"
    assert split, "rows shuffled one by one kept every group whole: the test's batch shows nothing"


def test_without_shared_prompts_the_minibatches_are_the_row_shuffle():
    """Single rows drawn as before: minibatch k of an epoch is slice k of ``rng.shuffle(range(B))``, so seeded
    runs repeat what they did; one minibatch draws the same numbers with and without shared prompts."""
    import random

    from rlhf_sg.trainer.ppo import update_plans

    exp, t = grouped_experience(), Config().train
    t.ppo_epochs, t.num_minibatches = 2, 4
    rng, expected = random.Random(5), []
    for _ in range(2):
        order = list(range(16))
        rng.shuffle(order)
        expected += [sorted(order[k * 4:(k + 1) * 4]) for k in range(4)]
    assert [rows for rows, _ in minibatches(update_plans(exp, 1, t, random.Random(5)))] == expected
    t.num_minibatches = 1
    a, b = random.Random(5), random.Random(5)
    update_plans(exp, 1, t, a, share_prompts=False)
    update_plans(exp, 1, t, b, share_prompts=True)
    assert a.getstate() == b.getstate()


def _update_with_loss_rows(model_path: str, loss_rows: list[bool]) -> dict:
    """One ZeRO-3 update with ``loss_rows`` set; its metrics and the log-probs before and after."""
    import torch.distributed as dist

    worker, batch, plan = actor_rank(model_path)
    try:
        batch.old_logp = worker.forward(batch, plan)[1]
        batch.loss_rows = torch.tensor(loss_rows)
        metrics = worker.train_actor(batch, one_step(plan, batch), PLAIN_UPDATE)
        return {"metrics": metrics, "before": batch.old_logp, "after": worker.forward(batch, plan)[1]}
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_the_actor_logs_its_gradient_norm_and_rows_out_of_the_loss_move_nothing(model_dir):
    """``actor/grad_norm`` is DeepSpeed's global norm before clipping: positive after a real update, 0 when no
    row counts in the loss (``Experience.loss_rows`` all False: truncated samples or filler groups), in which case
    the weights stay as they were although every rank ran its forward and backward."""
    trained = in_fresh_process(_update_with_loss_rows, model_dir, [True, False, True, True])
    assert trained["metrics"]["actor/grad_norm"] > 0
    assert not torch.equal(trained["before"], trained["after"])
    frozen = in_fresh_process(_update_with_loss_rows, model_dir, [False, False, False, False])
    assert frozen["metrics"]["actor/grad_norm"] == 0.0
    torch.testing.assert_close(frozen["before"], frozen["after"], rtol=0, atol=0)


def _one_rank_updates(model_path: str, allreduce: bool) -> dict:
    """Two updates of an unpartitioned single-rank actor (ZeRO stage 0); ``allreduce``: with DeepSpeed's
    all-reduce of the gradients after each backward turned back on. How often the engine ran it, its optimizer's
    settings, and the weights after."""
    import torch.distributed as dist

    worker, batch, plan = actor_rank(model_path, zero_stage=0)
    try:
        engine, calls = worker.engine, []
        skipped = not engine.enable_backward_allreduce
        engine.enable_backward_allreduce = allreduce or engine.enable_backward_allreduce
        reduce = engine.allreduce_gradients
        engine.allreduce_gradients = lambda *a, **k: (calls.append(1), reduce(*a, **k))[1]
        for _ in range(2):
            worker.train_actor(batch, one_step(plan, batch), FRESH_UPDATE)
        return {"skipped": skipped, "calls": len(calls), "fused": engine.optimizer.defaults.get("fused"),
                "weights": [p.detach().clone() for p in worker.module.parameters()], "faults": activation_faults()}
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_single_rank_skips_the_gradient_all_reduce_and_steps_with_fused_adamw(model_dir):
    """A group of one unpartitioned rank has nothing to average: its engine runs no all-reduce after a backward
    (DeepSpeed's flatten, reduce and copy back of every gradient), and its weights after two updates are those of
    the same rank with the all-reduce on, bit for bit. Its CPU optimizer is torch's fused AdamW, and the rank keeps
    the memory it frees (rlhf_sg.kernels.host_memory): a step's activations are not faulted in again."""
    lean = in_fresh_process(_one_rank_updates, model_dir, False)
    reduced = in_fresh_process(_one_rank_updates, model_dir, True)
    assert lean["skipped"] and lean["calls"] == 0
    assert reduced["calls"] == 2
    assert lean["fused"] is True
    faults, pages = lean["faults"]
    assert faults < 0.01 * pages
    for mine, theirs in zip(lean["weights"], reduced["weights"], strict=True):
        assert torch.equal(mine, theirs)


def _a_rank_sharing_prompts(model_path: str, share_prompts: bool) -> dict:
    import torch.distributed as dist

    from rlhf_sg.packing import counting_block_layers
    from rlhf_sg.trainer import build_rollout_batch

    worker, _, _ = actor_rank(model_path, zero_stage=3, share_prompts=share_prompts)
    try:
        gen = torch.Generator().manual_seed(0)
        prompts = [[5, 6, 7]] * 3 + [[9, 10]] * 2  # two groups: their prompts computed once each
        responses = [torch.randint(3, 90, (n,), generator=gen).tolist() for n in (4, 6, 2, 5, 3)]
        batch = build_rollout_batch(prompts, responses, [[0.0] * len(r) for r in responses], pad_id=0)
        batch.advantages = torch.randn(batch.rollout_logp.shape, generator=gen) * batch.action_mask
        update = dataclasses.replace(FRESH_UPDATE, share_prompts=share_prompts)
        with counting_block_layers() as counted:
            stats = worker.train_actor(batch, one_step([list(range(5))], batch), update)
        return {"attention": worker.module.config._attn_implementation, "probe": worker.packing_probe,
                "block_layers": counted[0], "layers": worker.module.config.num_hidden_layers,
                "loss_finite": all(torch.isfinite(torch.tensor(v)).all() for v in stats.values()
                                   if isinstance(v, float))}
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "gemma-3"])
def test_a_rank_sharing_prompts_computes_them_block_by_block_as_its_probe_checked(family, tmp_path):
    """A ZeRO-3 actor rank that shares prompts runs its model on the shared-prompt attention; its start-up probe
    measured that layout against each row alone, and an update's forward takes the blocks in every layer. Gemma-3's
    sliding layer cannot take them: the rank switches it back to sdpa (the tree mask's segments, not the blocks')."""
    from rlhf_sg.packing import SHARED_PROMPT_ATTENTION
    from rlhf_sg.tiny import tiny_family_model

    path = save_tiny_model(str(tmp_path / family), model=tiny_family_model(family))
    got = in_fresh_process(_a_rank_sharing_prompts, path, True)
    assert got["probe"]["shared"] <= 1e-5 and got["loss_finite"]
    if family == "gemma-3":
        assert got["attention"] == "sdpa" and got["block_layers"] == 0
    else:
        assert got["attention"] == SHARED_PROMPT_ATTENTION and got["block_layers"] == got["layers"]
