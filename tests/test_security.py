"""Secure by default, for the remote reward and the run's records.

* The remote reward sends a bearer token read from the environment variable ``--reward.token_env``
  names, checks TLS certificates (a private CA through ``--reward.ca_file``), follows no redirect
  (it would carry the token elsewhere), and turns a 401 / 403 into a message naming the variable.
* The config refuses a token in place of a variable name, and never echoes it.
* A real training run whose remote reward needs a token leaves the token nowhere: not in the output
  directory (config.json, metrics, TensorBoard, checkpoints), the logs, stdout / stderr, the config
  handed to W&B or Ray's session logs.

The servers are Python's own ``http.server`` in a thread (an HTTPS one with a self-signed
certificate made by the ``openssl`` command).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import ssl
import subprocess
import sys
import threading
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rlhf_sg.config import ConfigError, parse_args
from rlhf_sg.rewards import RewardError, remote_reward
from rlhf_sg.tiny import save_tiny_model

RECIPES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes")
TOKEN_VAR = "RLHF_SG_TEST_REWARD_TOKEN"


class _Scorer:
    """A reward server: scores ``len(completion)``, answers 401 unless the bearer token matches
    (when it has one), and records every request's path and Authorization header."""

    def __init__(self, token: str | None, tls: ssl.SSLContext | None = None, redirect_to: str | None = None):
        self.token, self.seen = token, []
        scorer = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, code: int, payload: dict | None = None, headers: dict | None = None) -> None:
                body = json.dumps(payload or {}).encode()
                self.send_response(code)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                scorer.seen.append((self.command, self.path, self.headers.get("Authorization")))
                if redirect_to is not None:
                    return self._answer(302, headers={"Location": redirect_to})
                if scorer.token is not None and self.headers.get("Authorization") != f"Bearer {scorer.token}":
                    return self._answer(401, {"error": "Unauthorized"})
                scorer.score(body)
                self._answer(200, {"rewards": [float(len(c)) for c in body["completions"]]})

            do_POST = do_GET = _handle

            def log_message(self, *args):  # keep the test output quiet
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if tls is not None:
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        scheme = "https" if tls is not None else "http"
        self.url = f"{scheme}://localhost:{self.server.server_address[1]}/score"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def score(self, body: dict) -> None:
        pass

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def scorer(request):
    servers = []

    def make(*args, **kwargs):
        servers.append(_Scorer(*args, **kwargs))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


@pytest.fixture
def token(monkeypatch):
    value = "tok-" + secrets.token_hex(16)
    monkeypatch.setenv(TOKEN_VAR, value)
    return value


def _call(url, **kw):
    return remote_reward(url, ["p1", "p2"], ["ab", "abcd"], [None, None], 10.0, **kw)


# ---- bearer token ----------------------------------------------------------------------------------
def test_token_from_the_named_variable_is_sent_as_bearer(scorer, token):
    server = scorer(token)
    assert _call(server.url, token_env=TOKEN_VAR) == [2.0, 4.0]
    assert server.seen == [("POST", "/score", f"Bearer {token}")]


def test_no_token_env_sends_no_authorization_header(scorer):
    server = scorer(None)
    assert _call(server.url) == [2.0, 4.0]
    assert server.seen == [("POST", "/score", None)]


def test_refused_without_token_says_which_flag_to_set(scorer, token):
    server = scorer(token)
    with pytest.raises(RewardError, match=r"answered 401.*--reward\.token_env"):
        _call(server.url)


def test_wrong_token_names_the_variable_never_the_value(scorer, token, monkeypatch):
    server = scorer(token)
    monkeypatch.setenv(TOKEN_VAR, "not-the-token")
    with pytest.raises(RewardError, match=rf"answered 401.*environment variable {TOKEN_VAR}") as err:
        _call(server.url, token_env=TOKEN_VAR)
    assert "not-the-token" not in str(err.value) and token not in str(err.value)


def test_unset_variable_is_named_before_any_request(scorer, monkeypatch):
    server = scorer("x")
    monkeypatch.delenv(TOKEN_VAR, raising=False)
    with pytest.raises(RewardError, match=rf"{TOKEN_VAR}, which is not set"):
        _call(server.url, token_env=TOKEN_VAR)
    assert server.seen == []


def test_redirect_is_refused_and_the_token_goes_nowhere_else(scorer, token):
    """urllib would follow a 302 to another host with the Authorization header."""
    elsewhere = scorer(None)
    redirector = scorer(token, redirect_to=elsewhere.url)
    with pytest.raises(RewardError, match=r"302.*redirects are not followed"):
        _call(redirector.url, token_env=TOKEN_VAR)
    assert elsewhere.seen == []


def test_token_over_plain_http_to_another_host_warns(caplog, token):
    """0.0.0.0 is not loopback; the connection fails at once, after the warning."""
    with caplog.at_level(logging.WARNING, logger="rlhf_sg.rewards"), pytest.raises(RewardError):
        _call("http://0.0.0.0:9/score", token_env=TOKEN_VAR)
    assert "plain http" in caplog.text and token not in caplog.text


# ---- TLS -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def self_signed(tmp_path_factory):
    """(cert.pem, key.pem) of a self-signed certificate for localhost / 127.0.0.1."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    d = tmp_path_factory.mktemp("tls")
    cert, key = str(d / "cert.pem"), str(d / "key.pem")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert, "-days", "1",
         "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


def _tls(cert, key) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    return ctx


def test_self_signed_certificate_is_refused_by_default(scorer, token, self_signed):
    server = scorer(token, tls=_tls(*self_signed))
    with pytest.raises(RewardError, match=r"TLS certificate failed verification.*--reward\.ca_file"):
        _call(server.url, token_env=TOKEN_VAR)
    assert server.seen == []  # the token never left: the handshake failed first


def test_ca_file_makes_a_private_ca_pass(scorer, token, self_signed):
    server = scorer(token, tls=_tls(*self_signed))
    assert _call(server.url, token_env=TOKEN_VAR, ca_file=self_signed[0]) == [2.0, 4.0]
    assert server.seen == [("POST", "/score", f"Bearer {token}")]


# ---- the config --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(str(tmp_path_factory.mktemp("m")))


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    return str(path)


def _remote(model_dir, prompts_file, url="https://scorer.example/score"):
    return ["--model", model_dir, "--prompt-data", prompts_file, "--reward.kind", "remote", "--reward.url", url]


def test_config_takes_a_variable_name_and_refuses_a_token(model_dir, prompts_file, token, tmp_path):
    cfg = parse_args(_remote(model_dir, prompts_file) + ["--reward.token_env", TOKEN_VAR])
    assert cfg.reward.token_env == TOKEN_VAR and token not in json.dumps(cfg.to_dict())
    looks_like_a_token = "sk-live-" + secrets.token_hex(8)
    with pytest.raises(ConfigError, match=r"NAME of an environment variable") as err:
        parse_args(_remote(model_dir, prompts_file) + ["--reward.token_env", looks_like_a_token])
    assert looks_like_a_token not in str(err.value)


def test_config_errors_name_the_missing_pieces(model_dir, prompts_file, monkeypatch, tmp_path):
    monkeypatch.delenv(TOKEN_VAR, raising=False)
    base = _remote(model_dir, prompts_file)
    cases = [
        (base + ["--reward.token_env", TOKEN_VAR], rf"{TOKEN_VAR} is not set"),
        (base + ["--reward.ca_file", str(tmp_path / "none.pem")], r"--reward\.ca_file: .* is not a file"),
        (_remote(model_dir, prompts_file, "http://scorer/score") + ["--reward.ca_file", prompts_file],
         r"--reward\.ca_file needs an https"),
        (["--model", model_dir, "--prompt-data", prompts_file, "--reward.function", "m:f", "--reward.token_env",
          TOKEN_VAR], r"remote only"),
    ]  # fmt: skip
    for argv, message in cases:
        with pytest.raises(ConfigError, match=message):
            parse_args(argv)


def test_engine_keys_typed_into_the_config_are_refused_before_it_is_saved(model_dir, prompts_file):
    """config.json is written before any engine starts: a key in --rollout.engine_kwargs is refused by the
    config's own validation, naming the *_env setting to use instead, and the key is not echoed."""
    key = secrets.token_hex(8)
    for literal in ("api_key", "admin_api_key"):
        argv = ["--model", model_dir, "--prompt-data", prompts_file, "--reward.function", "m:f",
                "--rollout.engine_kwargs", json.dumps({literal: key})]
        with pytest.raises(ConfigError, match=rf"engine_kwargs\['{literal}'\]: keys never go in the config.*"
                                              rf"engine_kwargs\['{literal}_env'\]") as err:
            parse_args(argv)
        assert key not in str(err.value)


# ---- a real run leaves the token nowhere -------------------------------------------------------------
@pytest.mark.slow
def test_a_run_with_a_token_leaves_it_nowhere(scorer, token, tmp_path, capfd, monkeypatch):
    """rlhf_sg.trainer.train on the quickstart's task, its reward from a server that wants the token."""
    sys.path.insert(0, RECIPES)
    import arith_task
    from quickstart_cpu import make_config, prepare

    from rlhf_sg.trainer import train

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([RECIPES, os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    server = scorer(token)
    scored = []
    server.score = lambda body: scored.append(len(body["completions"]))
    policy, prompts = prepare(str(tmp_path / "task"), warm_start_steps=2)
    out = tmp_path / "run"
    cfg = make_config(policy, prompts, str(out), steps=2, algo="grpo", backend="hf")
    cfg.rollout.prompts_per_step, cfg.rollout.n_samples_per_prompt = 4, 2
    cfg.train.actor_num_ranks = 1  # every group's ranks get the same environment; one rank shows where it goes
    cfg.reward.kind, cfg.reward.function, cfg.reward.url = "remote", None, server.url
    cfg.reward.token_env = TOKEN_VAR
    cfg.log.progress_bar, cfg.log.export_hf, cfg.log.save_steps = False, True, 1
    cfg.log.tensorboard, cfg.log.wandb_project = True, "secrets-test"
    wandb_seen = []  # the W&B client is a boundary we cannot run here: record what it is handed
    fake_wandb = types.SimpleNamespace(
        init=lambda project, config: wandb_seen.append(json.dumps(config, default=str)),
        log=lambda metrics, step: wandb_seen.append(json.dumps(metrics, default=str)),
        finish=lambda *a, **k: None,
    )
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb)
    records = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: records.append(f"{record.getMessage()} {record.exc_text or ''}")
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        history = train(cfg, reward_fn=arith_task.addition_reward)
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
    assert len(history) == 2
    assert sum(scored) == 2 * 4 * 2  # the reward came from the server, through the token
    assert {auth for _, _, auth in server.seen} == {f"Bearer {token}"}

    leaks = []
    needle = token.encode()
    files = [p for p in out.rglob("*") if p.is_file()]
    assert any(p.name == "config.json" for p in files) and any("tfevents" in p.name for p in files)
    assert any(p.name.endswith(".trainer.json") for p in files)  # a checkpoint was written (--log.save_steps 1)
    assert any(p.suffix == ".safetensors" for p in files)  # and the exported model (--log.export_hf)
    leaks += [str(p) for p in files if needle in p.read_bytes()]
    ray_logs = os.path.realpath("/tmp/ray/session_latest/logs")
    if os.path.isdir(ray_logs):
        for root_dir, _, names in os.walk(ray_logs):
            for name in names:
                path = os.path.join(root_dir, name)
                try:
                    with open(path, "rb") as f:
                        if needle in f.read():
                            leaks.append(path)
                except OSError:
                    pass
    captured = capfd.readouterr()
    leaks += [what for what, text in (("stdout", captured.out), ("stderr", captured.err),
                                      ("log records", "\n".join(records)), ("W&B", "\n".join(wandb_seen)))
              if token in text]  # fmt: skip
    assert wandb_seen and records
    assert leaks == [], f"the token appears in {leaks}"


# ---- SGLang http mode: keys come from named variables only (no server needed) -------------------------
def test_sglang_backend_refuses_literal_keys_and_unset_variables(tmp_path, monkeypatch):
    from backends.base import BackendConfig, BackendError
    from backends.sglang_backend import SGLangBackend

    def config(**extra):
        return BackendConfig(model_path=str(tmp_path), extra=extra)

    monkeypatch.delenv(TOKEN_VAR, raising=False)
    url = ["http://127.0.0.1:9"]
    cases = [
        (config(server_urls=url, api_key="k-123"), r"extra\['api_key'\]: keys never go in the config.*api_key_env"),
        (config(server_urls=url, admin_api_key="k-123"), r"extra\['admin_api_key'\].*admin_api_key_env"),
        (config(server_urls=url, api_key_env=TOKEN_VAR), rf"names environment variable {TOKEN_VAR}, which is not set"),
        (config(server_urls=url, admin_api_key_env="sk-live-abc"), r"NAME of an environment variable"),
        (config(api_key_env=TOKEN_VAR), r"extra\['api_key_env'\] needs extra\['server_urls'\]"),
    ]
    for cfg, message in cases:
        with pytest.raises(BackendError, match=message) as err:
            SGLangBackend(cfg)
        assert "k-123" not in str(err.value) and "sk-live-abc" not in str(err.value)


def test_server_launcher_refuses_keys_on_its_command_line():
    """A key in argv is readable by every local user (ps) and lands in shell history."""
    # both at once: each is an interpreter's start-up
    runs = [subprocess.Popen([sys.executable, "-m", "backends.sglang_cpu.serve", "--model-path", "m", *argv],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for argv in (["--api-key", "k-123"], ["--admin-api-key=k-123"])]
    for run in runs:
        _, stderr = run.communicate(timeout=60)
        assert run.returncode != 0 and "keys do not go on the command line" in stderr, stderr
