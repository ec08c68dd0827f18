"""Bad input is refused before anything expensive starts, with our error type and a message that names the file,
row or flag and what to do: model and tokenizer, the prompt file and its rows, incompatible flags, devices,
unknown settings, and the command line's exit status."""

import json
import logging
import os
import subprocess
import sys

import pytest

from rlhf_sg.config import Config, ConfigError, check_devices, devices_needed, load_yaml, parse_args
from rlhf_sg.data import DataError, Prompt, PromptStream, load_prompts, load_tokenizer
from rlhf_sg.tiny import build_tokenizer, save_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(str(tmp_path_factory.mktemp("m")))


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"{i}+1="}) for i in range(8)) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def flags(model_dir, prompts_file, *extra):
    return ["--model", model_dir, "--prompt-data", prompts_file, "--reward.function", "m:f", *extra]


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# ---- the model and its tokenizer -------------------------------------------------------------------------------


def test_model_dir_with_a_broken_config_json_is_named(tmp_path, prompts_file):
    bad = tmp_path / "m"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    (bad / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"--model.pretrain: '.*m/config.json' is not a JSON object; re-save"):
        parse_args(flags(str(bad), prompts_file))


def test_model_dir_without_weights_is_named(tmp_path, prompts_file, model_dir):
    bare = tmp_path / "critic"
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    with pytest.raises(ConfigError, match=r"--model.critic_pretrain: '.*critic' has a config.json but no weights"):
        parse_args(flags(model_dir, prompts_file, "--model.critic_pretrain", str(bare)))


def test_model_dir_without_a_tokenizer_is_a_config_error_naming_it(tmp_path):
    bare = tmp_path / "no_tok"
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    with pytest.raises(ConfigError, match=r"--model.pretrain: '.*no_tok' has no tokenizer \(none of tokenizer.json, "
                                          r".*save the tokenizer next to the model"):
        load_tokenizer(str(bare))
    (bare / "tokenizer_config.json").write_text("{broken")  # there, but not loadable
    with pytest.raises(ConfigError, match=r"--model.pretrain: no tokenizer loads from '.*no_tok' \(JSONDecodeError"):
        load_tokenizer(str(bare))


def test_chat_template_flag_without_a_template_names_the_model(tmp_path, model_dir, prompts_file):
    tokenizer = load_tokenizer(model_dir)
    assert not tokenizer.chat_template
    expected = rf"--data.apply_chat_template is on but the tokenizer of '{model_dir}' has no chat template"
    with pytest.raises(DataError, match=expected):
        load_prompts(prompts_file, tokenizer, apply_chat_template=True)
    # a setting, not a row: skipping bad rows must not turn it into "every row skipped"
    with pytest.raises(DataError, match=expected):
        load_prompts(prompts_file, tokenizer, apply_chat_template=True, skip_bad_rows=True)


# ---- the prompt file -------------------------------------------------------------------------------------------


def test_missing_prompt_file(tmp_path, model_dir, tok):
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(ConfigError, match=r"--data.prompt_data: '.*nope.jsonl' does not exist"):
        parse_args(["--model", model_dir, "--prompt-data", missing, "--reward.function", "m:f"])
    with pytest.raises(DataError, match=r"--data.prompt_data: '.*nope.jsonl' does not exist; give a JSONL"):
        load_prompts(missing, tok)


@pytest.mark.parametrize("text", ["", "\n\n  \n"])
def test_empty_prompt_file(tmp_path, tok, text):
    path = write(tmp_path, "empty.jsonl", text)
    with pytest.raises(DataError, match=r"empty.jsonl: no prompts in it \(the file is empty\); give one row"):
        load_prompts(path, tok)


def test_not_utf8_names_the_line(tmp_path, tok):
    path = tmp_path / "latin.jsonl"
    path.write_bytes(b'{"prompt": "1+1="}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"latin.jsonl line 2: not UTF-8 text .* save the file as UTF-8"):
        load_prompts(str(path), tok)


def test_a_json_array_file_says_one_object_per_line(tmp_path, tok):
    path = write(tmp_path, "arr.json", '[\n  {"prompt": "1+1="}\n]\n')
    with pytest.raises(DataError, match=r"arr.json line 1: not valid JSON .* one JSON object \(JSONL\)"):
        load_prompts(path, tok)


def test_json_nested_too_deeply_names_the_line(tmp_path, tok):
    path = write(tmp_path, "deep.jsonl", '{"prompt": "1+1="}\n' + "[" * 100_000 + "\n")
    with pytest.raises(DataError, match=r"deep.jsonl line 2: JSON nested too deeply"):
        load_prompts(path, tok)


def test_text_the_tokenizer_cannot_encode_names_the_line(tmp_path, tok):
    path = write(tmp_path, "s.jsonl", '{"prompt": "1+1="}\n{"prompt": "a\\ud800b"}\n')  # valid JSON, a lone surrogate
    with pytest.raises(DataError, match=r"s.jsonl line 2: the tokenizer cannot encode this prompt"):
        load_prompts(path, tok)


def test_unreadable_parquet_is_named(tmp_path, tok):
    path = write(tmp_path, "p.parquet", "this is not parquet")
    with pytest.raises(DataError, match=r"p.parquet: cannot read it as Parquet"):
        load_prompts(path, tok)


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("value", ["", "   \t", []])
def test_empty_prompt_names_the_row(tmp_path, value, chat):
    path = write(tmp_path, "e.jsonl", json.dumps({"prompt": "1+1="}) + "\n" + json.dumps({"prompt": value}) + "\n")
    tok = build_tokenizer()
    tok.chat_template = "{% for m in messages %}Q:{{ m['content'] }}{% endfor %}A:"
    # with a chat template the text is never empty (the template adds its own): the row itself is checked
    with pytest.raises(DataError, match=r"e.jsonl line 2: 'prompt' is empty; give it text"):
        load_prompts(path, tok, apply_chat_template=chat)
    prompts, skipped = load_prompts(path, tok, skip_bad_rows=True, apply_chat_template=chat)
    assert skipped == 1 and [p.row for p in prompts] == [1]


@pytest.mark.parametrize("value", [None, 7, {"role": "user"}, [{"role": "user"}], ["hi"]])
def test_chat_rows_must_be_text_or_messages(tmp_path, value):
    path = write(tmp_path, "c.jsonl", json.dumps({"prompt": value}) + "\n")
    tok = build_tokenizer()
    tok.chat_template = "{% for m in messages %}Q:{{ m['content'] }}{% endfor %}A:"
    with pytest.raises(DataError, match=r"c.jsonl line 1: with --data.apply_chat_template, 'prompt' must be a string "
                                        r"or a list of"):
        load_prompts(path, tok, apply_chat_template=True)


def test_a_failing_chat_template_names_the_row(tmp_path):
    path = write(tmp_path, "c.jsonl", json.dumps({"prompt": [{"role": "system", "content": "x"}]}) + "\n")
    tok = build_tokenizer()
    tok.chat_template = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
    with pytest.raises(DataError, match=r"c.jsonl line 1: the chat template of .* fails on this row .*no system role"):
        load_prompts(path, tok, apply_chat_template=True)


def test_prompts_per_step_larger_than_the_data_names_the_flag():
    with pytest.raises(DataError, match=r"--rollout.prompts_per_step 3 is larger than the dataset \(2 usable"):
        PromptStream([Prompt([1], "a"), Prompt([2], "b")], 3, seed=0)


# ---- prompts over --data.max_prompt_len ------------------------------------------------------------------------


@pytest.fixture
def mixed_lengths(tmp_path):
    # character tokenizer: one token per character; rows 2 and 4 are over a limit of 4
    texts = ["1+1=", "12+34=", "2+2=", "123+456="]
    return write(tmp_path, "mixed.jsonl", "".join(json.dumps({"prompt": t}) + "\n" for t in texts))


def test_overlong_prompt_is_an_error_by_default(mixed_lengths, tok):
    with pytest.raises(DataError, match=r"mixed.jsonl line 2: prompt is 6 tokens, over --data.max_prompt_len 4; "
                                        r"raise it, or set --data.overlong_prompts drop"):
        load_prompts(mixed_lengths, tok, max_prompt_len=4)


def test_overlong_with_skip_bad_rows_keeps_counting_them_as_bad_rows(mixed_lengths, tok):
    prompts, skipped = load_prompts(mixed_lengths, tok, max_prompt_len=4, skip_bad_rows=True)
    assert skipped == 2 and [p.text for p in prompts] == ["1+1=", "2+2="]


def test_overlong_drop_leaves_them_out_and_says_how_many(mixed_lengths, tok, caplog):
    with caplog.at_level(logging.WARNING, logger="rlhf_sg"):
        prompts, skipped = load_prompts(mixed_lengths, tok, max_prompt_len=4, overlong_prompts="drop")
    assert skipped == 0 and [p.row for p in prompts] == [1, 3]
    assert "dropped 2 prompts longer than --data.max_prompt_len 4" in caplog.text


def test_overlong_truncate_keeps_the_last_tokens_and_says_how_many(mixed_lengths, tok, caplog):
    with caplog.at_level(logging.WARNING, logger="rlhf_sg"):
        prompts, _ = load_prompts(mixed_lengths, tok, max_prompt_len=4, overlong_prompts="truncate")
    assert [p.text for p in prompts] == ["1+1=", "+34=", "2+2=", "456="]
    assert [tok.decode(p.token_ids) for p in prompts] == [p.text for p in prompts]
    assert all(len(p.token_ids) <= 4 for p in prompts)
    assert "truncated 2 prompts to their last 4 tokens" in caplog.text


def test_every_prompt_dropped_is_an_error_saying_so(mixed_lengths, tok):
    with pytest.raises(DataError, match=r"no usable prompt \(0 bad rows skipped .*, 4 over --data.max_prompt_len 3 "
                                        r"dropped\)"):
        load_prompts(mixed_lengths, tok, max_prompt_len=3, overlong_prompts="drop")


def test_overlong_prompts_setting_is_checked(model_dir, prompts_file, tok):
    with pytest.raises(ConfigError, match=r"--data.overlong_prompts must be one of \['error', 'drop', 'truncate'\], "
                                          r"got 'cut'"):
        parse_args(flags(model_dir, prompts_file, "--data.overlong_prompts", "cut"))
    assert parse_args(flags(model_dir, prompts_file, "--data.overlong_prompts", "drop")).data.overlong_prompts == "drop"
    assert Config().data.overlong_prompts == "error"  # nothing is dropped or cut unless asked
    with pytest.raises(DataError, match="--data.overlong_prompts must be one of"):
        load_prompts(prompts_file, tok, overlong_prompts="cut")


# ---- incompatible flags ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("extra, message", [
    # the batch is split into num_minibatches optimizer steps, each over the ranks, each rank into token-budget
    # micro-batches: every piece must hold at least one sample / one whole sequence
    (["--rollout.prompts_per_step", "2", "--rollout.n_samples_per_prompt", "2", "--train.num_minibatches", "8"],
     r"--train.num_minibatches 8 must divide prompts_per_step x n_samples_per_prompt = 4"),
    (["--rollout.prompts_per_step", "2", "--rollout.n_samples_per_prompt", "2", "--train.critic_num_ranks", "5"],
     r"--train.critic_num_ranks 5: each optimizer step has 4 samples"),
    (["--rollout.prompts_per_step", "1", "--rollout.n_samples_per_prompt", "2", "--train.actor_num_ranks", "1",
      "--train.critic_num_ranks", "1", "--train.ref_num_ranks", "3"],
     r"--train.ref_num_ranks 3: a step has 2 samples .* fewer than the ranks that must each score one"),
    (["--train.max_tokens_per_microbatch", "100", "--data.max_prompt_len", "64"],
     r"--train.max_tokens_per_microbatch \(100\) must hold one full sequence \(max_prompt_len \+ max_new_tokens = "
     r"128\)"),
    (["--rollout.n_samples_per_prompt", "0"], r"--rollout.n_samples_per_prompt must be >= 1, got 0"),
    (["--algo", "rloo", "--rollout.n_samples_per_prompt", "1"],
     r"--train.advantage_estimator rloo compares samples of the same prompt: set --rollout.n_samples_per_prompt >= 2"),
    (["--train.actor_lr=-1e-5"], r"--train.actor_lr must be >= 0, got -1e-05"),
    (["--train.actor_lr", "nan"], r"--train.actor_lr must be >= 0, got nan"),
    (["--train.gamma", "1.5"], r"--train.gamma must be in \[0, 1\], got 1.5"),
    (["--rollout.top_p", "0"], r"--rollout.top_p must be in \(0, 1\], got 0.0"),
    (["--rollout.top_k", "0"], r"--rollout.top_k must be -1 \(off\) or >= 1, got 0"),
    (["--train.max_steps", "1e400"], r"--train.max_steps: cannot read '1e400' as int"),
    (["--rollout.engine_kwargs", "[1, 2]"], r"--rollout.engine_kwargs: cannot read '\[1, 2\]' as dict"),
])
def test_incompatible_or_out_of_range_flags_are_named(model_dir, prompts_file, extra, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(flags(model_dir, prompts_file, *extra))


# ---- devices (--train.device cuda), known before Ray starts ----------------------------------------------------


def cuda_cfg(model_dir, prompts_file, *extra):
    return parse_args(flags(model_dir, prompts_file, "--train.device", "cuda", *extra))


def test_devices_needed_adds_up_by_hand(model_dir, prompts_file):
    # gae with KL: actor 2 + critic 1 + ref 1 + 2 engines x tp 2 = 8
    cfg = cuda_cfg(model_dir, prompts_file, "--rollout.num_engines", "2", "--rollout.tensor_parallel_size", "2")
    assert devices_needed(cfg)[0] == 8
    # reference rank i on actor rank i's device: 2 shared + critic 1 + 4 = 7
    cfg = cuda_cfg(model_dir, prompts_file, "--rollout.num_engines", "2", "--rollout.tensor_parallel_size", "2",
                   "--train.colocate_actor_ref", "true", "--train.ref_num_ranks", "2")
    assert devices_needed(cfg) == (7, "2 shared by actor+ref, 2 engines x tensor_parallel_size 2, 1 critic")
    # everything on the actor's 4 devices
    cfg = cuda_cfg(model_dir, prompts_file, "--algo", "grpo", "--train.colocate_all", "true",
                   "--rollout.weight_transport", "tensor",
                   *[x for g in ("--train.actor_num_ranks", "--train.ref_num_ranks", "--rollout.num_engines")
                     for x in (g, "4")], "--rollout.prompts_per_step", "4")
    assert devices_needed(cfg)[0] == 4


def test_colocated_layout_on_too_few_gpus(model_dir, prompts_file):
    cfg = cuda_cfg(model_dir, prompts_file, "--algo", "grpo", "--train.colocate_all", "true",
                   "--rollout.weight_transport", "tensor",
                   *[x for g in ("--train.actor_num_ranks", "--train.ref_num_ranks", "--rollout.num_engines")
                     for x in (g, "4")], "--rollout.prompts_per_step", "4")
    check_devices(cfg, visible=4)  # exactly enough
    with pytest.raises(ConfigError, match=r"the layout needs 4 GPUs \(4 shared by actor\+engines\+ref\) but 3 are "
                                          r"visible; .*--train.colocate_all"):
        check_devices(cfg, visible=3)


def test_tensor_parallel_larger_than_the_gpus(model_dir, prompts_file):
    cfg = cuda_cfg(model_dir, prompts_file, "--rollout.tensor_parallel_size", "4")
    with pytest.raises(ConfigError, match=r"--rollout.tensor_parallel_size 4 is larger than the 2 GPUs visible"):
        check_devices(cfg, visible=2)
    with pytest.raises(ConfigError, match=r"--train.device cuda: no CUDA device is visible"):
        check_devices(cfg, visible=0)


@pytest.mark.usefixtures("no_ray")
def test_device_check_counts_this_machine_unless_joining_a_cluster(model_dir, prompts_file, monkeypatch):
    import torch

    cfg = cuda_cfg(model_dir, prompts_file)  # needs 2 + 1 + 1 + 1 = 5 GPUs
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ConfigError, match=r"needs 5 GPUs .* but 2 are visible"):
        check_devices(cfg)
    monkeypatch.setenv("RAY_ADDRESS", "local")  # still a fresh single-node Ray
    with pytest.raises(ConfigError, match=r"needs 5 GPUs"):
        check_devices(cfg)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # a multi-node cluster: its GPUs are unknown here
    check_devices(cfg)
    check_devices(parse_args(flags(model_dir, prompts_file)), visible=0)  # CPU runs need no GPU


# ---- unknown settings ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("yaml_text, message", [
    ("rollout:\n  n_sample_per_prompt: 2\n", r"unknown setting 'rollout.n_sample_per_prompt' \(did you mean "
                                              r"'rollout.n_samples_per_prompt'\?\)"),
    ("train:\n  max_new_tokens: 2\n", r"unknown setting 'train.max_new_tokens' \(did you mean "
                                      r"'rollout.max_new_tokens'\?\)"),
    ("trian:\n  actor_lr: 1\n", r"unknown setting 'trian.actor_lr' \(did you mean 'train.actor_lr'\?\)"),
    ("rollout:\n  seed: 3\n", r"unknown setting 'rollout.seed' \(did you mean 'train.seed'\?\)"),
])
def test_unknown_yaml_key_names_the_file_and_the_closest_key(tmp_path, yaml_text, message):
    path = write(tmp_path, "run.yaml", yaml_text)
    with pytest.raises(ConfigError, match=r"run.yaml: " + message):
        parse_args(["--config", path])


def test_unknown_flag_names_the_closest_flag():
    with pytest.raises(ConfigError, match=r"unknown flag --train.kl_coeff \(did you mean --train.kl_coef\?\)"):
        parse_args(["--train.kl_coeff", "0.1"])
    with pytest.raises(ConfigError, match=r"unknown flag --bakend \(did you mean --backend\?\)"):
        parse_args(["--bakend", "hf"])
    with pytest.raises(ConfigError, match=r"unknown flag --seed \(did you mean --train.seed\?\)"):
        parse_args(["--seed=3"])
    with pytest.raises(ConfigError, match=r"unexpected argument 'grpo': settings are given as --section.key value"):
        parse_args(["grpo"])


def test_invalid_yaml_names_the_file_and_line(tmp_path):
    path = write(tmp_path, "run.yaml", "train:\n  actor_lr: 1e-5\n  clip: [0.2\n  seed: 3\n")
    with pytest.raises(ConfigError, match=r"run.yaml line 4: not valid YAML"):
        load_yaml(path)


# ---- what the user sees: the message, exit status 1, no traceback, nothing started -----------------------------


@pytest.mark.usefixtures("no_ray")
def test_cli_stops_on_a_bad_row_before_ray_with_the_message(tmp_path, model_dir, monkeypatch):
    from rlhf_sg.cli import main

    (tmp_path / "rwd.py").write_text("def score(prompts, completions, labels):\n    return [0.0] * len(prompts)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    bad = write(tmp_path, "bad.jsonl", '{"prompt": "1+1="}\n{"question": "2+2="}\n')
    with pytest.raises(SystemExit) as stop:
        main(["train-ppo", "--model", model_dir, "--prompt-data", bad, "--reward.function", "rwd:score",
              "--output-dir", str(tmp_path / "out"), "--log.tensorboard", "false"])
    assert isinstance(stop.value.code, str)  # SystemExit(str): printed to stderr, exit status 1
    assert stop.value.code.startswith("rlhf-sg train-ppo: ")
    assert "bad.jsonl line 2: key 'prompt' missing (keys: question); set --data.input_key" in stop.value.code
    assert not (tmp_path / "out").exists()  # nothing was written, nothing started
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()


def test_cli_exit_status_and_stderr_in_a_fresh_process(tmp_path, model_dir):
    bad = write(tmp_path, "bad.jsonl", '{"prompt": ""}\n')
    (tmp_path / "rwd.py").write_text("def score(prompts, completions, labels):\n    return [0.0] * len(prompts)\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    env.pop("RAY_ADDRESS", None)
    result = subprocess.run(  # run in tmp_path, whose rwd.py `python -m` can import
        [sys.executable, "-m", "rlhf_sg", "train-ppo", "--model", model_dir, "--prompt-data", bad,
         "--reward.function", "rwd:score", "--output-dir", str(tmp_path / "out")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert "bad.jsonl line 1: 'prompt' is empty" in result.stderr
    assert "Started a local Ray instance" not in result.stderr


@pytest.mark.usefixtures("no_ray")
def test_cli_checks_the_devices_before_starting(tmp_path, model_dir, prompts_file, monkeypatch):
    import torch

    from rlhf_sg.cli import main

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(SystemExit) as stop:
        main(["train-ppo", *flags(model_dir, prompts_file, "--train.device", "cuda", "--output-dir",
                                  str(tmp_path / "out"))])
    assert stop.value.code.startswith("rlhf-sg train-ppo: --train.device cuda: no CUDA device is visible")
    assert not (tmp_path / "out").exists()


def test_the_trainer_loads_prompts_with_the_overlong_setting_before_starting_anything(mixed_lengths, tmp_path):
    """``--data.overlong_prompts`` reaches the trainer's own data loading (which runs before Ray starts)."""
    from rlhf_sg.config import Config
    from rlhf_sg.tiny import save_tiny_model
    from rlhf_sg.trainer import PPOTrainer

    cfg = Config()
    cfg.model.pretrain = save_tiny_model(str(tmp_path / "m"))
    cfg.data.prompt_data, cfg.data.max_prompt_len = mixed_lengths, 4
    cfg.reward.function = "rlhf_sg.bench.faults:digit_reward"
    cfg.rollout.prompts_per_step, cfg.rollout.n_samples_per_prompt = 2, 2
    cfg.train.actor_num_ranks = cfg.train.critic_num_ranks = 1
    cfg.data.overlong_prompts = "drop"
    trainer = PPOTrainer(cfg)
    trainer.load_data()
    assert [p.text for p in trainer.stream.prompts] == ["1+1=", "2+2="]
    cfg.data.overlong_prompts = "error"
    with pytest.raises(DataError, match=r"mixed.jsonl line 2: prompt is 6 tokens"):
        PPOTrainer(cfg).load_data()
