"""Every GPU recipe's command line is one our config accepts: each flag exists, each value reads as
its type, and the layout validates (colocation rules, rank counts, lengths).

The recipes end in ``exec rlhf-sg train-ppo ...``; here ``rlhf-sg`` on PATH is a script that records
its arguments, which then go through :func:`rlhf_sg.config.parse_args`, the CLI's own parser.
"""

import glob
import json
import os
import stat
import subprocess
import sys

import pytest

from rlhf_sg.config import parse_args
from rlhf_sg.tiny import save_tiny_model

RECIPES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes")
GPU_RECIPES = sorted(glob.glob(os.path.join(RECIPES, "gpu_*.sh")))


@pytest.fixture(scope="module")
def recipe_env(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipes")
    model = save_tiny_model(str(root / "model"), arch="qwen2", size="tiny")
    prompts = root / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "1+2="}) + "\n")
    bindir = root / "bin"
    bindir.mkdir()
    recorder = bindir / "rlhf-sg"
    recorder.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        "json.dump(sys.argv[1:], open(os.environ['RECORD_ARGS'], 'w'))\n"
    )
    recorder.chmod(recorder.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ, MODEL=model, REWARD_MODEL=model, PROMPT_DATA=str(prompts),
               REWARD="arith_task:addition_reward", SERVER_URLS="http://127.0.0.1:30000 http://127.0.0.1:30001",
               PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}")
    return root, env


def test_there_are_gpu_recipes_for_each_layout():
    names = {os.path.basename(p) for p in GPU_RECIPES}
    assert {"gpu_ppo_7b_sglang.sh", "gpu_grpo_vllm.sh", "gpu_grpo_sglang_colocated.sh",
            "gpu_grpo_vllm_colocated.sh", "gpu_grpo_sglang_multinode.sh"} <= names


@pytest.mark.parametrize("recipe", GPU_RECIPES, ids=os.path.basename)
def test_recipe_flags_parse_and_validate(recipe_env, recipe):
    root, env = recipe_env
    record = root / (os.path.basename(recipe) + ".json")
    env = dict(env, RECORD_ARGS=str(record))
    subprocess.run(["bash", recipe], env=env, check=True, timeout=60)
    argv = json.loads(record.read_text())
    assert argv[0] == "train-ppo"
    cfg = parse_args(argv[1:])  # raises ConfigError naming the flag on any unknown flag or bad layout
    assert cfg.train.device == "cuda"
    assert cfg.model.pretrain == env["MODEL"]
    if "colocated" in recipe:
        assert cfg.train.colocate_all


def _recorded(recipe_env, recipe: str) -> list[str]:
    root, env = recipe_env
    record = root / (os.path.basename(recipe) + ".json")
    subprocess.run(["bash", recipe], env=dict(env, RECORD_ARGS=str(record)), check=True, timeout=60)
    return json.loads(record.read_text())


@pytest.mark.parametrize("layout", ["", "_colocated", "_multinode"])
def test_engine_twins_run_one_layout_config_and_differ_only_in_the_backend(recipe_env, layout):
    """The SGLang and vLLM recipes of a layout read the same config file; their command lines differ in the
    backend name (and the output directory named after it) and nowhere else."""
    sglang, vllm = (_recorded(recipe_env, os.path.join(RECIPES, f"gpu_grpo_{e}{layout}.sh"))
                    for e in ("sglang", "vllm"))

    def without_engine(argv):
        return [a.replace("sglang", "ENGINE").replace("vllm", "ENGINE") for a in argv]

    assert sglang != vllm and without_engine(sglang) == without_engine(vllm)
    config = sglang[sglang.index("--config") + 1]
    assert os.path.dirname(config) == os.path.join(RECIPES, "gpu")
    assert parse_args(sglang[1:]).rollout.backend == "sglang" and parse_args(vllm[1:]).rollout.backend == "vllm"
