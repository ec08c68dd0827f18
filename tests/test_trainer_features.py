"""Trainer options end to end (real Ray, DeepSpeed ZeRO-3, a tiny model), two short runs that between them
switch on what the reward-rise tests leave off: a remote HTTP reward, KL as a loss term, truncated
importance sampling, a linear learning-rate decay, the torch profiler, TensorBoard and the HF export (GRPO);
a reward model, a chat template and a critic initialised from the reward model (PPO)."""

import glob
import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
import torch

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS)

from test_trainer_e2e import arith_task, make_cfg  # noqa: E402,F401  (fixtures)

pytestmark = pytest.mark.slow


class _RewardHandler(BaseHTTPRequestHandler):
    calls = 0

    def do_POST(self):  # noqa: N802  (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        rewards = arith_task.addition_reward(body["prompts"], body["completions"], body["labels"])
        type(self).calls += 1
        payload = json.dumps({"rewards": rewards}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def reward_server():
    server = HTTPServer(("127.0.0.1", 0), _RewardHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/score"
    server.shutdown()


def test_grpo_with_remote_reward_kl_loss_tis_profiler_tensorboard_and_export(ray_cluster, task, tmp_path,  # noqa: F811
                                                                            reward_server):
    from transformers import AutoModelForCausalLM

    from rlhf_sg.bench.train_profile import read_phase
    from rlhf_sg.trainer import PPOTrainer

    out = tmp_path / "run"
    cfg = make_cfg(task, str(out), steps=2, algo="grpo", reward__kind="remote", reward__url=reward_server,
                   reward__function=None, train__kl_mode="loss", train__kl_coef=0.05, train__tis_cap=2.0,
                   train__tis_low=0.5, train__tis_mode="mask", train__kl_straight_through=True,
                   train__loss_aggregation="seq_mean_token_sum_norm", reward__overlong_buffer_len=2,
                   train__lr_scheduler="linear", log__profile_step=0, log__tensorboard=True, log__export_hf=True)
    _RewardHandler.calls = 0
    trainer = PPOTrainer(cfg)
    try:
        trainer.setup()
        history = trainer.fit()
        synced = trainer.engines[0].get_weights_by_name.remote("model.layers.0.mlp.up_proj.weight")
        import ray

        engine_weight = ray.get(synced, timeout=120)
    finally:
        trainer.shutdown()
    assert _RewardHandler.calls == 2  # one scoring request per step
    assert all("actor/kl_loss" in h for h in history)  # the KL went into the loss, not the reward
    # the step options reach the run: the truncation rate, the actor's gradient norm, the TIS mask
    assert all(0 <= h["rollout/truncated_frac"] <= 1 and h["actor/grad_norm"] > 0 for h in history)
    assert all("actor/tis_masked_frac" in h for h in history)
    # one optimizer step a step, decaying linearly to 0 after the run's two steps
    assert [h["actor/lr"] for h in history] == pytest.approx([cfg.train.actor_lr, cfg.train.actor_lr / 2])
    # one update per batch and no KL in the rewards: no separate old-log-prob pass, the update measured
    # the KL and the engine-trainer gap itself
    assert all(h["time/actor_logprob"] == 0 and h["kl"] == h["actor/kl_loss"] for h in history)
    assert all(0 <= h["rollout/logp_gap_engine_vs_trainer"] < 0.05 for h in history)
    for rank in (0, 1):  # each actor rank's trace of step 0, written as it ended
        with open(out / "profile" / f"step1.rank{rank}.json") as f:
            assert json.load(f)["traceEvents"]
        # its update in the span `bench train-profile` reads, the matmuls with their shapes
        phase = read_phase(str(out / "profile" / f"step1.rank{rank}.json"))
        assert phase.matmul_flops > 0 and phase.seconds["matmuls"] > 0 and phase.seconds["optimizer"] > 0
    assert glob.glob(str(out / "tensorboard" / "events.out.tfevents.*"))
    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in records] == [1, 2]
    # the exported policy is the trained one: what the engine generated with after the last sync
    exported = AutoModelForCausalLM.from_pretrained(out / "final_hf", dtype=torch.float32)
    torch.testing.assert_close(exported.model.layers[0].mlp.up_proj.weight.detach(), engine_weight, rtol=0, atol=0)
    initial = AutoModelForCausalLM.from_pretrained(task[0], dtype=torch.float32)
    assert not torch.equal(initial.model.layers[0].mlp.up_proj.weight, engine_weight)


def test_ppo_with_reward_model_chat_template_and_critic_from_it(ray_cluster, task, tmp_path):  # noqa: F811
    from transformers import AutoModelForCausalLM

    from rlhf_sg.models import ValueHeadModel
    from rlhf_sg.tiny import load_tokenizer
    from rlhf_sg.trainer import PPOTrainer

    policy, _ = task
    tokenizer = load_tokenizer(policy)
    templated = tmp_path / "policy_chat"
    tokenizer.chat_template = (
        "{% for m in messages %}Q:{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
    )
    AutoModelForCausalLM.from_pretrained(policy).save_pretrained(templated)
    tokenizer.save_pretrained(templated)
    rm_dir = tmp_path / "reward_model"
    torch.manual_seed(0)
    ValueHeadModel.from_pretrained(policy).save_pretrained(str(rm_dir))
    tokenizer.save_pretrained(rm_dir)

    cfg = make_cfg((str(templated), task[1]), str(tmp_path / "run"), steps=2, algo="gae", reward__kind="model",
                   reward__function=None, model__reward_pretrain=str(rm_dir), data__apply_chat_template=True,
                   data__max_prompt_len=24, train__critic_warmup_steps=0, train__advantage_norm="center")
    seen = {}

    class Recording(PPOTrainer):
        def on_experience(self, experience):
            seen.setdefault("scores", []).append(experience.scores.clone())
            seen.setdefault("prompts", []).append([p.text for p in self.prompts])

    trainer = Recording(cfg)
    try:
        trainer.setup()
        history = trainer.fit()
    finally:
        trainer.shutdown()
    assert len(history) == 2 and all("critic/loss" in h and "actor/clip_frac" in h for h in history)
    assert all(h["critic/grad_norm"] > 0 and h["actor/grad_norm"] > 0 for h in history)
    assert all(text.startswith("Q:") and text.endswith("=A:") for text in seen["prompts"][0])
    scores = torch.cat(seen["scores"])
    # a reward model's scores: real numbers that differ between completions, not the rule's 0 / 0.1 / 1
    assert torch.isfinite(scores).all() and scores.std() > 0
    assert not set(scores.tolist()) <= {0.0, 0.1, 1.0}
