"""Rollout backends: the interface (:mod:`backends.base`), the registry, and the engines.

Importing this package imports no engine: ``get_backend_class("sglang")`` imports SGLang on demand.
"""

from backends.base import (
    BackendConfig,
    BackendError,
    BucketManifest,
    Completion,
    RolloutBackend,
    SamplingParams,
    TensorSpec,
    WeightGroupSpec,
)
from backends.registry import ENTRY_POINT_GROUP, available_backends, create_backend, get_backend_class

__all__ = [
    "ENTRY_POINT_GROUP",
    "BackendConfig",
    "BackendError",
    "BucketManifest",
    "Completion",
    "RolloutBackend",
    "SamplingParams",
    "TensorSpec",
    "WeightGroupSpec",
    "available_backends",
    "create_backend",
    "get_backend_class",
]
