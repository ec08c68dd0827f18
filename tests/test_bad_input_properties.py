"""Property tests of bad input: random malformed prompt files and rows, random config dicts and random command
lines always end in our own error (DataError / ConfigError, or the command line's exit with a message), never in
an exception from deep inside; a row or setting known to be bad is always refused, by name."""

import contextlib
import io
import json
import math
import string
from unittest import mock

import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from rlhf_sg.advantages import advantage_estimators
from rlhf_sg.config import (
    Config,
    ConfigError,
    apply_overrides,
    check_devices,
    devices_needed,
    dotted_keys,
    validate,
)
from rlhf_sg.data import DataError, load_prompts
from rlhf_sg.tiny import CHARSET, build_tokenizer, save_tiny_model

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

MAX_PROMPT_LEN = 12
TEMPLATE = "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}\n{% endfor %}A:"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("props")
    model = save_tiny_model(str(root / "model"))
    prompts = root / "ok.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{i}+1="}) + "\n" for i in range(8)))
    return root, model, str(prompts)


def tokenizer(chat: bool):
    tok = build_tokenizer()
    if chat:
        tok.chat_template = TEMPLATE
    return tok


TOKENIZERS = {chat: tokenizer(chat) for chat in (False, True)}

# ---- prompt files ------------------------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)
good_text = st.text(alphabet=CHARSET.strip(), min_size=1, max_size=MAX_PROMPT_LEN)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": st.text()}),
                    max_size=3)
rows = st.one_of(
    st.binary(max_size=40),  # anything at all, UTF-8 or not
    json_values.map(lambda v: json.dumps(v).encode()),
    st.dictionaries(st.sampled_from(["prompt", "answer", "question"]), json_values | good_text | messages,
                    max_size=3).map(lambda d: json.dumps(d).encode()),
    good_text.map(lambda t: json.dumps({"prompt": t, "answer": "1"}).encode()),
    st.just(b'{"prompt": "1\\udfff+"}'),  # a lone surrogate: valid JSON, not encodable
)


@SETTINGS
@given(lines=st.lists(rows, max_size=6), chat=st.booleans(), skip=st.booleans(),
       overlong=st.sampled_from(["error", "drop", "truncate"]), label=st.sampled_from([None, "answer"]))
def test_any_prompt_file_loads_or_ends_in_a_data_error(workdir, lines, chat, skip, overlong, label):
    path = workdir[0] / "random.jsonl"
    path.write_bytes(b"\n".join(lines))
    tok = TOKENIZERS[chat]
    try:
        prompts, skipped = load_prompts(str(path), tok, label_key=label, apply_chat_template=chat,
                                        max_prompt_len=MAX_PROMPT_LEN, skip_bad_rows=skip, overlong_prompts=overlong)
    except DataError as e:
        assert str(path) in str(e)  # names the file (and the line, where one is at fault)
        return
    assert prompts and 0 <= skipped <= len(lines)
    assert all(1 <= len(p.token_ids) <= MAX_PROMPT_LEN for p in prompts)
    assert [p.row for p in prompts] == sorted({p.row for p in prompts})  # in file order, each row once


def _not_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return True
    return False


malformed_rows = st.one_of(
    st.text(min_size=1, max_size=20).filter(lambda t: t.strip() and "\n" not in t and _not_json(t)),  # not JSON
    st.one_of(st.lists(json_values, max_size=3), st.integers(), st.text(max_size=5), st.booleans()).map(json.dumps),
    st.dictionaries(st.sampled_from(["question", "input", "Prompt", "answer"]), json_values, max_size=3)
    .map(json.dumps),  # no "prompt" key
    st.one_of(st.none(), st.integers(), st.booleans(), st.dictionaries(st.text(), st.integers(), max_size=2))
    .map(lambda v: json.dumps({"prompt": v})),  # not text
    st.text(alphabet=" \t", min_size=1, max_size=4).map(lambda v: json.dumps({"prompt": v})),  # blank
    st.text(alphabet=string.digits + "+=", min_size=MAX_PROMPT_LEN + 1, max_size=40)
    .map(lambda v: json.dumps({"prompt": v})),  # over the limit
    st.just('{"prompt": "1\\ud800+"}'),  # valid JSON the tokenizer cannot encode (a lone surrogate)
)


@SETTINGS
@given(good=st.lists(good_text, min_size=1, max_size=5), bad=malformed_rows, at=st.integers(0, 5))
def test_a_malformed_row_is_named_by_line_or_skipped_and_counted(workdir, good, bad, at):
    at = min(at, len(good))
    lines = [json.dumps({"prompt": t}) for t in good]
    lines.insert(at, bad)
    path = workdir[0] / "one_bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=rf"{path} line {at + 1}: \S"):
        load_prompts(str(path), TOKENIZERS[False], max_prompt_len=MAX_PROMPT_LEN)
    prompts, skipped = load_prompts(str(path), TOKENIZERS[False], max_prompt_len=MAX_PROMPT_LEN, skip_bad_rows=True)
    assert skipped == 1 and [p.text for p in prompts] == good


# ---- config dicts ------------------------------------------------------------------------------------------------

KEYS = dotted_keys()
raw_values = st.one_of(
    json_values,
    st.integers(min_value=-(10**400), max_value=10**400),
    st.floats(),  # nan and inf included
    st.sampled_from(["nan", "inf", "-1", "0", "1e400", "none", "true", "[1, 2]", "{", "cpu", "cuda", "grpo"]),
)


def base_overrides(workdir) -> dict:
    _, model, prompts = workdir
    return {"model.pretrain": model, "data.prompt_data": prompts, "reward.function": "m:f"}


@SETTINGS
@given(overrides=st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=20), raw_values, max_size=6),
       visible=st.integers(0, 8))
def test_any_config_dict_validates_or_ends_in_a_config_error(workdir, overrides, visible):
    cfg = Config()
    try:
        apply_overrides(cfg, base_overrides(workdir), "base")
        apply_overrides(cfg, overrides, "run.yaml")
        validate(cfg)
        check_devices(cfg, visible=visible)
    except ConfigError as e:
        assert str(e).strip()


def _misspelt(key: str, draw) -> str:
    i = draw(st.integers(0, len(key) - 1))
    how = draw(st.sampled_from(["drop", "double", "swap"]))
    if how == "drop":
        return key[:i] + key[i + 1:]
    if how == "double":
        return key[:i] + key[i] + key[i:]
    return key[:i] + key[i + 1:i + 2] + key[i:i + 1] + key[i + 2:]


# (setting, values it must refuse): wrong types and out-of-range values
BAD = {
    "train.max_steps": st.one_of(st.integers(max_value=0), st.sampled_from(["ten", "1.5", "", "1e400"])),
    "train.actor_num_ranks": st.integers(max_value=0),
    "rollout.n_samples_per_prompt": st.integers(max_value=0),
    "rollout.prompts_per_step": st.one_of(st.integers(max_value=0), st.floats(0.01, 100).filter(
        lambda x: not x.is_integer())),
    "train.actor_lr": st.one_of(st.floats(max_value=-1e-12), st.just(math.inf), st.just(math.nan), st.just("fast")),
    "train.gamma": st.one_of(st.floats(min_value=1.0001), st.floats(max_value=-1e-9)),
    "train.kl_coef": st.floats(max_value=-1e-9),
    "train.lr_warmup_ratio": st.floats(min_value=1.0),
    "train.clip_low": st.floats(min_value=1.0),
    "rollout.top_p": st.one_of(st.floats(max_value=0.0), st.floats(min_value=1.0001)),
    "rollout.temperature": st.floats(max_value=-1e-9),
    "rollout.memory_fraction": st.floats(min_value=1.0001),
    "log.save_steps": st.integers(max_value=-1),
    "log.tensorboard": st.sampled_from(["maybe", "2", "", "[]"]),
    "train.device": st.text(max_size=8).filter(lambda s: s not in ("cpu", "cuda")),
    "train.advantage_estimator": st.text(max_size=8).filter(lambda s: s not in advantage_estimators()),
    "data.overlong_prompts": st.text(max_size=8).filter(lambda s: s not in ("error", "drop", "truncate")),
    "rollout.engine_kwargs": st.sampled_from(["[1]", "3", "{oops", "null"]),
}


@st.composite
def one_bad_setting(draw):
    if draw(st.booleans()):
        key = draw(st.sampled_from(KEYS))
        typo = _misspelt(key, draw)
        assume(typo not in KEYS)
        return typo, 1, f"unknown setting {typo!r}"
    key = draw(st.sampled_from(sorted(BAD)))
    return key, draw(BAD[key]), key


@SETTINGS
@given(bad=one_bad_setting())
def test_a_known_bad_setting_is_always_refused_by_name(workdir, bad):
    key, value, named = bad
    cfg = Config()
    apply_overrides(cfg, base_overrides(workdir), "base")
    with pytest.raises(ConfigError) as refused:
        apply_overrides(cfg, {key: value}, "run.yaml")
        validate(cfg)
    assert named in str(refused.value)


# ---- the command line --------------------------------------------------------------------------------------------

FLAGS = ["--" + k for k in KEYS] + ["--backend", "--model", "--prompt-data", "--algo", "--output-dir", "--max-steps"]
tokens = st.one_of(st.sampled_from(FLAGS), st.sampled_from(["1", "-1", "0.5", "none", "true", "grpo", "cuda"]),
                   st.text(max_size=12)).filter(lambda t: not t.startswith(("-h", "--h")))  # --help exits 0
yaml_texts = st.one_of(
    st.text(max_size=60),
    st.dictionaries(st.sampled_from(["train", "rollout", "data", "model", "trian", "log"]),
                    st.dictionaries(st.sampled_from([k.partition(".")[2] for k in KEYS] + ["lr", "batch"]),
                                    json_values, max_size=3) | json_values, max_size=3).map(yaml.safe_dump),
)


@SETTINGS
@given(argv=st.lists(tokens, max_size=8), config=st.none() | yaml_texts)
def test_any_command_line_exits_non_zero_with_a_message(workdir, argv, config):
    from rlhf_sg.cli import main

    if config is not None:
        path = workdir[0] / "random.yaml"
        path.write_text(config)
        argv = ["--config", str(path), *argv]
    stderr = io.StringIO()
    with mock.patch("rlhf_sg.trainer.train", side_effect=AssertionError("bad input reached training")), \
            contextlib.redirect_stderr(stderr), pytest.raises(SystemExit) as stop:
        main(["train-ppo", *argv])
    code = stop.value.code
    assert code not in (0, None)
    message = code if isinstance(code, str) else stderr.getvalue()  # ours, or argparse's own usage error
    assert message.strip() and "Traceback" not in message


# ---- devices: the count agrees with the layout the run starts ------------------------------------------------------


@SETTINGS
@given(actor=st.integers(1, 4), critic=st.integers(1, 4), ref=st.integers(1, 4), engines=st.integers(1, 4),
       rm=st.integers(1, 4), algo=st.sampled_from(["gae", "grpo", "reinforce"]), kl=st.sampled_from([0.0, 0.1]),
       reward_model=st.booleans(), colocate=st.sampled_from(["", "all", "actor_ref", "critic_reward", "both"]),
       tp=st.integers(1, 4))
def test_devices_needed_matches_the_layout(workdir, actor, critic, ref, engines, rm, algo, kl, reward_model,
                                           colocate, tp):
    from rlhf_sg.trainer.layout import Layout

    cfg = Config()
    apply_overrides(cfg, base_overrides(workdir), "base")
    t, r = cfg.train, cfg.rollout
    t.actor_num_ranks, t.critic_num_ranks, t.ref_num_ranks, r.num_engines, cfg.reward.num_ranks = (
        actor, critic, ref, engines, rm)
    t.advantage_estimator, t.kl_coef, r.prompts_per_step, t.device = algo, kl, 16, "cuda"
    if reward_model:
        cfg.reward.kind, cfg.reward.function, cfg.model.reward_pretrain = "model", None, cfg.model.pretrain
    if colocate == "all":
        t.colocate_all, r.weight_transport = True, "tensor"  # NCCL cannot group two ranks on one GPU
        t.critic_num_ranks = t.ref_num_ranks = r.num_engines = cfg.reward.num_ranks = actor
    if colocate in ("actor_ref", "both"):
        t.colocate_actor_ref, t.ref_num_ranks, t.kl_coef = True, actor, 0.1
    if colocate in ("critic_reward", "both"):  # needs a critic and a reward model
        t.colocate_critic_reward, t.advantage_estimator, cfg.reward.num_ranks = True, "gae", critic
        cfg.reward.kind, cfg.reward.function, cfg.model.reward_pretrain = "model", None, cfg.model.pretrain
    try:
        validate(cfg)
    except ConfigError:
        assume(False)  # a layout the config refuses (e.g. colocating a group the run does not have)
    # one Ray bundle per device: the layout's bundle count is the device count with tensor_parallel_size 1
    assert devices_needed(cfg)[0] == Layout(cfg).cpus_needed()
    if not t.colocate_all:
        one = devices_needed(cfg)[0]
        r.tensor_parallel_size = tp
        assert devices_needed(cfg)[0] == one + r.num_engines * (tp - 1)
        check_devices(cfg, visible=one + r.num_engines * (tp - 1))  # exactly enough passes
        with pytest.raises(ConfigError, match="GPUs"):
            check_devices(cfg, visible=one + r.num_engines * (tp - 1) - 1)
