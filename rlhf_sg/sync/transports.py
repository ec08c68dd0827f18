"""The transports: how a gathered bucket gets from a sender rank into its engines.

Every transport has the same life, driven by :class:`~rlhf_sg.sync.syncer.WeightSyncer`:
``setup`` once, then per sync ``begin`` -> (``send`` / ``wait`` per bucket, in order) -> ``end``,
and ``close``. ``send`` starts moving one bucket and returns at once; ``wait`` returns when the
bucket's buffer may be reused. Each records where a bucket's time went (:attr:`Transport.times`).

* :class:`BroadcastTransport` (``"collective"``): each sender rank hosts one side group with all of its
  engines (the sender is group rank 0 and the TCP store master; an engine's workers take the next
  ``weight_group_size`` ranks) and sends each bucket with one broadcast to all of them; gloo on CPU,
  NCCL on GPU. Each engine gets the manifests of the whole sync in one Ray call and receives the
  buckets in order. The group's trainer end is built by the engines' backend
  (``RolloutBackend.open_sender_group``), so engines that join on their own key layout (SGLang) meet it.
* :class:`HandOffTransport` (``"tensor"``): colocated, in memory. The sender packs the bucket with
  the engine's backend (``RolloutBackend.pack_tensor_bucket``, in this process, which owns the memory:
  shared memory on CPU, CUDA IPC on GPU) and only that small payload crosses Ray. One Ray call per
  bucket per engine.
* :class:`DiskTransport` (``"disk"``): bucket k is written as a safetensors file by trainer rank
  ``k % world_size`` into a directory every rank and engine can read; every engine then reloads it.

Waits. Every wait has a deadline and its error names the group, the rank, the engine or the bucket.
A collective's work handle is never waited for with a timeout argument: on ProcessGroupNCCL a
``wait(timeout)`` that expires marks the work failed and aborts the communicator. The sender polls
``work.is_completed()`` and the engines' calls, and calls ``wait()`` only on completed work; the
deadline is the group's own timeout (``timeout_s``, which the group was built with).
"""

from __future__ import annotations

import abc
import concurrent.futures
import contextlib
import dataclasses
import datetime
import os
import re
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from backends.base import BucketManifest, RolloutBackend, WeightGroupSpec, wait_work
from rlhf_sg.distributed import create_group_store, side_broadcast
from rlhf_sg.engine_actor import EngineCallError, get_engine_result, wait_engine_calls
from rlhf_sg.placement import node_address

__all__ = ["BroadcastTransport", "DiskTransport", "HandOffTransport", "Transport", "backend_class"]



def backend_class(info: dict[str, Any]) -> type[RolloutBackend]:
    """The backend class of an engine, from its ``EngineActor.describe()``, through the registry."""
    from backends.registry import get_backend_class

    return get_backend_class(info.get("backend_class") or info["backend"])


#: the name of a version directory of the disk transport (``v`` and the version in 8 digits)
_VERSION_DIR = re.compile(r"v\d{8}")


@dataclasses.dataclass
class SenderContext:
    """What every transport of one trainer rank shares with the syncer."""

    rank: int
    world_size: int
    engines: list[Any]  # Ray handles of every engine
    my_engines: list[int]  # the engines this rank serves
    timeout_s: float
    device: torch.device
    group_name: str  # new at every setup

    def call_mine(self, method: str, *args: Any, label: str | None = None) -> list[tuple[int, str, Any]]:
        """Call ``method`` on every engine this rank serves; ``(engine, label, ref)`` for wait_engine_calls."""
        return [(e, label or method, getattr(self.engines[e], method).remote(*args)) for e in self.my_engines]

    def distributed(self) -> bool:
        return self.world_size > 1 and dist.is_available() and dist.is_initialized()


class Transport(abc.ABC):
    """One way of moving buckets into engines (see the module docstring)."""

    name = ""

    def __init__(self, ctx: SenderContext, infos: list[dict[str, Any]]):
        self.ctx = ctx
        self.infos = infos  # describe() of each engine this rank serves, in my_engines order
        #: per bucket of the last sync: seconds by phase ("send_wait_s", "engine_s", ...)
        self.times: dict[int, dict[str, float]] = {}

    def setup(self) -> None:
        """Set up before the first sync (groups, directories). Collective where a transport says so."""

    def fills(self, k: int) -> bool:
        """Whether this rank gathers bucket ``k`` into a buffer of its own (and sends it)."""
        return bool(self.ctx.my_engines)

    def buffers(self, nbytes: int, count: int) -> list[torch.Tensor]:
        """``count`` bucket buffers of ``nbytes`` bytes (uint8) this transport can send from."""
        return [torch.empty(nbytes, dtype=torch.uint8, device=self.ctx.device) for _ in range(count)]

    def max_buffers(self) -> int:
        """Buffers worth double-buffering over (1: sends are synchronous)."""
        return 2

    def begin(self, plan: list[BucketManifest], version: int) -> None:
        """Start a sync of ``plan`` as ``version``."""
        self.times = {}

    @abc.abstractmethod
    def send(self, k: int, manifest: BucketManifest, flat: torch.Tensor) -> Any:
        """Start sending bucket ``k`` from ``flat`` ([manifest.numel] of its dtype); returns a handle for wait."""

    def wait(self, handle: Any) -> None:
        """Return when the send of ``handle`` is done and its buffer may be reused."""

    def end(self, plan: list[BucketManifest], version: int) -> None:
        """Finish the sync's transfers (every bucket sent); the syncer then calls finish_weight_update."""

    def abort(self, exc: BaseException) -> None:
        """A sync failed part-way; make peers fail now rather than after their timeout."""

    def close(self) -> list[str]:
        """Release what setup made; returns errors to report (the syncer raises them together)."""
        return []

    def _time(self, k: int, key: str, seconds: float) -> None:
        self.times.setdefault(k, {})
        self.times[k][key] = self.times[k].get(key, 0.0) + seconds


class BroadcastTransport(Transport):
    """One side group per sender rank; a bucket is one broadcast to all of the rank's engines."""

    name = "collective"

    def __init__(
        self,
        ctx: SenderContext,
        infos: list[dict[str, Any]],
        master_address: str | None = None,
        open_group: Callable[[WeightGroupSpec, dist.Store], Any] | None = None,
    ):
        super().__init__(ctx, infos)
        self.master_address = master_address
        self.open_group = open_group
        self.backend = "nccl" if ctx.device.type == "cuda" else "gloo"
        self.group: Any = None
        self._store: Any = None
        self.group_ranks: dict[int, int] = {}  # engine index -> its first rank in this rank's group
        self._calls: list[tuple[int, str, Any]] = []
        self._pending: list[Any] = []

    def _opener(self) -> Callable[[WeightGroupSpec, dist.Store], Any]:
        """The trainer-side group builder that meets these engines: their backend's ``open_sender_group``."""
        if self.open_group is not None:
            return self.open_group
        classes = {backend_class(info) for info in self.infos}
        openers = {cls.open_sender_group.__func__ for cls in classes}
        if len(openers) > 1:
            raise ValueError(
                f"WeightSyncer rank {self.ctx.rank}: engines of backends {sorted(c.name for c in classes)} share one "
                "side group but build it differently: give each backend its own engines and syncer"
            )
        return next(iter(classes)).open_sender_group

    def setup(self) -> None:
        if not self.ctx.my_engines:
            return

        ctx = self.ctx
        opener = self._opener()
        host = self.master_address or node_address()
        store = create_group_store(host, ctx.timeout_s)
        world = 1 + sum(info["weight_group_size"] for info in self.infos)
        calls, specs, offset = [], [], 1
        for e, info in zip(ctx.my_engines, self.infos):
            self.group_ranks[e] = offset
            spec = WeightGroupSpec(
                master_address=host,
                master_port=store.port,
                rank_offset=offset,
                world_size=world,
                group_name=ctx.group_name,
                backend=self.backend,
                timeout_s=ctx.timeout_s,
            )
            specs.append(spec)
            calls.append((e, "init_weight_update_group", ctx.engines[e].init_weight_update_group.remote(spec)))
            offset += info["weight_group_size"]
        where = (
            f"weight-update group {ctx.group_name!r} ({self.backend}, world_size {world}) at "
            f"{host}:{store.port}: trainer rank {ctx.rank} (group rank 0)"
        )
        # Our end blocks until every engine has joined; build it in a thread so that an engine
        # whose join fails is reported at once instead of after timeout_s.
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weight-group")
        # NCCL's watchdog tears the process down when a collective outlives the group's timeout: give our end
        # twice the poll deadline, so that a stuck broadcast is reported by our named error first
        ours = dataclasses.replace(specs[0], rank_offset=0,
                                   timeout_s=ctx.timeout_s * (2 if self.backend == "nccl" else 1))
        future = pool.submit(opener, ours, store)
        pool.shutdown(wait=False)
        pending = [ref for _, _, ref in calls]
        while not future.done():
            _raise_failed_calls(calls, pending)
            concurrent.futures.wait([future], timeout=0.05)
        try:
            group = future.result()
        except Exception as exc:
            expected = ", ".join(f"engine {e} (group rank {self.group_ranks[e]})" for e in ctx.my_engines)
            if _is_timeout(exc):
                raise TimeoutError(
                    f"{where} waited timeout_s={ctx.timeout_s} for {expected} to join; one did not. ({exc})"
                ) from exc
            raise RuntimeError(f"{where}: building the group failed: {type(exc).__name__}: {exc}") from exc
        wait_engine_calls(calls, ctx.timeout_s)
        self.group, self._store = group, store

    def begin(self, plan: list[BucketManifest], version: int) -> None:
        super().begin(plan, version)
        self._calls = self.ctx.call_mine("update_weights_from_collective", plan, 0)
        self._pending = [ref for _, _, ref in self._calls]

    def send(self, k: int, manifest: BucketManifest, flat: torch.Tensor) -> Any:
        return k, side_broadcast(self.group, flat, 0, self.ctx.timeout_s)

    #: after a failed or timed-out send, how long an engine's own error (which says more) is waited for
    ENGINE_ERROR_GRACE_S = 5.0

    def wait(self, handle: Any) -> None:
        """Wait for bucket ``k``'s broadcast; fail at once if an engine's receive call failed.

        When the send fails (or the deadline passes) an engine's own error, if it reports one within
        :attr:`ENGINE_ERROR_GRACE_S`, is raised instead of the transport's, as it says more.
        """
        k, work = handle
        start = time.perf_counter()
        engines = ", ".join(f"engine {e} (group rank {self.group_ranks[e]})" for e in self.ctx.my_engines)
        where = f"weight-update group {self.ctx.group_name!r}: trainer rank {self.ctx.rank} (group rank 0)"
        try:
            wait_work(work, self.ctx.timeout_s, lambda: _raise_failed_calls(self._calls, self._pending))
        except TimeoutError as exc:
            _raise_failed_calls(self._calls, self._pending, grace_s=self.ENGINE_ERROR_GRACE_S)
            raise TimeoutError(
                f"{where} could not send bucket {k} to {engines} within timeout_s={self.ctx.timeout_s}"
            ) from exc
        except EngineCallError:
            raise
        except RuntimeError as exc:
            _raise_failed_calls(self._calls, self._pending, grace_s=self.ENGINE_ERROR_GRACE_S)
            raise RuntimeError(f"{where}: sending bucket {k} to {engines} failed: {exc}") from exc
        self._time(k, "send_wait_s", time.perf_counter() - start)

    def end(self, plan: list[BucketManifest], version: int) -> None:
        per_engine = wait_engine_calls(self._calls, self.ctx.timeout_s)
        for seconds in per_engine:
            for k, s in enumerate(seconds or []):
                self.times.setdefault(k, {})
                self.times[k]["engine_s"] = max(self.times[k].get("engine_s", 0.0), float(s))

    def abort(self, exc: BaseException) -> None:
        # Engines blocked in a receive should fail now, not after timeout_s. Only destroying our end of
        # the group closes its connections, and pending work handles (held by the failed frames'
        # locals) keep it alive: clear those locals, then drop the group.
        traceback.clear_frames(exc.__traceback__)
        self._drop_group(abort=True)

    def _drop_group(self, abort: bool = False) -> None:
        """Destroy our end: ``abort()`` after a failure (NCCL's ncclCommAbort; a graceful ``shutdown()`` may wait
        on the broadcast that will never finish), ``shutdown()`` on a clean close."""
        if self.group is not None:
            if abort:
                self.group.abort()
            else:
                self.group.shutdown()
            _deregister(self.group)
        self.group = self._store = None

    def close(self) -> list[str]:
        errors = []
        if self.group_ranks:  # the engines joined a group (it may already be dropped after a failure)
            try:
                wait_engine_calls(self.ctx.call_mine("destroy_weight_update_group"), self.ctx.timeout_s)
            except EngineCallError as exc:
                errors.append(str(exc))
        self._drop_group()
        self.group_ranks = {}
        return errors


def _deregister(group) -> None:
    """Forget a group torch registered (the SGLang end is made by ``_new_process_group_helper``, which records it
    in torch's group tables; without this every engine restart leaves one behind)."""
    from torch.distributed.distributed_c10d import _unregister_process_group, _world

    if group not in _world.pg_map:  # built straight on a store (vLLM, embedded): torch never registered it
        return
    # the tables torch's destroy_process_group clears, without its shutdown() (ours already ran)
    name = _world.pg_names.pop(group, None)
    for table in (_world.pg_map, _world.pg_group_ranks, _world.pg_backend_config, _world.pg_coalesce_state):
        table.pop(group, None)
    tag = _world.pg_to_tag.pop(group, None)
    for key in {tag, ""} if tag is not None else ():
        with contextlib.suppress(KeyError, ValueError):
            _world.tags_to_pg[key].remove(group)
    if name is not None:
        _unregister_process_group(name)


class HandOffTransport(Transport):
    """Colocated in-memory hand-off: the engine's backend packs the bucket here, the engine opens it."""

    name = "tensor"

    def setup(self) -> None:
        import ray

        node = ray.get_runtime_context().get_node_id()
        for e, info in zip(self.ctx.my_engines, self.infos):
            if info.get("node_id") != node:
                raise ValueError(
                    f"transport='tensor' needs colocated engines: engine {e} runs on node "
                    f"{info.get('node_id')}, trainer rank {self.ctx.rank} on {node}; use transport='collective'"
                )
        # (backend class, TP ranks) of each engine. The sender packs once per engine, and the backend makes
        # one payload per TP rank: every receiving process opens a handle of its own (CUDA IPC counts its
        # references per handle made, so one handle opened by several processes would be released early).
        self._packers = [(backend_class(info), int(info["weight_group_size"])) for info in self.infos]

    def buffers(self, nbytes: int, count: int) -> list[torch.Tensor]:
        if self.ctx.device.type == "cpu":
            from backends.shared_tensor import shared_cpu_buffer

            return [shared_cpu_buffer(nbytes) for _ in range(count)]
        return super().buffers(nbytes, count)

    def send(self, k: int, manifest: BucketManifest, flat: torch.Tensor) -> Any:
        start = time.perf_counter()
        calls = []
        for e, (cls, tp) in zip(self.ctx.my_engines, self._packers):
            payload = cls.pack_tensor_bucket(manifest, flat, tp)
            ref = self.ctx.engines[e].update_weights_from_tensor.remote(manifest, payload)
            calls.append((e, f"update_weights_from_tensor (bucket {k})", ref))
        self._time(k, "pack_s", time.perf_counter() - start)
        return k, calls

    def wait(self, handle: Any) -> None:
        k, calls = handle
        start = time.perf_counter()
        seconds = wait_engine_calls(calls, self.ctx.timeout_s)
        self._time(k, "send_wait_s", time.perf_counter() - start)
        if seconds:
            self._time(k, "engine_s", max(float(s or 0.0) for s in seconds))


class DiskTransport(Transport):
    """Bucket k is a safetensors file written by rank ``k % world_size``; every engine reloads the directory."""

    name = "disk"

    def __init__(self, ctx: SenderContext, infos: list[dict[str, Any]], disk_dir: str | None = None):
        super().__init__(ctx, infos)
        self.disk_dir = disk_dir
        self._own_dir = False
        self._version_dir = ""

    def setup(self) -> None:
        """Collective when no ``disk_dir`` was given (rank 0 chooses a directory)."""
        if self.disk_dir is not None:
            os.makedirs(self.disk_dir, exist_ok=True)
            return
        path = [tempfile.mkdtemp(prefix="rlhf_sg-weights-") if self.ctx.rank == 0 else None]
        if self.ctx.distributed():
            dist.broadcast_object_list(path, src=0)
        self.disk_dir = path[0]
        self._own_dir = self.ctx.rank == 0

    def fills(self, k: int) -> bool:
        return k % self.ctx.world_size == self.ctx.rank

    def max_buffers(self) -> int:
        return 1

    def begin(self, plan: list[BucketManifest], version: int) -> None:
        super().begin(plan, version)
        self._version_dir = os.path.join(self.disk_dir, f"v{version:08d}")
        os.makedirs(self._version_dir, exist_ok=True)

    def send(self, k: int, manifest: BucketManifest, flat: torch.Tensor) -> Any:
        from safetensors.torch import save_file

        start = time.perf_counter()
        # safetensors refuses tensors that share storage, so each view is copied once.
        tensors = {name: tensor.clone() for name, tensor in manifest.unflatten(flat)}
        save_file(tensors, os.path.join(self._version_dir, f"bucket-{k:05d}.safetensors"))
        self._time(k, "write_s", time.perf_counter() - start)
        return None

    def end(self, plan: list[BucketManifest], version: int) -> None:
        self._barrier(f"writing weight version {version} to {self._version_dir}")
        if self.ctx.rank == 0:  # every rank is past the previous sync, so older versions are unread
            for entry in os.listdir(self.disk_dir):
                # only the transport's own version directories: a directory the user gave may hold others
                if _VERSION_DIR.fullmatch(entry) and entry != os.path.basename(self._version_dir):
                    shutil.rmtree(os.path.join(self.disk_dir, entry), ignore_errors=True)
        wait_engine_calls(self.ctx.call_mine("update_weights_from_disk", self._version_dir), self.ctx.timeout_s)

    def _barrier(self, what: str) -> None:
        """All ranks have written their files. Bounded by the default group's timeout (gloo: named ranks)."""
        if not self.ctx.distributed():
            return
        try:
            if dist.get_backend() == "gloo":
                # a barrier with its own deadline that names the missing ranks (not a Work.wait)
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=self.ctx.timeout_s))
            else:
                dist.barrier()
        except RuntimeError as exc:
            raise TimeoutError(f"trainer rank {self.ctx.rank}: barrier after {what} failed: {exc}") from exc

    def close(self) -> list[str]:
        if self._own_dir and self.disk_dir:
            shutil.rmtree(self.disk_dir, ignore_errors=True)
            self.disk_dir, self._own_dir = None, False
        return []


def _is_timeout(exc: BaseException) -> bool:
    text = f"{type(exc).__name__}: {exc}".lower()
    return isinstance(exc, TimeoutError) or "timeout" in text or "timed out" in text


def _raise_failed_calls(calls: list[tuple[int, str, Any]], pending: list[Any], grace_s: float = 0.0) -> None:
    """Raise the error of an engine call in ``pending`` that has failed (waiting up to ``grace_s``).

    Finished calls are removed from ``pending``.
    """
    import ray

    deadline = time.monotonic() + grace_s
    while pending:
        ready, _ = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            return
        pending.remove(ready[0])
        engine_index, call_name, _ = next(c for c in calls if c[2] == ready[0])
        get_engine_result(engine_index, call_name, ready[0])
