"""One rollout engine as a Ray actor, and bounded waits on calls to engines.

:class:`EngineActor` is a plain class; :func:`start_engine_actors` wraps it with ``ray.remote`` and
starts ``num_engines`` of them. Each builds its backend through the registry
(``backends.create_backend(name, config)``), pins torch to its CPU share (oversubscribed OpenMP
threads make decoding many times slower) and forwards the rollout-backend interface.

Two things are added on top of the interface, both for the weight sync:

* whole-sync calls (``update_weights_from_collective`` takes every bucket of a sync in one call),
  so a sync costs one Ray round trip per engine instead of one per bucket;
* the plan check (:meth:`EngineActor.check_manifests`): a sync's names, shapes and dtypes checked once
  against the safetensors headers of the checkpoint the engine started from, reading no weight.

The tensor transport's bytes never pass through Ray's object store: the trainer rank packs a bucket
with the engine's ``pack_tensor_bucket`` (shared memory on CPU, CUDA IPC on GPU) and only that small
payload crosses Ray.

Every wait on an engine goes through :func:`wait_engine_calls`, which has a deadline and names the
engine and the call in its errors.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import torch

from backends.base import BackendConfig, BackendError, BucketManifest, Completion, SamplingParams, WeightGroupSpec

__all__ = ["EngineActor", "EngineCallError", "start_engine_actors", "wait_engine_calls"]


class EngineCallError(RuntimeError):
    """A call to a rollout engine failed or did not answer in time; the message names engine and call."""


class EngineDied(EngineCallError):
    """The engine's actor or process is gone (killed, crashed, out of memory); the message says which and how."""

    def __init__(self, engine_index: int, message: str):
        super().__init__(message)
        self.engine_index = engine_index


class EngineActor:
    """One rollout backend behind a Ray actor; every public method is one remote call."""

    def __init__(self, backend_name: str, config: BackendConfig, engine_index: int = 0):
        import backends
        from rlhf_sg.placement import export_gloo_interface, this_rank

        self.engine_index = engine_index
        self.backend_name = backend_name
        #: the GPU(s) and node this engine was placed on
        self.placement = this_rank()
        export_gloo_interface(self.placement.node_address)  # gloo side groups on CPU
        if config.device == "cuda" and torch.cuda.is_available():
            # the backend's device "cuda" means the current one: make it the GPU Ray gave this actor
            torch.cuda.set_device(self.placement.local_device)
        threads = config.num_threads or _cpu_share()
        torch.set_num_threads(threads)
        self.backend = backends.create_backend(backend_name, dataclasses.replace(config, num_threads=threads))
        self._reference: dict[str, tuple[tuple[int, ...], str]] | None = None  # checkpoint: name -> (shape, dtype)
        self._checked_plans: set[int] = set()
        # partial rollout: abort_generation (its own thread) against a running generate
        self._abort_lock = threading.Lock()
        self._aborting = False  # held from abort_generation to resume_generation
        self._generating = False
        self._generate_done = threading.Event()
        self._generate_done.set()

    def describe(self) -> dict[str, Any]:
        """What the trainer needs to plan a sync: node, transports, group size, weight version."""
        import ray

        return {
            "engine_index": self.engine_index,
            "backend": self.backend.name,
            # the name the registry built this backend from: the trainer resolves the same class with it
            # (the tensor transport's pack_tensor_bucket and the group's open_sender_group run there)
            "backend_class": self.backend_name,
            "transports": sorted(self.backend.transports),
            "node_id": ray.get_runtime_context().get_node_id(),
            # as the node lists them (ints, GPU-/MIG- UUIDs): the tensor transport matches devices by UUID
            "gpu_ids": list(self.placement.gpu_ids),
            "local_device": self.placement.local_device,
            # ranks this engine's workers take in a weight-update group
            "weight_group_size": self.backend.config.tensor_parallel_size,
            "weight_version": self.backend.weight_version,
            "supports_abort": self.backend.supports_abort,
            "supports_lora_adapter": self.backend.supports_lora_adapter,
        }

    # ---- rollout -------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams, images: list | None = None
                 ) -> list[Completion]:
        """The backend's ``generate`` (``images``: a vision-language policy's per-prompt image inputs, for a backend
        that ``supports_images``); while an abort holds (:meth:`abort_generation` until :meth:`resume_generation`)
        every completion comes back at once, empty, with ``finish_reason="abort"``."""
        with self._abort_lock:
            if self._aborting:
                version = self.backend.weight_version
                return [Completion([], [], "abort", version, i) for i in range(len(prompts)) for _ in range(params.n)]
            self._generating = True
            self._generate_done.clear()
        try:
            if images is None:
                return self.backend.generate(prompts, params)
            return self.backend.generate(prompts, params, images=images)
        finally:
            with self._abort_lock:
                self._generating = False
                self._generate_done.set()

    def abort_generation(self, timeout_s: float = 60.0) -> bool:
        """Cut the running generate short (partial rollout) and hold the abort until :meth:`resume_generation`;
        returns once no generate runs (True if one was cut short). Runs in the ``"abort"`` concurrency group, next
        to a running ``generate``: the actor is started with ``abortable=True`` (:func:`start_engine_actors`).

        The backend's abort reaches only a generate that has started inside the engine, so it is repeated until
        the generate returns; one that starts later sees the held abort and returns at once."""
        with self._abort_lock:
            self._aborting = True
            running = self._generating
        if not running:
            return False
        if not self.backend.supports_abort:  # no way to cut it short: the generate runs to its end
            self._wait_generate(timeout_s)
            return False
        deadline = time.monotonic() + timeout_s
        while not self._generate_done.is_set():
            self.backend.abort_generation()
            if self._generate_done.wait(0.05):
                break
            if time.monotonic() > deadline:
                raise BackendError(f"engine {self.engine_index}: generate still running {timeout_s:.0f} s after "
                                   "abort_generation; the backend's abort did not reach it")
        return True

    def generate_progress(self) -> tuple[bool, int | None]:
        """Whether a generate runs, and how many decode steps it has taken where the backend counts them
        (``decode_steps``; None where it does not). Runs in the ``"abort"`` concurrency group, next to a running
        generate, so a caller can wait for a generation under way instead of guessing how long it takes."""
        with self._abort_lock:
            running = self._generating
        return running, getattr(self.backend, "decode_steps", None)

    def _wait_generate(self, timeout_s: float) -> None:
        if not self._generate_done.wait(timeout_s):
            raise BackendError(f"engine {self.engine_index}: generate still running after {timeout_s:.0f} s")

    def resume_generation(self) -> None:
        """End the abort :meth:`abort_generation` started: generate calls run again."""
        with self._abort_lock:
            self._aborting = False

    def weight_version(self) -> int:
        return self.backend.weight_version

    # ---- weights -------------------------------------------------------------------------
    def check_manifests(self, manifests: list[BucketManifest]) -> int:
        """Check a sync plan against this engine's model before any byte moves; reads no weight.

        The reference is the checkpoint the engine was started from (``config.model_path``): the
        names, shapes and dtypes in its safetensors headers, read once. Every tensor of the plan must
        be one of its weights with the same shape; its dtype must be a floating type when the
        checkpoint's is (engines cast between floating types on load, not to or from integers). A
        plan is checked once (the trainer sends it again only when it changes). Returns the number of
        tensors checked; raises :class:`BackendError` naming the bucket and tensor.
        """
        key = hash(tuple((t.name, t.shape, str(m.dtype)) for m in manifests for t in m.tensors))
        if key in self._checked_plans:
            return sum(len(m.tensors) for m in manifests)
        reference = self._checkpoint_weights()
        where = f"engine {self.engine_index} ({self.backend.name}, model {self.backend.config.model_path})"
        checked = 0
        for b, manifest in enumerate(manifests):
            for spec in manifest.tensors:
                held = reference.get(spec.name)
                if held is None:
                    raise BackendError(
                        f"{where}: bucket {b} tensor {spec.name!r} is not a weight of the engine's checkpoint "
                        f"({len(reference)} weights, e.g. {sorted(reference)[:3]}); start the engines from the "
                        "trainer's model"
                    )
                shape, dtype = held
                if tuple(spec.shape) != shape:
                    raise BackendError(
                        f"{where}: bucket {b} tensor {spec.name!r} has shape {tuple(spec.shape)} in the trainer "
                        f"but {shape} in the engine; start the engines from the trainer's model"
                    )
                if spec.dtype.is_floating_point != _is_floating(dtype):
                    raise BackendError(
                        f"{where}: bucket {b} tensor {spec.name!r} is {spec.dtype} in the trainer but {dtype} in "
                        "the engine, which cannot cast between them on load"
                    )
                checked += 1
        self._checked_plans.add(key)
        return checked

    def _checkpoint_weights(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """name -> (shape, safetensors dtype) of every tensor in the engine's checkpoint (headers only)."""
        if self._reference is None:
            import glob
            import os

            path = self.backend.config.model_path
            if not os.path.isdir(path):  # a model-hub id: the copy the engine loaded, from the local cache
                try:
                    from huggingface_hub import snapshot_download

                    path = snapshot_download(path, local_files_only=True, allow_patterns=["*.safetensors"])
                except Exception:  # not a hub id, or not cached here
                    pass
            files = sorted(glob.glob(os.path.join(path, "*.safetensors"))) if os.path.isdir(path) else []
            if not files:
                raise BackendError(
                    f"engine {self.engine_index}: cannot check the sync plan: {path!r} is neither a directory of "
                    "*.safetensors files nor a model-hub id cached on this machine (start the engines from a "
                    "saved model directory)"
                )
            from safetensors import safe_open

            reference = {}
            for file in files:
                with safe_open(file, framework="pt") as f:  # reads the header only
                    for name in f.keys():  # noqa: SIM118  (safe_open is not a mapping)
                        piece = f.get_slice(name)
                        reference[name] = (tuple(int(s) for s in piece.get_shape()), piece.get_dtype())
            self._reference = reference
        return self._reference

    def init_weight_update_group(self, spec: WeightGroupSpec) -> None:
        self.backend.init_weight_update_group(spec)

    def destroy_weight_update_group(self) -> None:
        self.backend.destroy_weight_update_group()

    def update_weights_from_collective(self, manifests: list[BucketManifest], src_rank: int = 0) -> list[float]:
        """Receive the buckets of one sync, in order, from group rank ``src_rank``.

        Returns the seconds each bucket took here, from the end of the previous one (receive + load).
        """
        seconds = []
        for manifest in manifests:
            start = time.perf_counter()
            self.backend.update_weights_from_collective(manifest, src_rank)
            seconds.append(time.perf_counter() - start)
        return seconds

    def update_weights_from_tensor(self, manifest: BucketManifest, payload: Any) -> float:
        """Load a bucket the trainer packed with this backend's ``pack_tensor_bucket``; returns the seconds."""
        start = time.perf_counter()
        self.backend.update_weights_from_tensor(manifest, payload)
        return time.perf_counter() - start

    def update_weights_from_disk(self, path: str) -> None:
        self.backend.update_weights_from_disk(path)

    def load_lora_adapter(self, manifest: BucketManifest, flat: torch.Tensor, peft_config: dict[str, Any]) -> float:
        """The backend's ``load_lora_adapter`` (the adapter's tensors in one CPU bucket); returns the seconds."""
        start = time.perf_counter()
        self.backend.load_lora_adapter(manifest, flat, peft_config)
        return time.perf_counter() - start

    def finish_weight_update(self, version: int) -> int:
        """Close a sync (new weight version, prefix cache reset); returns the engine's version."""
        self.backend.finish_weight_update(version)
        return self.backend.weight_version

    def get_weights_by_name(self, name: str) -> torch.Tensor:
        return self.backend.get_weights_by_name(name)

    # ---- memory and lifetime ---------------------------------------------------------------
    def sleep(self, tags: tuple[str, ...] | None = None) -> list[str]:
        """Release the memory ``tags`` name (None: all, see ``backends.base``); returns what is now released."""
        self.backend.sleep(tags)
        return sorted(self.backend.released_memory)

    def wake(self, tags: tuple[str, ...] | None = None) -> list[str]:
        """Restore the memory ``tags`` name (None: all); returns what is still released."""
        self.backend.wake(tags)
        return sorted(self.backend.released_memory)

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
        self.backend.shutdown()


def _is_floating(safetensors_dtype: str) -> bool:
    return safetensors_dtype.startswith(("F", "BF"))  # F64, F32, F16, BF16, F8_E4M3, ...; not I*, U*, BOOL


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


def wait_engine_calls_or_died(calls: list[tuple[int, str, Any]], timeout_s: float) -> list[Any]:
    """:func:`wait_engine_calls`, except that a call whose engine died gives its :class:`EngineDied` in the
    results instead of raising (the caller restarts that engine); other failures and timeouts still raise."""
    results = []
    deadline = time.monotonic() + timeout_s
    for engine_index, call_name, ref in calls:
        try:
            remaining = max(0.0, deadline - time.monotonic())
            results.append(wait_engine_calls([(engine_index, call_name, ref)], remaining)[0])
        except EngineDied as died:
            results.append(died)
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
        raise EngineDied(engine_index, f"engine {engine_index}: {call_name}: the engine actor died: {exc}") from exc


def start_engine_actors(
    backend_name: str,
    config: BackendConfig,
    num_engines: int,
    num_cpus: float = 1.0,
    num_gpus: float = 0.0,
    start_timeout_s: float = 600.0,
    shared: Any = None,
    only: list[int] | None = None,
    abortable: bool = False,
) -> list[Any]:
    """Start ``num_engines`` :class:`EngineActor` s (or, with ``only``, those engine indices of them: a restart)
    and wait until each has built its backend.

    Engine ``i`` gets ``config`` with ``seed = config.seed + i`` (independent sampling streams) and,
    when ``config.num_threads`` is None, ``max(1, int(num_cpus))`` torch threads. With ``shared`` (a
    :class:`rlhf_sg.workers.SharedBundles`, colocated layouts) engine ``i`` goes on bundle ``i`` and
    takes that bundle's share instead of ``num_cpus`` / ``num_gpus``. With ``abortable`` (partial rollout) the
    actors get an ``"abort"`` concurrency group, so :meth:`EngineActor.abort_generation` (called with
    ``.options(concurrency_group="abort")``) runs next to a running ``generate``; every other call still runs one
    at a time, in order. Returns the Ray actor handles,
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
    groups = {"concurrency_groups": {"abort": 1}} if abortable else {}
    remote_cls = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, runtime_env={"env_vars": env}, **groups)(EngineActor)
    indices = list(range(num_engines)) if only is None else list(only)
    actors = [
        remote_cls.options(**({"scheduling_strategy": shared.strategy(i)} if shared is not None else {})).remote(
            backend_name, dataclasses.replace(config, seed=config.seed + i, num_threads=threads), engine_index=i
        )
        for i in indices
    ]
    try:
        wait_engine_calls([(i, "start", a.describe.remote()) for i, a in zip(indices, actors)], start_timeout_s)
    except EngineCallError:
        for a in actors:
            ray.kill(a)
        raise
    return actors
