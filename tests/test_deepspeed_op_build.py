"""The suite's build of DeepSpeed's CPU communication op (``deepspeed_ops.py``, ``conftest.py``): stopped, it leaves
no torch extension lock behind; it starts only in a session whose selected tests include slow ones."""

from __future__ import annotations

import os
import time
import types

import psutil
import torch
from deepspeed_ops import finish_build, start_build

pytest_plugins = ["pytester"]

#: a small torch extension: its build takes torch's lock as DeepSpeed's does, and compiles for seconds
_PROBE_BUILD = ("import torch.utils.cpp_extension as ext; ext.load_inline('lockprobe', '#include <torch/extension.h>\\n"
                "int one() { return 1; }', functions=['one'])")


def test_a_build_stopped_midway_leaves_no_lock(tmp_path):
    """The session stops a build still running at its end; torch's ``lock`` must go with it, else every later
    build waits on it forever (the old SIGKILL left it: the next build then waited on it)."""
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "extensions"))
    lock = tmp_path / "extensions" / "lockprobe" / "lock"
    process = start_build(str(tmp_path / "build.log"), code=_PROBE_BUILD, env=env)
    build, compiling = psutil.Process(process.pid), []
    deadline = time.monotonic() + 120
    while not (lock.exists() and compiling) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
        compiling = build.children(recursive=True)  # ninja, and the compiler once it started
    assert lock.exists() and compiling, (process.poll(), (tmp_path / "build.log").read_text()[-2000:])
    code = finish_build(process, timeout_s=0, stop_s=60)
    assert code == "stopped after 0 s" and process.returncode is not None
    assert not lock.exists(), (tmp_path / "build.log").read_text()[-2000:]
    assert not [p.cmdline() for p in compiling if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def _started_op_builds(pytester, monkeypatch, *args) -> int:
    """How many times an inner session with the suite's collection hooks starts the op build (not run: counted)."""
    import conftest as suite

    started = []
    monkeypatch.setattr(suite, "_start_op_build", lambda config: started.append(config))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    hooks = types.SimpleNamespace(**{name: getattr(suite, name) for name in dir(suite)
                                     if name.startswith("pytest_collection")})
    pytester.makeini("[pytest]\nmarkers =\n    slow: long-running\n    gpu: needs a CUDA device\n")
    pytester.makepyfile(test_tiers="import pytest\n\ndef test_fast():\n    pass\n\n\n"
                                   "@pytest.mark.slow\ndef test_slow():\n    pass\n")
    result = pytester.inline_run("-p", "no:cacheprovider", "-p", "no:hypothesispytest", *args, plugins=[hooks])
    assert result.ret == 0
    return len(started)


def test_the_build_starts_only_when_slow_tests_are_selected(pytester, monkeypatch):
    assert _started_op_builds(pytester, monkeypatch) == 1  # both tiers
    assert _started_op_builds(pytester, monkeypatch, "-m", "not slow") == 0  # the fast tier alone
    assert _started_op_builds(pytester, monkeypatch, "-m", "slow") == 0  # its first test builds it



def test_each_python_environment_builds_torch_extensions_in_a_directory_of_its_own(monkeypatch, tmp_path):
    """The SGLang and vLLM suites run in venvs of their own beside the main one: sharing torch's extension
    directory, each venv's first DeepSpeed process group rebuilt the op the other had built (the build's command
    names the sources by their venv's path). One directory per environment; a directory the user set is kept."""
    import sys

    from torch.utils.cpp_extension import _get_build_directory

    from rlhf_sg.distributed import pin_torch_extensions_dir

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "mine"))
    assert pin_torch_extensions_dir() == str(tmp_path / "mine")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # torch's default root, here
    seen = []
    for prefix in ("/opt/venv-a", "/opt/venv-b", "/opt/venv-a"):
        monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
        monkeypatch.setattr(sys, "prefix", prefix)
        path = pin_torch_extensions_dir()
        assert os.environ["TORCH_EXTENSIONS_DIR"] == path  # inherited by the processes started from here
        assert _get_build_directory("deepspeed_shm_comm", False) == os.path.join(path, "deepspeed_shm_comm")
        seen.append(path)
    assert seen[0] != seen[1] and seen[0] == seen[2]
    assert os.path.dirname(seen[0]) == str(tmp_path / "cache" / "torch_extensions")
