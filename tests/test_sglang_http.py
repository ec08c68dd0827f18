"""The SGLang backend's http mode against a real SGLang server that wants keys.

One ``sglang.launch_server`` in its CPU mode (``python -m backends.sglang_cpu.serve``, keys read from
environment variables) on a tiny Qwen2, started with both ``--api-key`` and ``--admin-api-key``.
Through the backend: generate, a weight sync (tensor transport over HTTP, inside SGLang's update
window) and a flush work with the right keys; with no key, the API key alone, or a wrong key, each
call fails with a message naming the server, the endpoint and the variable to set.

Runs in the SGLang venv (``recipes/install/sglang_cpu.sh``); skipped elsewhere.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch
from test_sglang_backend import PROMPTS as BACKEND_PROMPTS  # tests/ is on the path
from test_sglang_backend import TIMEOUT_S, _config, _hf, _hf_greedy, _trainer_logprobs

from backends.base import BackendConfig, BackendError, SamplingParams, WeightGroupSpec
from rlhf_sg.tiny import BOS_ID, build_tiny_model, save_tiny_model

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang not installed (sglang_cpu.sh)"),
    pytest.mark.slow,
]
PROMPTS = [[BOS_ID, 40, 41, 42, 43], [BOS_ID, 50, 12, 77, 13, 9, 20]]
API_VAR, ADMIN_VAR = "RLHF_SG_TEST_SGLANG_API_KEY", "RLHF_SG_TEST_SGLANG_ADMIN_KEY"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def keyed_server(model_path: str, log_dir, *server_args: str, api_var: str = API_VAR, admin_var: str = ADMIN_VAR):
    """(url, api key, admin key) of SGLang's own server (``backends.sglang_cpu.serve``) on a free port, started
    with fresh API and admin keys read from ``api_var`` / ``admin_var``, and ``server_args``; stopped on exit."""
    api_key, admin_key = "api-" + secrets.token_hex(12), "admin-" + secrets.token_hex(12)
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", **{api_var: api_key, admin_var: admin_key})
    cmd = [
        sys.executable, "-m", "backends.sglang_cpu.serve", "--api-key-env", api_var, "--admin-api-key-env", admin_var,
        "--model-path", model_path, "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
        "--dtype", "float32", "--attention-backend", "torch_native", "--skip-tokenizer-init", "--disable-cuda-graph",
        "--sleep-on-idle", "--log-level", "error", *server_args,
    ]  # fmt: skip
    log_path = log_dir / "server.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    try:
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:  # /health takes no key
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"SGLang server did not come up:\n{log_path.read_text()[-3000:]}")
            time.sleep(2)
        yield url, api_key, admin_key
    finally:
        _kill_group(proc)
        log.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(url, model_path, api_key, admin_key) of a server started with both keys."""
    model_path = save_tiny_model(str(tmp_path_factory.mktemp("sglang-http-keys")), arch="qwen2", size="tiny", seed=2)
    with keyed_server(model_path, tmp_path_factory.mktemp("sglang-http-keys-log"),
                      "--max-total-tokens", "4096", "--context-length", "256") as (url, api_key, admin_key):
        yield url, model_path, api_key, admin_key


def _kill_group(proc: subprocess.Popen) -> None:
    """The server and its scheduler / detokenizer children (its own process group)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=60)
            return
        except subprocess.TimeoutExpired:
            continue


def _backend(url: str, model_path: str, monkeypatch, api: str | None, admin: str | None):
    """An http-mode backend whose key variables hold ``api`` / ``admin`` (None: the variable is not named)."""
    from backends.sglang_backend import SGLangBackend

    extra = {"server_urls": [url], "request_timeout_s": 120}
    for var, name, value in ((API_VAR, "api_key_env", api), (ADMIN_VAR, "admin_api_key_env", admin)):
        monkeypatch.delenv(var, raising=False)
        if value is not None:
            monkeypatch.setenv(var, value)
            extra[name] = var
    config = BackendConfig(
        model_path=model_path, dtype="float32", max_model_len=256, seed=0, num_threads=1, extra=extra
    )
    return SGLangBackend(config)


def _raw(url: str, endpoint: str, key: str | None, body: dict | None = None) -> int:
    """The HTTP status of a bare POST (no backend), to show what the server itself enforces."""
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    req = urllib.request.Request(f"{url}/{endpoint}", data=json.dumps(body or {}).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _raw_server_info(url: str, key: str) -> dict:
    req = urllib.request.Request(f"{url}/get_server_info", headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def _sync(backend, seed: int, version: int):
    """One full weight sync of a fresh tiny Qwen2 (seed ``seed``) through the tensor transport; its model."""
    from rlhf_sg.sync import plan_buckets

    model = build_tiny_model("qwen2", "tiny", seed=seed)
    named = {n: p.detach().clone() for n, p in model.named_parameters()}
    (whole,) = plan_buckets([(n, t.shape, t.dtype) for n, t in named.items()], 1 << 30)
    backend.update_weights_from_tensor(whole, torch.cat([named[t.name].reshape(-1) for t in whole.tensors]))
    backend.finish_weight_update(version)
    return model


GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)


def test_the_server_enforces_both_levels(server):
    """What the backend must match: /generate takes the API key only, admin endpoints the admin key only."""
    url, _, api_key, admin_key = server
    gen = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 1}}
    assert [_raw(url, "generate", k, gen) for k in (None, admin_key, api_key)] == [401, 401, 200]
    assert [_raw(url, "flush_cache", k) for k in (None, api_key, admin_key)] == [401, 401, 200]
    # and any holder of the API key can read both keys back from the server's info (SGLang 0.5.23)
    info = _raw_server_info(url, api_key)
    assert (info.get("api_key"), info.get("admin_api_key")) == (api_key, admin_key)


def test_http_mode_generates_and_takes_a_collective_update(server, monkeypatch):
    """Before any test here changes the weights: sampled log-probs are the model's, then a collective update, a
    tensor update over HTTP and sleep / wake, through the backend with the right keys."""
    from backends.sglang_backend import SGLangBackend, open_weight_update_group
    from rlhf_sg.sync import plan_buckets

    url, model_path, api_key, admin_key = server
    backend_single = _backend(url, model_path, monkeypatch, api_key, admin_key)  # sets the key variables
    try:
        keys = {"api_key_env": API_VAR, "admin_api_key_env": ADMIN_VAR}
        with pytest.raises(BackendError, match="tensor_parallel_size=2.*sum 1"):
            SGLangBackend(_config(model_path, tensor_parallel_size=2, extra={"server_urls": [url], **keys}))
        assert backend_single.transports == frozenset({"collective", "tensor", "disk"})
        reference = _hf(model_path)
        out = backend_single.generate(BACKEND_PROMPTS, SamplingParams(n=2, temperature=0.7, max_new_tokens=8))
        assert [c.prompt_index for c in out] == [0, 0, 1, 1, 2, 2]
        for c in out:
            logp = _trainer_logprobs(reference, BACKEND_PROMPTS[c.prompt_index], c.token_ids, 0.7)
            torch.testing.assert_close(torch.tensor(c.logprobs), logp, atol=1e-4, rtol=0)

        new = build_tiny_model("qwen2", "tiny", seed=9)
        named = {n: p.detach().clone() for n, p in new.named_parameters()}
        plan = plan_buckets([(n, t.shape, t.dtype) for n, t in named.items()], 64 * 1024)
        port = _free_port()
        spec = WeightGroupSpec("127.0.0.1", port, 1, 2, "http_weights", "gloo", TIMEOUT_S)
        sender: dict = {}

        def send():
            try:
                import torch.distributed as dist

                group = open_weight_update_group(spec, 0)
                for manifest in plan:
                    flat = torch.cat([named[t.name].reshape(-1) for t in manifest.tensors])
                    opts = dist.BroadcastOptions()
                    opts.rootRank = 0
                    group.broadcast([flat], opts).wait()
                dist.destroy_process_group(group)
            except Exception as exc:
                sender["error"] = exc

        thread = threading.Thread(target=send, daemon=True)
        thread.start()
        backend_single.init_weight_update_group(spec)
        for manifest in plan:
            backend_single.update_weights_from_collective(manifest, 0)
        backend_single.finish_weight_update(1)
        thread.join(TIMEOUT_S)
        backend_single.destroy_weight_update_group()
        assert "error" not in sender, sender
        greedy = backend_single.generate(BACKEND_PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=8))
        assert [c.token_ids for c in greedy] == [_hf_greedy(new, p, 8) for p in BACKEND_PROMPTS]
        assert all(c.weight_version == 1 for c in greedy)
        # The tensor transport over HTTP: the same per-TP-rank payloads, base64 in the request, opened by
        # the server's scheduler from this process's shared memory.
        other = _sync(backend_single, seed=10, version=2)
        greedy = backend_single.generate(BACKEND_PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=8))
        assert [c.token_ids for c in greedy] == [_hf_greedy(other, p, 8) for p in BACKEND_PROMPTS]
        backend_single.sleep()
        backend_single.wake()
        again = backend_single.generate(BACKEND_PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=8))
        assert again[0].token_ids == greedy[0].token_ids
    finally:
        backend_single.shutdown()


def test_right_keys_generate_sync_and_flush(server, monkeypatch):
    url, model_path, api_key, admin_key = server
    backend = _backend(url, model_path, monkeypatch, api_key, admin_key)
    try:
        info = backend._driver.server_info  # what the backend keeps of the servers' info: no key
        assert int(info["tp_size"]) == 1 and api_key not in json.dumps(info) and admin_key not in json.dumps(info)
        out = backend.generate(PROMPTS, SamplingParams(n=2, temperature=0.7, max_new_tokens=6))
        assert [c.prompt_index for c in out] == [0, 0, 1, 1]
        new = _sync(backend, seed=9, version=1)
        greedy = backend.generate(PROMPTS, GREEDY)
        assert [c.token_ids for c in greedy] == [_hf_greedy(new, p, 6) for p in PROMPTS]
        assert all(c.weight_version == 1 for c in greedy)
        backend.reset_prefix_cache()  # SGLang's standalone /flush_cache
        assert [c.token_ids for c in backend.generate(PROMPTS, GREEDY)] == [c.token_ids for c in greedy]
        assert api_key not in repr(backend._driver) and admin_key not in repr(backend._driver)
    finally:
        backend.shutdown()


def test_no_key_names_the_server_endpoint_and_variable(server, monkeypatch):
    url, model_path, _, _ = server
    with pytest.raises(BackendError, match=rf"{url}: GET /get_server_info answered 401.*extra\['api_key_env'\]"):
        _backend(url, model_path, monkeypatch, None, None)


def test_api_key_alone_generates_but_admin_calls_name_the_admin_variable(server, monkeypatch):
    url, model_path, api_key, _ = server
    backend = _backend(url, model_path, monkeypatch, api_key, None)
    try:
        assert len(backend.generate(PROMPTS, GREEDY)) == 2
        admin_error = rf"{url}: POST /(pause_generation|flush_cache) answered 401 \(an admin endpoint.*--admin-api-key"
        with pytest.raises(BackendError, match=admin_error + r".*extra\['admin_api_key_env'\]"):
            _sync(backend, seed=9, version=1)
        with pytest.raises(BackendError, match=admin_error):
            backend.reset_prefix_cache()
    finally:
        backend.shutdown()


def test_wrong_keys_name_the_variable_that_holds_them(server, monkeypatch):
    url, model_path, api_key, admin_key = server
    with pytest.raises(BackendError, match=rf"/get_server_info answered 401.*{API_VAR} \(extra\['api_key_env'\]\) was "
                       "refused") as err:  # fmt: skip
        _backend(url, model_path, monkeypatch, "wrong-" + api_key, admin_key)
    assert api_key not in str(err.value)
    backend = _backend(url, model_path, monkeypatch, api_key, "wrong-" + admin_key)
    try:
        with pytest.raises(BackendError, match=rf"/pause_generation answered 401.*{ADMIN_VAR} .*was refused") as err:
            _sync(backend, seed=9, version=1)
        assert admin_key not in str(err.value) and api_key not in str(err.value)
        assert len(backend.generate(PROMPTS, GREEDY)) == 2  # generation still works (it takes the API key)
    finally:
        backend.shutdown()
