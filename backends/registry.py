"""Find a rollout backend class by name.

A name is one of:

* a built-in: ``"hf"`` (the embedded engine; alias ``"embedded"``), ``"sglang"``, ``"vllm"``;
* a plugin installed under the entry-point group ``"rlhf_sg.backends"``
  (``[project.entry-points."rlhf_sg.backends"] myengine = "mypkg.backend:MyBackend"``);
* ``"module:Class"`` or ``"path/to/file.py:Class"``: a user's own :class:`RolloutBackend` subclass.

Built-ins are imported only when asked for, so ``import backends`` never imports an engine package.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import sys

import torch

from backends.base import BackendConfig, BackendError, RolloutBackend

__all__ = ["ENTRY_POINT_GROUP", "available_backends", "create_backend", "get_backend_class"]

ENTRY_POINT_GROUP = "rlhf_sg.backends"

#: built-in name -> (``module:Class`` of our backend, engine package it needs or None, pip extra)
_BUILTINS: dict[str, tuple[str, str | None, str | None]] = {
    "hf": ("backends.embedded:EmbeddedBackend", None, None),
    "sglang": ("backends.sglang_backend:SGLangBackend", "sglang", "sglang"),
    "vllm": ("backends.vllm_backend:VLLMBackend", "vllm", "vllm"),
}
_ALIASES = {"embedded": "hf"}


def get_backend_class(name: str) -> type[RolloutBackend]:
    """The backend class for ``name`` (built-in, plugin, or ``module:Class``); BackendError if none.

    The error for an unknown or unloadable name lists every known backend and why each one that
    cannot load does not (engine package missing, import error, ...).
    """
    if not isinstance(name, str) or not name.strip():
        raise BackendError(f"backend name must be a non-empty string, got {name!r}; {_listing()}")
    key = name.strip()
    canonical = _ALIASES.get(key.lower(), key.lower())
    if canonical in _BUILTINS:
        return _load_builtin(canonical)
    plugins = _entry_points()
    if key in plugins:
        return _load_plugin(key, plugins[key])
    if ":" in key:
        return _load_spec(key)
    raise BackendError(f"unknown backend {name!r}; {_listing()}")


def create_backend(name: str, config: BackendConfig) -> RolloutBackend:
    """Build the backend ``name`` from ``config``."""
    return get_backend_class(name)(config)


def available_backends() -> dict[str, str]:
    """Every built-in and installed plugin backend -> ``"available"`` or ``"unavailable: <why>"``.

    Built-ins whose engine package is installed, and every plugin, are imported to find out
    (once per process; the import system keeps them). Aliases are not listed.
    """
    status = {}
    for name in _BUILTINS:
        try:
            cls = _load_builtin(name)
        except BackendError as exc:
            status[name] = f"unavailable: {exc}"
            continue
        status[name] = "available"
        if name == "hf" and not torch.cuda.is_available():
            status[name] = "available (CPU only: torch sees no CUDA device)"
        status[name] += (f"; takes images ({cls.image_models})" if cls.supports_images else "; text only")
    for name, entry_point in _entry_points().items():
        try:
            _load_plugin(name, entry_point)
            status[name] = "available"
        except BackendError as exc:
            status[name] = f"unavailable: {exc}"
    return status


def _listing() -> str:
    lines = [f"  {name}: {status}" for name, status in available_backends().items()]
    aliases = ", ".join(f"{a} -> {c}" for a, c in _ALIASES.items())
    return (
        "known backends:\n" + "\n".join(lines) + f"\n  (aliases: {aliases}; or give 'module:Class' / "
        "'path/to/file.py:Class' for your own RolloutBackend subclass)"
    )


def _load_builtin(name: str) -> type[RolloutBackend]:
    spec, package, extra = _BUILTINS[name]
    if package is not None and importlib.util.find_spec(package) is None:
        raise BackendError(f"engine package {package!r} is not installed (pip install 'rlhf-sg[{extra}]')")
    module_name = spec.split(":")[0]
    if importlib.util.find_spec(module_name) is None:
        raise BackendError(f"module {module_name} is not part of this install")
    return _load_spec(spec, what=f"built-in backend {name!r}")


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    """Plugins by name; a plugin may not take a built-in name or alias."""
    found = {}
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if entry_point.name.lower() in _BUILTINS or entry_point.name.lower() in _ALIASES:
            continue
        found.setdefault(entry_point.name, entry_point)
    return found


def _load_plugin(name: str, entry_point: importlib.metadata.EntryPoint) -> type[RolloutBackend]:
    dist = getattr(entry_point.dist, "name", "?")
    what = f"plugin backend {name!r} ({entry_point.value} from distribution {dist})"
    try:
        cls = entry_point.load()
    except Exception as exc:
        raise BackendError(f"{what} failed to import: {type(exc).__name__}: {exc}") from exc
    return _check_subclass(cls, what)


def _load_spec(spec: str, what: str | None = None) -> type[RolloutBackend]:
    """Load ``module:Class`` or ``path/to/file.py:Class``."""
    module_part, _, attr = spec.rpartition(":")
    what = what or f"backend {spec!r}"
    if not module_part or not attr:
        raise BackendError(f"{what}: expected 'module:Class' or 'path/to/file.py:Class'")
    try:
        if module_part.endswith(".py") or os.sep in module_part or "/" in module_part:
            module = _import_file(module_part)
        else:
            module = importlib.import_module(module_part)
    except BackendError:
        raise
    except Exception as exc:
        missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
        hint = f" (package {missing!r} is not installed)" if missing else ""
        raise BackendError(f"{what}: importing {module_part!r} failed{hint}: {type(exc).__name__}: {exc}") from exc
    try:
        cls = getattr(module, attr)
    except AttributeError:
        public = sorted(n for n in vars(module) if not n.startswith("_"))
        raise BackendError(f"{what}: module {module_part!r} has no attribute {attr!r} (it has {public[:10]})") from None
    return _check_subclass(cls, what)


def _import_file(path: str):
    if not os.path.isfile(path):
        raise BackendError(f"backend file {path!r} does not exist (cwd: {os.getcwd()})")
    path = os.path.abspath(path)
    module_name = "rlhf_sg_user_backend_" + os.path.splitext(os.path.basename(path))[0]
    loaded = sys.modules.get(module_name)
    if loaded is not None and getattr(loaded, "__file__", None) == path:
        return loaded  # one class object per file, however often it is named
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    # Registered before running so dataclasses / pickling inside the file can find the module.
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def _check_subclass(cls, what: str) -> type[RolloutBackend]:
    if not (isinstance(cls, type) and issubclass(cls, RolloutBackend)):
        raise BackendError(f"{what} is {cls!r}, not a subclass of backends.base.RolloutBackend")
    if getattr(cls, "__abstractmethods__", None):
        raise BackendError(f"{what} leaves abstract method(s) {sorted(cls.__abstractmethods__)} unimplemented")
    return cls
