"""The backend registry: built-in names, entry-point plugins, ``module:Class`` specs, and its errors."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

import backends
from backends import BackendConfig, BackendError, SamplingParams
from backends.embedded import EmbeddedBackend

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(REPO, "recipes", "custom_backend.py")

USER_MODULE = """
from backends.base import RolloutBackend
from backends.embedded import EmbeddedBackend


class MyBackend(EmbeddedBackend):
    name = "mine"


class NotABackend:
    pass


class HalfBackend(RolloutBackend):  # generate() left abstract
    name = "half"
"""


def _run_python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_importing_backends_imports_no_engine():
    code = (
        "import sys, backends\n"
        "backends.get_backend_class('hf')\n"
        "engines = sorted({m.split('.')[0] for m in sys.modules} & {'sglang', 'vllm'})\n"
        "print('ENGINES', engines)\n"
    )
    result = _run_python(code)
    assert result.returncode == 0, result.stderr
    assert "ENGINES []" in result.stdout


@pytest.mark.parametrize("name", ["hf", "embedded", "HF", " hf "])
def test_builtin_embedded_engine_by_name_and_alias(name):
    assert backends.get_backend_class(name) is EmbeddedBackend


def test_available_backends_reports_every_builtin():
    status = backends.available_backends()
    assert {"hf", "sglang", "vllm"} <= set(status)
    assert status["hf"].startswith("available")
    assert all(s.startswith("available") or s.startswith("unavailable: ") for s in status.values()), status
    for engine in ("sglang", "vllm"):
        if importlib.util.find_spec(engine) is None:
            assert "not installed" in status[engine] and f"rlhf-sg[{engine}]" in status[engine]


def test_unknown_name_lists_what_is_available_and_why_not():
    with pytest.raises(BackendError) as err:
        backends.get_backend_class("sglangg")
    message = str(err.value)
    assert "unknown backend 'sglangg'" in message
    for name, status in backends.available_backends().items():
        assert f"{name}: {status}" in message
    assert "module:Class" in message and "embedded -> hf" in message


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_builtin_whose_engine_is_missing_says_so():
    with pytest.raises(BackendError, match=r"vllm.*not installed.*pip install"):
        backends.get_backend_class("vllm")


@pytest.mark.parametrize("bad", ["", "   ", None])
def test_empty_name_is_refused(bad):
    with pytest.raises(BackendError, match="non-empty"):
        backends.get_backend_class(bad)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "rlhf_test_user_backend.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "rlhf_test_user_backend", tmp_path / "rlhf_test_user_backend.py"
    sys.modules.pop("rlhf_test_user_backend", None)


def test_module_class_spec_loads_a_user_subclass(user_module):
    module, _ = user_module
    cls = backends.get_backend_class(f"{module}:MyBackend")
    assert issubclass(cls, EmbeddedBackend) and cls.name == "mine"


def test_file_path_spec_loads_the_recipe_once():
    first = backends.get_backend_class(f"{RECIPE}:HFGenerateBackend")
    assert first.name == "hf-generate" and first.transports == {"tensor", "disk"}
    assert backends.get_backend_class(f"{RECIPE}:HFGenerateBackend") is first


@pytest.mark.parametrize(
    "attr, match",
    [
        ("NotABackend", "not a subclass of backends.base.RolloutBackend"),
        ("HalfBackend", r"abstract method\(s\) \['generate'\]"),
        ("Missing", "has no attribute 'Missing'"),
    ],
)
def test_module_class_spec_errors(user_module, attr, match):
    module, _ = user_module
    with pytest.raises(BackendError, match=match):
        backends.get_backend_class(f"{module}:{attr}")


def test_spec_with_missing_module_or_file():
    with pytest.raises(BackendError, match=r"importing 'rlhf_no_such_module' failed \(package 'rlhf_no_such_module'"):
        backends.get_backend_class("rlhf_no_such_module:Backend")
    with pytest.raises(BackendError, match="does not exist"):
        backends.get_backend_class("recipes/no_such_file.py:Backend")


@pytest.fixture
def installed_plugins(tmp_path, monkeypatch):
    """A distribution on sys.path with entry points in the rlhf_sg.backends group."""
    (tmp_path / "rlhf_test_plugin_mod.py").write_text(
        "from backends.embedded import EmbeddedBackend\n\nclass PluginBackend(EmbeddedBackend):\n    name = 'plugged'\n"
    )
    dist_info = tmp_path / "rlhf_test_plugin-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: rlhf-test-plugin\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text(
        textwrap.dedent(
            """
            [rlhf_sg.backends]
            plugged = rlhf_test_plugin_mod:PluginBackend
            broken = rlhf_test_plugin_gone:Backend
            hf = rlhf_test_plugin_mod:PluginBackend
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("rlhf_test_plugin_mod", None)


def test_entry_point_plugins_are_found_and_reported(installed_plugins):
    cls = backends.get_backend_class("plugged")
    assert cls.name == "plugged" and issubclass(cls, EmbeddedBackend)
    status = backends.available_backends()
    assert status["plugged"] == "available"
    assert status["broken"].startswith("unavailable: plugin backend 'broken'")
    assert "ModuleNotFoundError" in status["broken"] and "rlhf-test-plugin" in status["broken"]
    # A plugin cannot take a built-in's name.
    assert backends.get_backend_class("hf") is EmbeddedBackend
    with pytest.raises(BackendError, match="failed to import: ModuleNotFoundError"):
        backends.get_backend_class("broken")
    with pytest.raises(BackendError) as err:
        backends.get_backend_class("nope")
    assert "plugged: available" in str(err.value) and "broken: unavailable" in str(err.value)


def test_create_backend_builds_a_working_engine(tmp_path, user_module):
    from rlhf_sg.tiny import save_tiny_model

    path = save_tiny_model(str(tmp_path / "model"), size="tiny")
    module, _ = user_module
    for name in ("hf", f"{module}:MyBackend"):
        engine = backends.create_backend(name, BackendConfig(model_path=path, num_threads=1))
        try:
            out = engine.generate([[1, 5, 6]], SamplingParams(n=2, max_new_tokens=4, seed=0))
            assert len(out) == 2 and all(len(c.token_ids) >= 1 for c in out)
        finally:
            engine.shutdown()


def test_custom_backend_recipe_runs():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, RECIPE], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "installed backends:" in result.stdout
    assert sum(line.strip().startswith(("length", "stop")) for line in result.stdout.splitlines()) == 2
