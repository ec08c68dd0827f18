"""Config from flags and YAML, its validation, and prompt data loading: errors name the flag / file / row."""

import json

import pytest

from rlhf_sg.config import Config, ConfigError, parse_args, validate
from rlhf_sg.data import DataError, PromptStream, load_prompts
from rlhf_sg.tiny import build_tokenizer, save_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(str(tmp_path_factory.mktemp("m")))


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) for i in range(5)) + "\n")
    return str(path)


def base_flags(model_dir, prompts_file):
    return ["--model", model_dir, "--prompt-data", prompts_file, "--reward.function", "m:f"]


def test_flags_fill_typed_config(model_dir, prompts_file):
    cfg = parse_args(base_flags(model_dir, prompts_file) + [
        "--backend", "sglang", "--train.actor_lr", "3e-6", "--rollout.n_samples_per_prompt", "8",
        "--algo", "grpo", "--train.dual_clip", "3", "--rollout.stop_token_ids", "5,7",
        "--rollout.engine_kwargs", '{"mem_fraction_static": 0.5}', "--log.tensorboard", "false",
    ])
    assert cfg.rollout.backend == "sglang"
    assert cfg.train.actor_lr == 3e-6
    assert cfg.rollout.n_samples_per_prompt == 8
    assert cfg.train.advantage_estimator == "grpo"
    assert cfg.train.dual_clip == 3.0
    assert cfg.rollout.stop_token_ids == [5, 7]
    assert cfg.rollout.engine_kwargs == {"mem_fraction_static": 0.5}
    assert cfg.log.tensorboard is False


def test_yaml_then_flags_win(tmp_path, model_dir, prompts_file):
    y = tmp_path / "run.yaml"
    y.write_text(f"model:\n  pretrain: {model_dir}\ndata:\n  prompt_data: {prompts_file}\n"
                 "reward:\n  function: m:f\ntrain:\n  actor_lr: 1.0e-4\n  max_steps: 7\n")
    cfg = parse_args(["--config", str(y), "--train.max_steps", "9"])
    assert cfg.train.actor_lr == 1e-4 and cfg.train.max_steps == 9


def test_yaml_unknown_key_names_file(tmp_path):
    y = tmp_path / "run.yaml"
    y.write_text("train:\n  actor_lrr: 1\n")
    with pytest.raises(ConfigError, match=r"run.yaml: unknown setting 'train.actor_lrr'"):
        parse_args(["--config", str(y)])


@pytest.mark.parametrize("flags, message", [
    (["--algo", "grpo", "--rollout.n_samples_per_prompt", "1"], "n_samples_per_prompt >= 2"),
    (["--algo", "ppo2"], "advantage_estimator 'ppo2' unknown"),
    (["--train.kl_estimator", "k9"], "kl_estimator must be one of"),
    (["--rollout.weight_transport", "carrier-pigeon"], "weight_transport must be"),
    (["--rollout.routing", "least_busy"],
     r"--rollout.routing must be one of \['sticky_least_loaded', 'round_robin', 'consistent_hash'\], got 'least_busy'"),
    (["--train.actor_num_ranks", "0"], "actor_num_ranks must be >= 1"),
    (["--rollout.prompts_per_step", "3", "--train.num_minibatches", "5"], "num_minibatches 5 must divide"),
    (["--data.max_prompt_len", "4000"], "exceeds --rollout.max_model_len"),
    (["--train.actor_lr", "fast"], "cannot read 'fast' as float"),
    (["--reward.function", "nocolon"], "module:function"),
    (["--rollout.prompts_per_step", "1", "--rollout.n_samples_per_prompt", "1", "--train.actor_num_ranks", "2"],
     "fewer than the ranks"),
    (["--algo", "gae", "--train.dynamic_filtering", "true", "--rollout.n_samples_per_prompt", "1"],
     r"--train.dynamic_filtering .* --rollout.n_samples_per_prompt 1 .* set --rollout.n_samples_per_prompt >= 2"),
    (["--train.dynamic_filtering_max_draws", "0"], "dynamic_filtering_max_draws must be >= 1"),
    (["--train.lr_scheduler", "step"], r"lr_scheduler must be one of \['constant', 'linear', 'cosine'\]"),
    (["--train.lr_warmup_ratio", "1.5"], r"lr_warmup_ratio must be in \[0, 1\)"),
    (["--train.score_clip", "0"], "score_clip must be > 0"),
])
def test_bad_flags_are_named(model_dir, prompts_file, flags, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(base_flags(model_dir, prompts_file) + flags)


def test_lr_schedule_spans_the_runs_optimizer_steps(model_dir, prompts_file):
    from rlhf_sg.config import lr_warmup_steps, optimizer_steps

    cfg = parse_args(base_flags(model_dir, prompts_file) + [
        "--max-steps", "10", "--train.ppo_epochs", "2", "--train.num_minibatches", "2", "--rollout.prompts_per_step",
        "4", "--train.critic_warmup_steps", "3", "--train.lr_scheduler", "cosine", "--train.lr_warmup_ratio", "0.1",
    ])
    assert optimizer_steps(cfg, "critic") == 10 * 2 * 2
    assert optimizer_steps(cfg, "actor") == (10 - 3) * 2 * 2  # the actor waits out the critic's warmup
    assert lr_warmup_steps(cfg, "actor") == round(0.1 * 28)
    assert cfg.train.lr_scheduler == "cosine"


def test_missing_model_dir_named(tmp_path, prompts_file):
    with pytest.raises(ConfigError, match=r"--model.pretrain: .* \(no config.json there\)"):
        parse_args(["--model", str(tmp_path), "--prompt-data", prompts_file, "--reward.function", "m:f"])


def test_validate_requires_prompt_data(model_dir):
    cfg = Config()
    cfg.model.pretrain = model_dir
    with pytest.raises(ConfigError, match="--data.prompt_data is required"):
        validate(cfg)


def test_load_prompts_and_errors(tmp_path):
    tok = build_tokenizer()
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "1+1=", "answer": "2"}\n\n{"prompt": "2+2=", "answer": "4"}\n')
    prompts, skipped = load_prompts(str(good), tok, label_key="answer")
    assert [p.text for p in prompts] == ["1+1=", "2+2="]
    assert [p.label for p in prompts] == ["2", "4"]
    assert tok.decode(prompts[0].token_ids) == "1+1="
    assert prompts[1].row == 3 and skipped == 0

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1="}\n{"question": "x"}\n{"prompt": "3+3="}\n')
    expected = r"bad.jsonl line 2: key 'prompt' missing \(keys: question\); set --data.input_key"
    with pytest.raises(DataError, match=expected):
        load_prompts(str(bad), tok)
    prompts, skipped = load_prompts(str(bad), tok, skip_bad_rows=True)
    assert skipped == 1 and [p.text for p in prompts] == ["1+1=", "3+3="]

    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "1+1="}\n{"prompt": \n')
    with pytest.raises(DataError, match="broken.jsonl line 2: not valid JSON"):
        load_prompts(str(broken), tok)
    with pytest.raises(DataError, match="line 1: prompt is 4 tokens, over --data.max_prompt_len 3"):
        load_prompts(str(good), tok, max_prompt_len=3)


def test_parquet_prompts(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"q": ["a b", "c"], "answer": ["1", "2"]}), path)
    prompts, _ = load_prompts(str(path), build_tokenizer(), input_key="q")
    assert [p.text for p in prompts] == ["a b", "c"]
    with pytest.raises(DataError, match="p.parquet row 0: key 'prompt' missing"):
        load_prompts(str(path), build_tokenizer())


def test_prompt_stream_resumes_exactly():
    from rlhf_sg.data import Prompt

    prompts = [Prompt(token_ids=[i], text=str(i)) for i in range(10)]
    a = PromptStream(prompts, 3, seed=5)
    seen = [[p.text for p in a.next_batch()] for _ in range(7)]  # crosses two epoch boundaries
    b = PromptStream(prompts, 3, seed=5)
    for _ in range(4):
        b.next_batch()
    c = PromptStream(prompts, 3, seed=5)
    c.load_state(b.state())
    assert [[p.text for p in c.next_batch()] for _ in range(3)] == seen[4:]
    assert sorted(sum(seen[:3], [])) == sorted(str(i) for i in range(9))  # an epoch has no repeats
