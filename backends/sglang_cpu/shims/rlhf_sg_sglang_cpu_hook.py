"""Loaded at interpreter start (by ``rlhf_sg_sglang_cpu.pth``) in every process of the SGLang venv.

torchvision from PyPI is built against a CUDA torch. Next to the CPU torch its native library does
not load, and ``import torchvision`` then dies with "operator torchvision::nms does not exist" while
registering fake kernels for its detection operators. SGLang imports torchvision (through its
multimodal configs) but text models never call those operators, so defining their two schemas
before torchvision loads is enough. This hook does that lazily, on the first ``import torchvision``,
so processes that never import it (pip, Ray's helpers) pay nothing, and only when torchvision's own
library cannot provide the schemas.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

# Keeps the definitions alive: a torch.library.Library drops its registrations when collected.
_LIBRARY = None
SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)


def _has_nms(torch) -> bool:
    try:
        torch.ops.torchvision.nms  # noqa: B018  (the lookup itself is the test)
    except (AttributeError, RuntimeError):
        return False
    return True


def define_torchvision_schemas() -> bool:
    """Define ``torchvision::nms`` / ``qnms`` unless torchvision's library provides them; True if defined."""
    global _LIBRARY
    import torch

    if _LIBRARY is not None or _has_nms(torch):
        return False
    spec = importlib.util.find_spec("torchvision")
    if spec is not None and spec.submodule_search_locations:
        for lib in Path(next(iter(spec.submodule_search_locations))).glob("_C*.so"):
            try:
                torch.ops.load_library(str(lib))
            except OSError:  # built against another torch: the case this hook exists for
                pass
    if _has_nms(torch):
        return False
    _LIBRARY = torch.library.Library("torchvision", "DEF")
    for schema in SCHEMAS:
        _LIBRARY.define(schema)
    return True


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    """Runs :func:`define_torchvision_schemas` whenever torchvision is looked for (a no-op once defined), so
    also at its import itself: an availability check (``importlib.util.find_spec``, as transformers makes on its
    import) comes earlier, and a schema torchvision's library gave then can be gone by the import (seen in the
    vLLM venv after ``import vllm``)."""

    _busy = False  # define_torchvision_schemas looks torchvision up itself

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision" and "torchvision" not in sys.modules and not self._busy:
            self._busy = True
            try:
                define_torchvision_schemas()
            finally:
                self._busy = False
        return None  # the normal finders import torchvision itself


if "torchvision" not in sys.modules and not any(isinstance(f, _BeforeTorchvision) for f in sys.meta_path):
    sys.meta_path.insert(0, _BeforeTorchvision())
