"""One rollout engine as a Ray actor, and bounded waits on calls to engines.

:class:`EngineActor` is a plain class; :func:`start_engine_actors` wraps it with ``ray.remote`` and
starts ``num_engines`` of them. Each builds its backend through the registry
(``backends.create_backend(name, config)``), pins torch to its CPU share (oversubscribed OpenMP
threads make decoding many times slower) and forwards the rollout-backend interface.

Two things are added on top of the interface, both for the weight sync:

* whole-sync calls (``update_weights_from_collective`` takes every bucket of a sync in one call),
  so a sync costs one Ray round trip per engine instead of one per bucket;
* the CPU shared-memory hand-off: the trainer writes a bucket into a file under ``/dev/shm`` and the
  actor maps that file, so the bytes never pass through Ray's object store.

Every wait on an engine goes through :func:`wait_engine_calls`, which has a deadline and names the
engine and the call in its errors.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from backends.base import BackendConfig, BackendError, BucketManifest, Completion, SamplingParams, WeightGroupSpec

__all__ = ["EngineActor", "EngineCallError", "start_engine_actors", "wait_engine_calls"]


class EngineCallError(RuntimeError):
    """A call to a rollout engine failed or did not answer in time; the message names engine and call."""


class EngineActor:
    """One rollout backend behind a Ray actor; every public method is one remote call."""

    def __init__(self, backend_name: str, config: BackendConfig, engine_index: int = 0):
        import backends

        self.engine_index = engine_index
        threads = config.num_threads or _cpu_share()
        torch.set_num_threads(threads)
        self.backend = backends.create_backend(backend_name, dataclasses.replace(config, num_threads=threads))
        self._mapped: dict[str, torch.Tensor] = {}  # shared-memory path -> its bytes, mapped once

    def describe(self) -> dict[str, Any]:
        """What the trainer needs to plan a sync: node, transports, group size, weight version."""
        import ray

        return {
            "engine_index": self.engine_index,
            "backend": self.backend.name,
            "transports": sorted(self.backend.transports),
            "node_id": ray.get_runtime_context().get_node_id(),
            "gpu_ids": [int(g) for g in ray.get_gpu_ids()],  # physical ids (CUDA IPC needs the trainer's)
            # ranks this engine's workers take in a weight-update group
            "weight_group_size": self.backend.config.tensor_parallel_size,
            "weight_version": self.backend.weight_version,
        }

    # ---- rollout -------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        return self.backend.generate(prompts, params)

    def weight_version(self) -> int:
        return self.backend.weight_version

    # ---- weights -------------------------------------------------------------------------
    def check_manifests(self, manifests: list[BucketManifest]) -> int:
        """Check every tensor of a sync plan against this engine's weights before any byte moves.

        Names must be the engine's parameters and shapes must match; dtypes may differ (the engine
        casts on load). Returns the number of tensors checked. Raises :class:`BackendError` naming
        the bucket and tensor.
        """
        checked = 0
        for b, manifest in enumerate(manifests):
            for spec in manifest.tensors:
                try:
                    held = self.backend.get_weights_by_name(spec.name)
                except BackendError as exc:
                    raise BackendError(
                        f"engine {self.engine_index}: bucket {b} tensor {spec.name!r} is not a weight of this "
                        f"engine ({exc}); start the engines from the trainer's model"
                    ) from exc
                if tuple(held.shape) != tuple(spec.shape):
                    raise BackendError(
                        f"engine {self.engine_index}: bucket {b} tensor {spec.name!r} has shape "
                        f"{tuple(spec.shape)} in the trainer but {tuple(held.shape)} in the engine; "
                        "start the engines from the trainer's model"
                    )
                checked += 1
        return checked

    def init_weight_update_group(self, spec: WeightGroupSpec) -> None:
        self.backend.init_weight_update_group(spec)

    def destroy_weight_update_group(self) -> None:
        self.backend.destroy_weight_update_group()

    def update_weights_from_collective(self, manifests: list[BucketManifest], src_rank: int = 0) -> int:
        """Receive the buckets of one sync, in order, from group rank ``src_rank``; returns the bytes."""
        received = 0
        for manifest in manifests:
            self.backend.update_weights_from_collective(manifest, src_rank)
            received += manifest.numel * manifest.dtype.itemsize
        return received

    def update_weights_from_tensor(self, manifest: BucketManifest, flat) -> None:
        """Load a bucket handed over as a tensor or a CUDA IPC ``(rebuild_fn, args)`` pair."""
        self.backend.update_weights_from_tensor(manifest, flat)

    def update_weights_from_shared_memory(self, path: str, manifest: BucketManifest) -> None:
        """Load a bucket the trainer wrote at the start of the shared-memory file ``path``."""
        mapped = self._mapped.get(path)
        nbytes = manifest.numel * manifest.dtype.itemsize
        if mapped is None or mapped.numel() < nbytes:
            import os

            if not os.path.exists(path):
                raise BackendError(
                    f"engine {self.engine_index}: shared-memory bucket file {path!r} does not exist; the "
                    "tensor transport needs the trainer rank and the engine on the same machine"
                )
            mapped = torch.from_file(path, shared=True, size=os.path.getsize(path), dtype=torch.uint8)
            self._mapped[path] = mapped
        if mapped.numel() < nbytes:
            raise BackendError(
                f"engine {self.engine_index}: shared-memory file {path!r} holds {mapped.numel()} bytes, "
                f"the bucket needs {nbytes}"
            )
        self.backend.update_weights_from_tensor(manifest, mapped[:nbytes].view(manifest.dtype))

    def release_shared_memory(self, paths: list[str]) -> None:
        """Unmap shared-memory files the trainer is about to delete."""
        for path in paths:
            self._mapped.pop(path, None)

    def update_weights_from_disk(self, path: str) -> None:
        self.backend.update_weights_from_disk(path)

    def finish_weight_update(self, version: int) -> int:
        """Close a sync (new weight version, prefix cache reset); returns the engine's version."""
        self.backend.finish_weight_update(version)
        return self.backend.weight_version

    def get_weights_by_name(self, name: str) -> torch.Tensor:
        return self.backend.get_weights_by_name(name)

    # ---- memory and lifetime ---------------------------------------------------------------
    def sleep(self) -> None:
        self.backend.sleep()

    def wake(self) -> None:
        self.backend.wake()

    def reset_prefix_cache(self) -> None:
        self.backend.reset_prefix_cache()

    def resources(self) -> dict[str, Any]:
        """Where Ray placed this engine: node, pid, placement group and the resources it holds."""
        import os

        import ray

        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "pid": os.getpid(), "resources": ctx.get_assigned_resources(),
                "placement_group_id": ctx.get_placement_group_id()}

    def shutdown(self) -> None:
        self._mapped.clear()
        self.backend.shutdown()


def _cpu_share() -> int:
    """CPUs Ray gave this actor (at least 1), the torch thread count that does not oversubscribe."""
    import ray

    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1.0)
    return max(1, int(cpus))


def wait_engine_calls(calls: list[tuple[int, str, Any]], timeout_s: float) -> list[Any]:
    """Wait for remote engine calls; results in the order of ``calls``.

    calls: ``(engine_index, call_name, object_ref)`` triples. Raises :class:`EngineCallError` naming
    the engine and the call when one fails, or when not all answer within ``timeout_s``.
    """
    import ray

    if not calls:
        return []
    index_of = {ref: i for i, (_, _, ref) in enumerate(calls)}
    results: list[Any] = [None] * len(calls)
    pending = [ref for _, _, ref in calls]
    deadline = time.monotonic() + timeout_s
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            late = ", ".join(f"engine {calls[index_of[r]][0]}: {calls[index_of[r]][1]}" for r in pending)
            raise EngineCallError(f"no answer within timeout_s={timeout_s} from {late}")
        for ref in ready:
            engine_index, call_name, _ = calls[index_of[ref]]
            results[index_of[ref]] = get_engine_result(engine_index, call_name, ref)
    return results


def get_engine_result(engine_index: int, call_name: str, ref: Any) -> Any:
    """``ray.get`` of one finished engine call, its failure re-raised naming engine and call."""
    import ray

    try:
        return ray.get(ref, timeout=0)
    except ray.exceptions.RayTaskError as exc:
        cause = exc.cause if getattr(exc, "cause", None) is not None else exc
        raise EngineCallError(f"engine {engine_index}: {call_name} failed: {type(cause).__name__}: {cause}") from exc
    except ray.exceptions.RayActorError as exc:
        raise EngineCallError(f"engine {engine_index}: {call_name}: the engine actor died: {exc}") from exc


def start_engine_actors(
    backend_name: str,
    config: BackendConfig,
    num_engines: int,
    num_cpus: float = 1.0,
    num_gpus: float = 0.0,
    start_timeout_s: float = 600.0,
    shared: Any = None,
) -> list[Any]:
    """Start ``num_engines`` :class:`EngineActor` s and wait until each has built its backend.

    Engine ``i`` gets ``config`` with ``seed = config.seed + i`` (independent sampling streams) and,
    when ``config.num_threads`` is None, ``max(1, int(num_cpus))`` torch threads. With ``shared`` (a
    :class:`rlhf_sg.workers.SharedBundles`, colocated layouts) engine ``i`` goes on bundle ``i`` and
    takes that bundle's share instead of ``num_cpus`` / ``num_gpus``. Returns the Ray actor handles,
    engine 0 first. Raises :class:`EngineCallError` naming the engine that failed.
    """
    import ray

    if shared is not None:
        num_cpus, num_gpus = shared.num_cpus, shared.num_gpus
    if num_engines < 1:
        raise ValueError(f"start_engine_actors: num_engines must be >= 1, got {num_engines}")
    if num_cpus <= 0 and config.num_threads is None:
        raise ValueError("start_engine_actors: num_cpus must be > 0 (or set config.num_threads)")
    threads = config.num_threads or max(1, int(num_cpus))
    # The thread count must be in the environment before torch starts its OpenMP pool.
    env = {"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    remote_cls = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, runtime_env={"env_vars": env})(EngineActor)
    actors = [
        remote_cls.options(**({"scheduling_strategy": shared.strategy(i)} if shared is not None else {})).remote(
            backend_name, dataclasses.replace(config, seed=config.seed + i, num_threads=threads), engine_index=i
        )
        for i in range(num_engines)
    ]
    try:
        wait_engine_calls([(i, "start", a.describe.remote()) for i, a in enumerate(actors)], start_timeout_s)
    except EngineCallError:
        for a in actors:
            ray.kill(a)
        raise
    return actors
