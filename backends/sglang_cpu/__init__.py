"""SGLang's CPU mode from PyPI packages alone: two small shims and the switch that turns them on.

SGLang 0.5.23 runs on CPU when ``SGLANG_USE_CPU_ENGINE=1`` is set, but its official CPU path needs
a CPU build of its kernel package (``sgl_kernel``, not on PyPI), and the torchvision on PyPI is
built against a CUDA torch. Two shims close the gap; both live in ``shims/`` beside this file and
must be active in *every* process SGLang starts (its scheduler and detokenizer are spawned
children, the engine itself runs in a Ray actor):

* ``shims/sgl_kernel``: a stand-in kernel package that registers no torch operators, so SGLang's
  ``cpu_has_amx_support()`` stays False and its layers run their plain-torch ``forward_native``.
  It names the kernels SGLang imports at module level (none is called by plain decoding, weight
  updates or memory release); calling one raises, naming the feature that needs real kernels.
* ``shims/rlhf_sg_sglang_cpu_hook.py``: defines the ``torchvision::nms`` / ``qnms`` operator
  schemas just before torchvision is first imported, when torchvision's own library cannot.

``install()`` (run by ``recipes/install/sglang_cpu.sh``, or ``python -m backends.sglang_cpu
install``) writes a ``.pth`` file into the venv's site-packages that puts ``shims/`` on the path and
imports the hook, so every interpreter of that venv starts with both shims in place.
``cpu_mode_problems()`` says what is missing; the SGLang backend calls it before starting an engine
on CPU and refuses to start with a message naming the fix.

The vLLM venv needs the torchvision hook alone (vLLM's Qwen-VL code imports torchvision; the stand-in
``sgl_kernel`` must stay off its path, vLLM imports a real one where it finds it):
``install_torchvision_hook()`` (``python -m backends.sglang_cpu torchvision-hook``, run by
``recipes/install/vllm_cpu.sh``) writes a ``.pth`` file that loads the hook from its file only.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import sysconfig
from pathlib import Path

__all__ = ["CPU_ENGINE_ENV", "HOOK_MODULE", "PTH_NAME", "SHIM_DIR", "TORCHVISION_PTH_NAME", "cpu_mode_problems",
           "hook_active", "install", "install_torchvision_hook"]

SHIM_DIR = Path(__file__).resolve().parent / "shims"
HOOK_MODULE = "rlhf_sg_sglang_cpu_hook"
PTH_NAME = "rlhf_sg_sglang_cpu.pth"
TORCHVISION_PTH_NAME = "rlhf_sg_torchvision.pth"
#: environment SGLang's CPU mode needs in the engine process (inherited by its children)
CPU_ENGINE_ENV = {"SGLANG_USE_CPU_ENGINE": "1", "HF_HUB_OFFLINE": "1"}
INSTALL_HINT = "bash recipes/install/sglang_cpu.sh (or: python -m backends.sglang_cpu install, in the SGLang venv)"


def pth_text() -> str:
    """The ``.pth`` file's lines: the shim directory, then the hook's import (site runs it at start-up)."""
    return f"{SHIM_DIR}\nimport {HOOK_MODULE}\n"


def install(site_packages: str | os.PathLike | None = None) -> Path:
    """Write ``rlhf_sg_sglang_cpu.pth`` into ``site_packages`` (default: this interpreter's purelib).

    Returns the path written. Idempotent; it overwrites an older copy (e.g. from a moved checkout).
    """
    target_dir = Path(site_packages) if site_packages is not None else Path(sysconfig.get_paths()["purelib"])
    if not target_dir.is_dir():
        raise FileNotFoundError(f"site-packages directory {target_dir} does not exist")
    path = target_dir / PTH_NAME
    path.write_text(pth_text())
    return path


def torchvision_pth_text() -> str:
    """The ``.pth`` line that imports the hook module from its file (``shims/`` stays off the path)."""
    hook = str(SHIM_DIR / f"{HOOK_MODULE}.py")
    return (f"import importlib.util as _u, sys as _s; _p = _u.spec_from_file_location({HOOK_MODULE!r}, {hook!r}); "
            "_m = _u.module_from_spec(_p); _s.modules[_p.name] = _m; _p.loader.exec_module(_m)\n")


def install_torchvision_hook(site_packages: str | os.PathLike | None = None) -> Path:
    """Write ``rlhf_sg_torchvision.pth`` into ``site_packages`` (default: this interpreter's purelib): the
    torchvision operator hook alone, at every interpreter start. Returns the path written; idempotent."""
    target_dir = Path(site_packages) if site_packages is not None else Path(sysconfig.get_paths()["purelib"])
    if not target_dir.is_dir():
        raise FileNotFoundError(f"site-packages directory {target_dir} does not exist")
    path = target_dir / TORCHVISION_PTH_NAME
    path.write_text(torchvision_pth_text())
    return path


def hook_active() -> bool:
    """True when this interpreter started with the hook loaded and the stand-in kernel package on its path."""
    if HOOK_MODULE not in sys.modules:
        return False
    spec = importlib.util.find_spec("sgl_kernel")
    return spec is not None and spec.origin is not None and Path(spec.origin).resolve().is_relative_to(SHIM_DIR)


def cpu_mode_problems() -> list[str]:
    """What stops SGLang's CPU mode in this interpreter; empty when it is ready.

    Checked: the hook was loaded at start-up (so spawned children get it too) and resolves
    ``sgl_kernel`` to the stand-in, and no other ``sgl_kernel`` (a CUDA build) shadows it.
    """
    problems = []
    spec = importlib.util.find_spec("sgl_kernel")
    if spec is not None and spec.origin is not None and not Path(spec.origin).resolve().is_relative_to(SHIM_DIR):
        problems.append(
            f"a real sgl_kernel package is installed at {Path(spec.origin).parent} (a CUDA build); SGLang's CPU "
            "mode needs the stand-in from backends/sglang_cpu/shims: uninstall sgl-kernel / sglang-kernel from "
            "this venv or use one made by recipes/install/sglang_cpu.sh"
        )
    elif HOOK_MODULE not in sys.modules:
        problems.append(
            f"the SGLang CPU-mode hook is not installed in this interpreter ({sys.executable}): no {PTH_NAME} in "
            f"its site-packages; run {INSTALL_HINT}"
        )
    return problems


def main(argv: list[str] | None = None) -> None:
    """``python -m backends.sglang_cpu install [SITE_PACKAGES]`` | ``check``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["install"] and len(argv) <= 2:
        path = install(argv[1] if len(argv) == 2 else None)
        print(f"wrote {path}: puts {SHIM_DIR} on the path and imports {HOOK_MODULE} at interpreter start")
    elif argv[:1] == ["torchvision-hook"] and len(argv) <= 2:
        path = install_torchvision_hook(argv[1] if len(argv) == 2 else None)
        print(f"wrote {path}: imports {HOOK_MODULE} (the torchvision operator schemas) at interpreter start")
    elif argv == ["check"]:
        problems = cpu_mode_problems()
        print("SGLang CPU mode: ready" if not problems else "SGLang CPU mode: not ready\n- " + "\n- ".join(problems))
        raise SystemExit(1 if problems else 0)
    else:
        raise SystemExit("usage: python -m backends.sglang_cpu install [SITE_PACKAGES] | torchvision-hook "
                         "[SITE_PACKAGES] | check")
