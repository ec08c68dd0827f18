"""Held-out evaluation during training (``--eval.*``): its schedule across a resume, and its isolation from
training (a run with evaluation on trains exactly as the run without it), through the real trainer (Ray, a
2-rank ZeRO-3 actor, the embedded engine) on the quickstart task."""

import json
import os

import pytest
import torch

from rlhf_sg.evaluation import Evaluator, evaluation_steps


def test_the_schedule_before_every_interval_and_after():
    assert evaluation_steps(12, 5, True, True) == [0, 5, 10, 12]
    assert evaluation_steps(12, 5, False, False) == [5, 10]
    assert evaluation_steps(10, 5, True, True) == [0, 5, 10]  # the last step once
    assert evaluation_steps(12, 0, True, True) == [0, 12]


def test_a_resumed_run_evaluates_only_after_its_checkpoint():
    """Interval 5 over 12 steps, killed at step 7 (last checkpoint: step 6) and resumed: 10 and 12, none repeated
    or skipped."""
    evaluator = Evaluator.__new__(Evaluator)  # the schedule alone (no engines)
    evaluator.steps = evaluation_steps(12, 5, True, True)
    first = [s for s in range(0, 8) if evaluator.due(s)]
    resumed = [s for s in range(6, 13) if evaluator.due(s, resumed_from=6)]
    assert (first, resumed) == ([0, 5], [10, 12])


# ---- through the trainer -------------------------------------------------------------------------------------
def _cfg(task, out, steps, evaluate: bool, tmp_path):
    from quickstart_cpu import make_config

    cfg = make_config(*task, out, steps, "grpo", "hf")
    cfg.log.progress_bar = cfg.log.tensorboard = False
    cfg.log.export_hf, cfg.log.save_steps = True, 1
    cfg.train.num_minibatches = 2  # the update draws from the trainer's random stream: evaluation must not
    # one actor rank and no reference group: three runs here, and what is tested is the engine's sampling
    cfg.train.actor_num_ranks, cfg.train.kl_coef = 1, 0.0
    if evaluate:
        held_out = tmp_path / "held_out.jsonl"
        held_out.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                                    for a, b in [(1, 2), (3, 4), (5, 3), (2, 2)]))
        cfg.eval.prompt_data, cfg.eval.interval, cfg.eval.n_samples = str(held_out), 1, 4
        cfg.eval.k, cfg.eval.greedy = [1, 4], True
    return cfg


def _weights(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "final_hf", "model.safetensors"))


@pytest.mark.slow
def test_evaluation_changes_nothing_in_training_and_resumes_on_schedule(ray_cluster, task, tmp_path):
    """Isolation: the same 2-step GRPO run with evaluation (before, after each step; 4 samples and a greedy pass)
    and without gives bit-identical training metrics and final weights; every evaluation sample carries the weight
    version just synced. Resume: the evaluated run taken back to its step-1 checkpoint (as a run killed after
    evaluating step 2 but before its checkpoint) and resumed to step 3 evaluates after steps 2 and 3 only, and the
    log holds each evaluation once."""
    import arith_task

    from rlhf_sg.trainer import PPOTrainer, train
    from rlhf_sg.trainer.checkpoint import checkpoint_root

    plain = train(_cfg(task, str(tmp_path / "plain"), 2, False, tmp_path), reward_fn=arith_task.addition_reward)
    out = str(tmp_path / "evaluated")
    evaluated = PPOTrainer(_cfg(task, out, 2, True, tmp_path), reward_fn=arith_task.addition_reward)
    try:
        evaluated.setup()
        history = evaluated.fit()
    finally:
        evaluated.shutdown()
    assert [s for s, _ in evaluated.eval_history] == [0, 1, 2]
    training = lambda h: {k: v for k, v in h.items()  # noqa: E731
                          if not k.startswith(("eval/", "time/", "throughput/", "perf/", "weight_sync/GBps"))}
    assert [training(h) for h in history] == [training(h) for h in plain]
    got, want = _weights(out), _weights(str(tmp_path / "plain"))
    assert all(torch.equal(got[n], want[n]) for n in want)
    for step, metrics in evaluated.eval_history:
        assert 0.0 <= metrics["eval/pass@1"] <= metrics["eval/pass@4"] <= 1.0
        assert {"eval/greedy_accuracy", "eval/score_mean", "eval/truncated_frac"} <= set(metrics)
        rows = [json.loads(line) for line in open(os.path.join(out, "eval", f"step{step}.jsonl"))]
        assert len(rows) == 4 * 4 + 4 and {r["weight_version"] for r in rows} == {step}

    root = checkpoint_root(out)
    with open(os.path.join(root, "latest"), "w") as f:  # back to the checkpoint after step 1
        f.write("step1")
    os.remove(os.path.join(root, "step2.trainer.json"))
    resumed_cfg = _cfg(task, out, 3, True, tmp_path)
    resumed_cfg.log.resume = True
    resumed = PPOTrainer(resumed_cfg, reward_fn=arith_task.addition_reward)
    try:
        resumed.setup()
        resumed.fit()
    finally:
        resumed.shutdown()
    assert [s for s, _ in resumed.eval_history] == [2, 3]
    logged = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [m["step"] for m in logged if "eval/pass@1" in m] == [0, 1, 2, 3]


# ---- the plot and the command line ----------------------------------------------------------------------------
def test_the_plot_draws_held_out_pass_at_1_beside_the_reward(tmp_path):
    """A run with evaluation logs a row before step 1 that holds only evaluation metrics; the plot draws the
    training curves from the training rows and held-out pass@1 from the evaluation rows."""
    from rlhf_sg.plot import plot_run

    rows = [{"step": 0, "eval/pass@1": 0.25}]
    rows += [{"step": s, "reward/mean": 0.1 * s, "kl": 0.01, "time/step": 1.0, "time/generate": 0.5,
              **({"eval/pass@1": 0.5} if s == 2 else {})} for s in (1, 2)]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    png = plot_run(str(metrics), str(tmp_path / "run.png"))
    assert os.path.getsize(png) > 0


def test_the_eval_command_names_a_missing_data_file_before_anything_starts(tmp_path, no_ray):
    from rlhf_sg.cli import main
    from rlhf_sg.tiny import save_tiny_model

    model = save_tiny_model(str(tmp_path / "model"))
    with pytest.raises(SystemExit, match="--data FILE is required"):
        main(["eval", "--model", model])
    with pytest.raises(SystemExit, match="--data: .*missing.jsonl.* does not exist"):
        main(["eval", "--model", model, "--data", str(tmp_path / "missing.jsonl")])


@pytest.mark.slow
def test_the_eval_command_on_a_saved_model(ray_cluster, task, tmp_path, capsys):
    """``rlhf-sg eval --model DIR --data FILE`` on the warm-started policy through the embedded engine: every
    sample written with weight version 0, pass@k as the unbiased estimator gives from the written samples, and
    greedy accuracy equal to transformers' own greedy decoding of the same model on the same prompts."""
    from math import comb

    import arith_task
    from quickstart_cpu import held_out_path
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_sg.cli import main

    policy, prompts = task
    data, out = held_out_path(prompts), tmp_path / "eval"
    main(["eval", "--model", policy, "--data", data, "--data.label_key", "answer", "--data.max_prompt_len", "16",
          "--eval.reward_function", "arith_task:addition_reward", "--eval.n_samples", "4", "--eval.k", "1,4",
          "--eval.greedy", "true", "--rollout.max_new_tokens", "4", "--rollout.max_model_len", "64",
          "--output-dir", str(out)])
    printed = capsys.readouterr().out
    table = dict(line.split() for line in printed.split(f"{data}:\n", 1)[1].splitlines() if len(line.split()) == 2)
    records = [json.loads(line) for line in open(out / "eval" / "step0.jsonl")]
    sampled, greedy = [r for r in records if not r["greedy"]], [r for r in records if r["greedy"]]
    assert len(sampled) == 4 * arith_task.HELD_OUT and len(greedy) == arith_task.HELD_OUT
    assert {r["weight_version"] for r in records} == {0}
    correct = {}
    for r in sampled:
        correct[r["prompt"]] = correct.get(r["prompt"], 0) + r["correct"]
    for k in (1, 4):
        want = sum(1 - comb(4 - c, k) / comb(4, k) for c in correct.values()) / len(correct)
        assert float(table[f"pass@{k}"]) == pytest.approx(want, abs=1e-4)

    tokenizer, model = AutoTokenizer.from_pretrained(policy), AutoModelForCausalLM.from_pretrained(policy)
    rows = [json.loads(line) for line in open(data)]
    right, texts = 0, []
    for row in rows:
        ids = tokenizer(row["prompt"], return_tensors="pt", add_special_tokens=False)["input_ids"]
        new = model.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)[0, ids.shape[1]:]
        text = tokenizer.decode(new, skip_special_tokens=True)
        texts.append(text)
        right += arith_task.addition_reward([row["prompt"]], [text], [row["answer"]])[0] >= 1.0
    assert float(table["greedy_accuracy"]) == pytest.approx(right / len(rows))
    assert [(r["prompt"], r["completion"]) for r in greedy] == [(row["prompt"], t) for row, t in zip(rows, texts)]
