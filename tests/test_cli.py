"""The command line as a user runs it: ``python -m rlhf_sg train-ppo`` with a YAML file and flags, in a
fresh process that joins the Ray cluster ``RAY_ADDRESS`` names (a run that starts a Ray of its own is the faults
test's: ``python -m rlhf_sg.bench faults --child``); and a wrong flag stopping it before anything starts."""

import json
import os
import subprocess
import sys

import pytest

from rlhf_sg.cli import COMMANDS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = os.path.join(ROOT, "recipes")
sys.path.insert(0, RECIPES)


def _run(args, tmp_path, timeout=600, ray_address=None):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([RECIPES, os.environ.get("PYTHONPATH", "")]),
               DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    env.pop("RAY_ADDRESS", None)  # unless given, as on a machine without a cluster
    if ray_address:
        env["RAY_ADDRESS"] = ray_address
    return subprocess.run([sys.executable, "-m", "rlhf_sg", *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_train_ppo_from_yaml_and_flags(ray_cluster, task, tmp_path):
    policy, prompts = task
    config = tmp_path / "run.yaml"
    config.write_text(
        f"model:\n  pretrain: {policy}\n"
        f"data:\n  prompt_data: {prompts}\n  label_key: answer\n  max_prompt_len: 16\n"
        "rollout:\n  prompts_per_step: 4\n  n_samples_per_prompt: 4\n  max_new_tokens: 4\n  max_model_len: 64\n"
        "train:\n  advantage_estimator: grpo\n  max_tokens_per_microbatch: 256\n  actor_num_ranks: 1\n  kl_coef: 0.0\n"
        "reward:\n  function: arith_task:addition_reward\n"
        "log:\n  progress_bar: false\n  tensorboard: false\n"
    )
    out = tmp_path / "out"
    result = _run(["train-ppo", "--config", str(config), "--max-steps", "2", "--output-dir", str(out),
                   "--train.actor_lr", "1e-5"], tmp_path, ray_address=ray_cluster.get_runtime_context().gcs_address)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Started a local Ray instance" not in result.stderr  # it joined the cluster
    assert f"are in {out}" in result.stdout
    saved = json.loads((out / "config.json").read_text())
    assert saved["train"]["actor_lr"] == 1e-5 and saved["train"]["advantage_estimator"] == "grpo"  # flag won
    assert [json.loads(line)["step"] for line in open(out / "metrics.jsonl")] == [1, 2]
    assert (out / "final_hf" / "model.safetensors").is_file()


def test_a_wrong_flag_stops_before_ray_with_its_name(tmp_path):
    result = _run(["train-ppo", "--model", str(tmp_path), "--train.actor_lr", "fast"], tmp_path, timeout=120)
    assert result.returncode != 0
    assert "--train.actor_lr" in result.stderr and "'fast'" in result.stderr
    assert "Started a local Ray instance" not in result.stderr


def _exit_code(argv: list[str]) -> int:
    from rlhf_sg.cli import main

    try:
        main(argv)
    except SystemExit as e:  # argparse's --help exits 0
        return 0 if e.code is None else e.code if isinstance(e.code, int) else 1
    return 0


def test_the_top_level_help_names_every_command(capsys):
    assert _exit_code(["--help"]) == 0
    printed = capsys.readouterr().out
    assert all(f"rlhf-sg {command}" in printed for command in COMMANDS), printed


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_prints_its_help_and_exits_0(command, capsys):
    """``rlhf-sg COMMAND --help`` prints that command's usage and exits 0 (``eval --help`` stopped on the missing
    ``--data``; ``backends --help`` listed the backends)."""
    code = _exit_code([command, "--help"])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert printed.out.startswith("usage:") and command in printed.out.splitlines()[0], printed.out[:500]
