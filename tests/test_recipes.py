"""Every GPU recipe's command line is one our config accepts: each flag exists, each value reads as
its type, and the layout validates (colocation rules, rank counts, lengths).

The recipes end in ``exec rlhf-sg train-ppo ...``; here ``rlhf-sg`` on PATH is a script that records
its arguments, which then go through :func:`rlhf_sg.config.parse_args`, the CLI's own parser.
"""

import glob
import json
import os
import re
import stat
import subprocess
import sys

import pytest

from rlhf_sg import memory
from rlhf_sg.config import (
    check_devices,
    engines_on_servers,
    microbatch_tokens,
    offload_states,
    parse_args,
    sleep_engines,
)
from rlhf_sg.parallel import memory as sp_memory
from rlhf_sg.tiny import save_tiny_model
from rlhf_sg.trainer.layout import Layout

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
            "gpu_grpo_vllm_colocated.sh", "gpu_grpo_sglang_multinode.sh", "gpu_grpo_vl_hf.sh"} <= names


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


#: each GPU recipe (or the layout config it passes) states what it is sized for; without "of M GB", 80 GB
SIZED_FOR = re.compile(r"^# Sized for (?P<model>\S+) on (?P<gpus>\d+) GPUs(?: of (?P<gb>\d+) GB)?", re.MULTILINE)
#: what an engine takes of its device when --rollout.memory_fraction is unset (SGLang's and the embedded engine's)
ENGINE_DEFAULT_FRACTION = 0.9


def _sized_for(recipe: str, argv: list[str]) -> tuple[str, int, int]:
    """The model (a ``bench memory`` preset), GPU count and bytes a GPU the recipe states it is sized for: in the
    script, else in the layout config it passes. A GPU of "80 GB" is 80e9 bytes: an H100's 79.6 GiB less about 5 GiB
    of CUDA context, NCCL buffers and allocator slack."""
    paths = [recipe] + ([argv[argv.index("--config") + 1]] if "--config" in argv else [])
    for path in paths:
        with open(path) as f:
            found = SIZED_FOR.search(f.read())
        if found:
            return found["model"], int(found["gpus"]), int(found["gb"] or 80) * 10**9
    pytest.fail(f"{os.path.basename(recipe)}: no '# Sized for MODEL on N GPUs of M GB' line in it or its --config "
                f"(MODEL: a preset of rlhf_sg.memory.PRESETS)")


def _peak_per_device(cfg, shape: memory.ModelShape, device_bytes: int) -> dict[str, tuple[int, str]]:
    """The peak bytes on a device of each set of groups that share devices (or of each group alone), from
    ``bench memory``'s per-rank formulas, and how they add up. Groups sharing a device keep their shards there all
    step and take turns with the rest (one phase at a time); colocated engines that sleep while the trainer
    trains, beside training states that leave while they generate, take turns with the trainer too."""
    t, r = cfg.train, cfg.rollout
    layout = Layout(cfg)
    sizes, tokens = layout.group_sizes(), t.max_tokens_per_microbatch
    dense_mask = cfg.model.attn_implementation != "flash_attention_2"

    def rank(role: str) -> dict[str, int]:
        split = layout.sequence_parallel_size(role)
        if role in ("actor", "critic") and split > 1:  # the SP group's micro-batch (split x the budget: each rank
            # holds the budget's tokens) as one row split over it (a critic counted with the actor's logits chunk: an
            # upper bound)
            return sp_memory.training_rank_bytes(shape, sizes[role], 1, microbatch_tokens(cfg, role), split,
                                                 t.gradient_checkpointing,
                                                 "sdpa" if dense_mask else "flash_attention_2")
        if role in ("actor", "critic"):
            return memory.training_rank_bytes(shape, sizes[role], tokens, t.gradient_checkpointing, dense_mask,
                                              lm_head=role == "actor")
        return memory.forward_rank_bytes(shape, sizes[role], tokens, role == "ref" and t.ref_offload, dense_mask,
                                         lm_head=role == "ref")

    fraction = r.memory_fraction or ENGINE_DEFAULT_FRACTION
    shared = layout.colocation()
    sets = shared + [[g] for g in sizes if not any(g in s for s in shared)]
    peaks = {}
    for names in sets:
        models = {g: rank(g) for g in names if g != "engines"}
        if not models and engines_on_servers(cfg):
            continue  # engines that drive servers elsewhere hold no device here
        resident = sum(b[k] for b in models.values() for k in memory.RESIDENT)
        transient = max((sum(v for k, v in b.items() if k not in memory.RESIDENT) for b in models.values()), default=0)
        trainer = resident + transient
        parts = [f"{g} {sum(b.values()) / 1e9:.1f} GB" for g, b in models.items()]
        if "engines" in names and not engines_on_servers(cfg):
            engine = int(fraction * device_bytes)
            weights = memory.weight_bytes(shape) // r.tensor_parallel_size
            assert weights < engine, (f"an engine's weights ({weights / 1e9:.1f} GB a GPU) exceed its share of the "
                                      f"GPU ({engine / 1e9:.1f} GB)")
            takes_turns = models and sleep_engines(cfg) and offload_states(cfg)
            parts.append(f"engine {engine / 1e9:.1f} GB" + (", taking turns with the trainer" if takes_turns else ""))
            trainer = max(trainer, engine) if takes_turns else trainer + engine
        peaks["+".join(names)] = (trainer, ", ".join(parts))
    return peaks


@pytest.mark.parametrize("recipe", GPU_RECIPES, ids=os.path.basename)
def test_every_gpu_recipe_fits_the_node_it_is_sized_for(recipe_env, recipe):
    """A recipe that could not start on its node fails here: its layout against the node's GPU count by the
    trainer's own device check (which a run joining a Ray cluster skips), and each device's peak, from ``bench
    memory``'s formulas for the model it is sized for, against the GPU's memory."""
    argv = _recorded(recipe_env, recipe)
    cfg = parse_args(argv[1:])
    model, gpus, device_bytes = _sized_for(recipe, argv)
    check_devices(cfg, visible=gpus)
    for devices, (peak, parts) in _peak_per_device(cfg, memory.load_shape(model), device_bytes).items():
        assert peak <= device_bytes, (f"{os.path.basename(recipe)}: a GPU of {devices} needs {peak / 1e9:.1f} GB "
                                      f"({parts}) of the {device_bytes / 1e9:.0f} GB it is sized for")


def test_the_rlhf_pipelines_preferences_hold_out_unseen_pairs_flip_only_training_ones_and_load(tmp_path):
    """recipes/rlhf_pipeline.py's data: the reward model is judged on pairs it never trained on, label noise flips
    only training pairs (about the fraction asked), and every file loads through the stages' own loader with
    nothing dropped or truncated."""
    sys.path.insert(0, RECIPES)
    try:
        import arith_task
        import rlhf_pipeline
    finally:
        sys.path.remove(RECIPES)
    from rlhf_sg.stages.config import StageDataConfig
    from rlhf_sg.stages.data import load_stage_rows
    from rlhf_sg.stages.render import eos_ids
    from rlhf_sg.tiny import build_tokenizer

    files = rlhf_pipeline.write_data(str(tmp_path), seed=0, label_noise=0.25)
    read = {k: [json.loads(line) for line in open(files[k])] for k in ("prefs", "prefs_held_out", "sft")}
    answers = dict(arith_task.problems(0, rlhf_pipeline.MAX_DIGIT))
    key = lambda r: (r["prompt"], frozenset((r["chosen"], r["rejected"])))  # noqa: E731
    train, held = {key(r) for r in read["prefs"]}, {key(r) for r in read["prefs_held_out"]}
    assert not train & held and len(held) == len(read["prefs_held_out"]) > 0
    assert all(r["chosen"] == answers[r["prompt"]] for r in read["prefs_held_out"])
    flipped = sum(r["chosen"] != answers[r["prompt"]] for r in read["prefs"]) / len(read["prefs"])
    assert 0.15 < flipped < 0.35, flipped
    tokenizer = build_tokenizer()
    d = StageDataConfig(max_len=32)
    for stage, name in (("rm", "prefs"), ("rm", "prefs_held_out"), ("sft", "sft")):
        rows = load_stage_rows(files[name], stage, tokenizer, eos_ids(tokenizer), d)
        assert (rows.num_units, rows.dropped, rows.truncated) == (len(read[name]), 0, 0), name
    # the SFT policy's own wrong samples join the pairs, one per sample (repeats kept), its right ones do not
    prompt, answer = arith_task.problems(0, rlhf_pipeline.MAX_DIGIT)[0]
    wrong = str((int(answer) + 1) % 19)
    files = rlhf_pipeline.write_data(str(tmp_path / "sampled"), seed=0, label_noise=0.0,
                                     policy_samples={prompt: [wrong, wrong, answer, "7+"]})
    rows = [json.loads(line) for k in ("prefs", "prefs_held_out") for line in open(files[k])]
    of_prompt = [r["rejected"] for r in rows if r["prompt"] == prompt]
    assert (of_prompt.count(wrong), of_prompt.count("7+"), of_prompt.count(answer)) == (3, 1, 0)
    assert len(rows) == sum(len(read[k]) for k in ("prefs", "prefs_held_out")) + 3


def test_the_rlhf_pipelines_ppo_never_trains_on_its_held_out_problems(tmp_path):
    """recipes/rlhf_pipeline.py splits its problems by problem: the PPO prompt file holds the training problems
    only, the held-out file the rest (about a fifth, none of them in the prompt file), together every problem once
    with its right answer, and the same seed gives the same split (the SFT and the PPO policy are judged on it)."""
    sys.path.insert(0, RECIPES)
    try:
        import arith_task
        import rlhf_pipeline
    finally:
        sys.path.remove(RECIPES)

    every = arith_task.problems(0, rlhf_pipeline.MAX_DIGIT)
    assert len(every) == (rlhf_pipeline.MAX_DIGIT + 1) ** 2 == len(set(every))
    files = rlhf_pipeline.write_data(str(tmp_path), seed=0, label_noise=0.1)
    read = {k: [(r["prompt"], r["answer"]) for r in map(json.loads, open(files[k]))] for k in ("prompts", "held_out")}
    train, held_out = set(read["prompts"]), set(read["held_out"])
    assert not {p for p, _ in train} & {p for p, _ in held_out}
    assert sorted(train | held_out) == sorted(every) and len(read["prompts"]) + len(read["held_out"]) == len(every)
    assert len(held_out) == round(rlhf_pipeline.HELD_OUT_FRACTION * len(every))
    assert all(int(p[:-1].split("+")[0]) + int(p[:-1].split("+")[1]) == int(a) for p, a in train | held_out)
    assert rlhf_pipeline.split_problems(0) == (read["prompts"], read["held_out"])
    assert rlhf_pipeline.split_problems(1) != rlhf_pipeline.split_problems(0)  # the seed draws the split


def _calc_harness():
    sys.path.insert(0, RECIPES)
    try:
        import calc_harness
    finally:
        sys.path.remove(RECIPES)
    return calc_harness


def test_the_calc_harness_recipe_config_validates_and_its_harness_loads(tmp_path):
    """recipes/calc_harness.py's run: its config passes the checks made before Ray starts (the harness importable
    as an async function, no evaluation during training, which does not run harnesses), and its warm start
    trains on the ids the endpoint prefills: the question as the renderer renders it, the call the renderer
    parses back, the tool's message as the renderer continues the conversation after the call."""
    calc_harness = _calc_harness()
    from rlhf_sg.config import validate
    from rlhf_sg.serve.harness import load_harness
    from rlhf_sg.serve.renderer import renderer_for
    from rlhf_sg.tiny import build_chat_tokenizer

    sys.path.insert(0, RECIPES)
    try:
        cfg = validate(calc_harness.make_config(save_tiny_model(str(tmp_path / "m")), calc_harness.write_prompts(
            str(tmp_path / "p.jsonl"), calc_harness.problems(0, 32)), str(tmp_path / "out"), 2))
        assert load_harness(cfg.agent.harness) is calc_harness.solve
    finally:
        sys.path.remove(RECIPES)
    assert cfg.eval.prompt_data is None and cfg.reward.function is None
    assert cfg.rollout.max_new_tokens == calc_harness.BUDGET_TOKENS

    tok = build_chat_tokenizer()
    tok.chat_template = calc_harness.compact_template()
    r = renderer_for(tok)
    (head, h), (call, c), (glue, g), (answer, a) = calc_harness.rendered(r, "417*38=", "15846", tool=True)
    assert (h, c, g, a) == (False, True, False, True)
    question = [{"role": "user", "content": "417*38="}]
    assert head == r.render(question, calc_harness.TOOLS)
    assert "<tools>calculator</tools>" in tok.decode(head) and len(head) < 50
    parsed = r.parse(call)
    assert [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in parsed.tool_calls] == [
        ("calculator", {"expression": "417*38"})] and call[-1] == tok.eos_token_id
    messages = question + [parsed.message(), {"role": "tool", "tool_call_id": "x", "content": "15846"}]
    whole = r.render(messages, calc_harness.TOOLS)
    assert tok.decode(head + call + glue) == tok.decode(whole) and "<tool_response>\n15846\n" in tok.decode(glue)
    assert tok.decode(answer) == "15846<|im_end|>"
    (head2, _), (direct, d) = calc_harness.rendered(r, "417*38=", "15846", tool=False)
    assert head2 == head and direct == answer and d
    # a system message the harness sends stays in the compact template's system turn
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."}] + question,
                                   tools=calc_harness.TOOLS, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n<tools>calculator</tools><|im_end|>")


def test_the_calc_harness_tool_answers_the_call_or_says_what_is_wrong():
    from types import SimpleNamespace

    calc_harness = _calc_harness()

    def call(name, arguments):
        return SimpleNamespace(function=SimpleNamespace(name=name, arguments=arguments))

    assert calc_harness.run_tool(call("calculator", '{"expression": "417*38"}')) == "15846"
    assert calc_harness.run_tool(call("search", "{}")) == "error: no tool named 'search'"
    assert calc_harness.run_tool(call("calculator", "{not json")).startswith("error: arguments must be")
    assert calc_harness.run_tool(call("calculator", '{"expression": "__import__(1)"}')).startswith("error:")


def test_the_rlhf_pipelines_policy_figures_repeat_for_one_policy_and_read_the_reward_models_statistics(tmp_path):
    """recipes/rlhf_pipeline.py judges the SFT and the PPO policy on the same problems with the same sampling seed:
    one policy judged twice gives the same figures (another seed, other samples), and the reward model's score is
    normalised with the statistics it was saved with (a mean 1 higher lowers every score by exactly 1 / std)."""
    sys.path.insert(0, RECIPES)
    try:
        import arith_task
        import rlhf_pipeline
    finally:
        sys.path.remove(RECIPES)
    import torch

    from rlhf_sg.models import ValueHeadModel
    from rlhf_sg.tiny import build_tiny_model

    policy = save_tiny_model(str(tmp_path / "policy"), arch="qwen2", size="tiny")
    rm = ValueHeadModel(build_tiny_model("qwen2", "tiny", seed=1).model)
    rm.reward_mean, rm.reward_std = 0.5, 2.0
    rm.save_pretrained(str(tmp_path / "rm"))
    data = arith_task.problems(0)[:3]
    first = rlhf_pipeline.policy_figures(policy, str(tmp_path / "rm"), data, seed=0, samples=4)
    again = rlhf_pipeline.policy_figures(policy, str(tmp_path / "rm"), data, seed=0, samples=4)
    assert first == again
    other_seed = rlhf_pipeline.policy_figures(policy, str(tmp_path / "rm"), data, seed=1, samples=4)
    assert other_seed["rm_score"] != first["rm_score"]  # the seed draws the samples
    assert 0.0 <= first["rule_accuracy"] <= 1.0
    rm.reward_mean = 1.5
    rm.save_pretrained(str(tmp_path / "rm_shifted"))
    shifted = rlhf_pipeline.policy_figures(policy, str(tmp_path / "rm_shifted"), data, seed=0, samples=4)
    assert shifted["rm_score"] == pytest.approx(first["rm_score"] - 1.0 / 2.0, abs=1e-5)
    assert torch.isfinite(torch.tensor(first["rm_score"]))


def test_the_vision_task_recipe_writes_colour_prompts_its_control_cannot_tell_apart_and_validates(tmp_path):
    """recipes/vision_task.py: its rows load with the model's processor (one image each, the answer its colour's
    digit); the control's images are one grey square for every answer (only the image tells the colours apart, so
    the control cannot learn it); the reward reads the first character; the run's config passes the checks."""
    sys.path.insert(0, RECIPES)
    try:
        import vision_task
    finally:
        sys.path.remove(RECIPES)
    import torch
    from PIL import Image

    from rlhf_sg.config import validate
    from rlhf_sg.vision import load_processor, load_vision_prompts, save_tiny_vision_model

    policy = save_tiny_vision_model(str(tmp_path / "policy"), "qwen2-vl")
    config, processor = load_processor(policy)

    def rows_and_means(control: bool):
        path = vision_task.write_images_and_prompts(str(tmp_path), "train", 12, seed=0, control=control)
        rows = [json.loads(line) for line in open(path)]
        means = [tuple(torch.tensor(list(Image.open(tmp_path / r["images"][0]).getdata()), dtype=torch.float32)
                       .mean(0).round().tolist()) for r in rows]
        prompts, _ = load_vision_prompts(path, config, processor, label_key="answer", max_prompt_len=64)
        assert len(prompts) == 12 and all(p.images is not None and p.images.num_images == 1 for p in prompts)
        return path, rows, means

    path, rows, means = rows_and_means(control=False)
    assert len({r["answer"] for r in rows}) > 1
    for row, mean in zip(rows, means):  # each image is its answer's colour, up to the noise
        assert max(abs(m - c) for m, c in zip(mean, vision_task.COLOURS[row["answer"]])) < 10, (row, mean)
    _, control_rows, control_means = rows_and_means(control=True)
    assert [r["answer"] for r in control_rows] == [r["answer"] for r in rows]  # the same answers, no colour
    assert all(max(abs(m - g) for m, g in zip(mean, vision_task.GREY)) < 10 for mean in control_means)
    assert vision_task.colour_reward(["q"] * 4, ["2<eos>", "1", "", " 2"], ["2"] * 4) == [1.0, 0.0, 0.0, 0.0]
    validate(vision_task.make_config(policy, path, path, str(tmp_path / "run"), 2, 3e-3))


def test_the_vision_language_gpu_recipe_validates_against_a_vision_language_model(recipe_env, tmp_path):
    """recipes/gpu_grpo_vl_hf.sh with a vision-language MODEL (so the rules for such a policy apply: backend,
    critic, frozen tower on several ranks): its flags parse and validate, the tower stays frozen, and it is sized
    for Qwen2.5-VL-7B, whose tower its shape counts (the fit itself:
    test_every_gpu_recipe_fits_the_node_it_is_sized_for)."""
    from rlhf_sg.vision import save_tiny_vision_model

    root, env = recipe_env
    model = save_tiny_vision_model(str(tmp_path / "vl"), "qwen2.5-vl")
    recipe = os.path.join(RECIPES, "gpu_grpo_vl_hf.sh")
    record = root / "vl.json"
    subprocess.run(["bash", recipe], env=dict(env, MODEL=model, RECORD_ARGS=str(record)), check=True, timeout=60)
    argv = json.loads(record.read_text())
    cfg = parse_args(argv[1:])
    assert (cfg.model.pretrain, cfg.rollout.backend, cfg.model.freeze_vision_tower) == (model, "hf", True)
    shape_name, gpus, _ = _sized_for(recipe, argv)
    assert memory.load_shape(shape_name).vision_params > 0 and gpus == 8
    # the same command with another engine is refused for this policy, naming the flag
    with pytest.raises(Exception, match="--rollout.backend"):
        parse_args(argv[1:] + ["--rollout.backend", "sglang"])
