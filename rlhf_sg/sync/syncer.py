"""The syncer: drives plan, gather and transport for one trainer rank, one weight version at a time.

After the gather every rank holds the same full bucket, so every rank can send it: engine ``e`` is
served by trainer rank ``e % num_senders``. One loop serves every transport: with ``overlap=True`` a
sender has two bucket buffers, and the transfer of bucket k runs while bucket k+1 is gathered into
the other buffer; before a buffer is reused the transfer that read it is waited for, with a deadline.

Every sync ends with ``finish_weight_update(version)`` on every engine (new ``weight_version``,
prefix cache reset). Before the first sync of a model (and whenever its names, shapes or dtypes
change) every engine checks the plan (:func:`~rlhf_sg.sync.plan.check_plan`), so a model mismatch
is reported on every rank before any byte moves. Buckets are gathered in the model's run-time layout and
sent under the names and offsets of its checkpoint (:mod:`backends.checkpoint_names`: a fused
mixture-of-experts parameter goes out as its per-expert checkpoint tensors, the same bytes), which is
what every engine loads. A collective sync that fails later leaves the side
groups out of step: the sender drops its end at once (engines blocked in a receive then fail
instead of waiting out ``timeout_s``), and the syncer refuses further syncs until
:meth:`WeightSyncer.close` and :meth:`WeightSyncer.setup` have been called again.

The syncer knows engines only through ``backends.base``: what a transport needs from an engine's
backend (its trainer-side group builder, its bucket packer) is a classmethod of the backend class,
found through the registry from the engine's ``describe()``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from backends.base import BucketManifest, WeightGroupSpec
from backends.checkpoint_names import checkpoint_manifest, saved_as
from rlhf_sg.engine_actor import EngineCallError, wait_engine_calls
from rlhf_sg.lora import LoraSpec, LoraTensors, adapter_name, merge_into_bucket, split_lora
from rlhf_sg.packing import unwrap_adapters
from rlhf_sg.sync.gather import GatherStaging, gather_bucket
from rlhf_sg.sync.plan import check_plan, full_shape, manifest_bytes, named_weights, plan_buckets
from rlhf_sg.sync.transports import (
    BroadcastTransport,
    DiskTransport,
    HandOffTransport,
    SenderContext,
    Transport,
)

__all__ = ["DEFAULT_BUCKET_BYTES", "TRANSPORTS", "WeightSyncer"]

DEFAULT_BUCKET_BYTES = 512 * 2**20
TRANSPORTS = ("collective", "tensor", "disk")


class WeightSyncer:
    """Pushes one trainer rank's share of the weights into the rollout engines.

    Create one on every trainer rank with the same arguments (the handles of *all* engines); call
    :meth:`setup` on every rank, then :meth:`sync` on every rank for each new weight version (the
    gathers are collective), and :meth:`close` at the end.

    engines: Ray handles of :class:`~rlhf_sg.engine_actor.EngineActor`, engine 0 first.
    num_senders: trainer ranks that send (default: all, at most one per engine); engine ``e`` is
    served by rank ``e % num_senders``. device: where the trainer's buckets live, "cpu" (gloo side
    groups, shared memory) or "cuda" (NCCL, CUDA IPC); default "cuda" when torch sees one.
    master_address: this rank's address the engines can reach (default: the Ray node address).
    disk_dir: directory for ``transport="disk"`` that every rank and engine can read (default: a
    temporary directory made by rank 0 on its machine). open_group: overrides the engines' backend's
    ``open_sender_group(spec, store)`` for the collective transport (engines that are not
    :class:`~rlhf_sg.engine_actor.EngineActor` s); ``spec.group_name`` is new at every :meth:`setup`.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        engines: Sequence[Any],
        transport: str = "collective",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = 600.0,
        num_senders: int | None = None,
        overlap: bool = True,
        device: str | None = None,
        master_address: str | None = None,
        disk_dir: str | None = None,
        group_name: str = "weight-sync",
        open_group: Callable[[WeightGroupSpec, dist.Store], Any] | None = None,
        lora: LoraSpec | None = None,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"WeightSyncer: rank {rank} outside world_size {world_size}")
        if not engines:
            raise ValueError("WeightSyncer: engines is empty; pass the Ray handles of the rollout engines")
        if transport not in TRANSPORTS:
            raise ValueError(f"WeightSyncer: transport must be one of {TRANSPORTS}, got {transport!r}")
        if not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
            raise ValueError(f"WeightSyncer: bucket_bytes must be a positive int, got {bucket_bytes!r}")
        if timeout_s <= 0:
            raise ValueError(f"WeightSyncer: timeout_s must be > 0, got {timeout_s}")
        if num_senders is not None and num_senders < 1:
            raise ValueError(f"WeightSyncer: num_senders must be >= 1, got {num_senders}")
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"WeightSyncer: device must be 'cpu' or 'cuda', got {device!r}")
        self.rank, self.world_size = rank, world_size
        self.engines = list(engines)
        self.transport, self.overlap = transport, overlap
        self.bucket_bytes, self.timeout_s = bucket_bytes, float(timeout_s)
        self.device = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
        self.master_address, self.disk_dir, self.open_group = master_address, disk_dir, open_group
        self._group_prefix = f"{group_name}-rank{rank}"
        self.group_name = ""  # unique per setup(): some engines register groups by name
        self._setups = 0
        self.num_senders = min(num_senders or world_size, world_size, len(self.engines))
        #: engine indices this rank serves
        self.my_engines = [e for e in range(len(self.engines)) if e % self.num_senders == rank]
        self._transport: Transport | None = None
        self._broken: str | None = None
        self._meta: list[tuple[str, tuple[int, ...], torch.dtype]] | None = None
        self._plan: list[BucketManifest] = []  # run-time names: what the gather reads
        self._wire_plan: list[BucketManifest] = []  # the same buckets under checkpoint names: what engines load
        self._buffers: list[torch.Tensor] = []
        self._staging = GatherStaging()
        self._last_version: int | None = None
        #: per bucket of the last sync: seconds by phase (see :meth:`sync`)
        self.bucket_times: list[dict[str, float]] = []
        #: a LoRA actor: sync merged weights or the adapter (:mod:`rlhf_sg.lora`); None: the model's weights as they are
        self.lora = lora
        self._lora_plan: list[BucketManifest | None] = []  # per bucket: its adapters' A / B (merged mode)
        self._base_sent = False  # adapter mode: the engines hold the base weights this syncer sent
        self.lora_bytes_gathered = 0  # the last sync's LoRA tensors gathered out of ZeRO-3, in bytes

    # ---- set-up --------------------------------------------------------------------------
    def setup(self) -> None:
        """Check the engines accept the transport and set it up (side group, directory).

        Every rank calls it; with ``transport="disk"`` and no ``disk_dir`` it is collective (rank 0
        chooses the directory).
        """
        if self._transport is not None:
            raise RuntimeError(f"WeightSyncer rank {self.rank}: setup() was already called; close() first")
        infos = wait_engine_calls(self._call_mine("describe"), self.timeout_s)
        for e, info in zip(self.my_engines, infos):
            if self.transport not in info["transports"]:
                raise ValueError(
                    f"engine {e} ({info['backend']}) has no {self.transport!r} transport; "
                    f"use one of {info['transports']}"
                )
        self._setups += 1
        self.group_name = f"{self._group_prefix}-setup{self._setups}"
        ctx = SenderContext(
            self.rank, self.world_size, self.engines, self.my_engines, self.timeout_s, self.device, self.group_name
        )
        if self.transport == "collective":
            transport: Transport = BroadcastTransport(ctx, infos, self.master_address, self.open_group)
        elif self.transport == "tensor":
            transport = HandOffTransport(ctx, infos)
        else:
            transport = DiskTransport(ctx, infos, self.disk_dir)
        if self.lora is not None and self.lora.sync_mode == "adapter":
            for e, info in zip(self.my_engines, infos):
                if not info.get("supports_lora_adapter"):
                    raise ValueError(f"engine {e} ({info['backend']}) cannot load a LoRA adapter; use "
                                     "--lora.sync_mode merged")
        transport.setup()
        self._base_sent = False
        if isinstance(transport, DiskTransport):
            self.disk_dir = transport.disk_dir
        self._transport = transport
        self._broken = None

    # ---- sync ----------------------------------------------------------------------------
    def sync(self, model: torch.nn.Module, version: int, with_base: bool = False) -> dict[str, float]:
        """Push the weights of ``model`` (DeepSpeed engine or module) to the engines as ``version``.

        Returns this rank's stats: ``bytes`` (one copy of the model), ``seconds``, ``GBps``,
        ``buckets``, ``engines`` (served here), and seconds summed over buckets: ``gather_seconds``
        (the shard exchange), ``copy_seconds`` (shards into the bucket buffer), ``send_wait_seconds``
        (waiting on the transport for a buffer or at the end), ``engine_seconds`` (the slowest engine's
        receive and load, as it measured them). :attr:`bucket_times` has them per bucket.

        A LoRA model (``lora``): ``merged`` sends every base weight under its engine name with its adapter's
        ``scaling * B @ A`` added in fp32 in the send buffer; ``adapter`` sends the base weights only at the first
        sync after :meth:`setup` or when ``with_base`` (engines that dropped their weights while asleep), then the
        adapter's tensors to every engine's ``load_lora_adapter``. ``lora_bytes_gathered``: the adapter tensors'
        bytes gathered out of ZeRO-3.
        """
        if self._transport is None:
            raise RuntimeError(f"WeightSyncer rank {self.rank}: call setup() before sync()")
        if self._broken:
            raise RuntimeError(
                f"WeightSyncer rank {self.rank}: a previous sync failed ({self._broken}); the side groups may be "
                "out of step: call close() and setup() again"
            )
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"sync: version must be an int >= 0, got {version!r}")
        if self._last_version is not None and version <= self._last_version:
            raise ValueError(f"sync: version {version} is not newer than the last synced {self._last_version}")
        start = time.perf_counter()
        named = named_weights(model)
        adapters: dict[str, LoraTensors] = {}
        lora_named: list[tuple[str, torch.nn.Parameter]] = []
        if self.lora is not None:
            named, adapters, lora_named = split_lora(named)
        send_base = self.lora is None or self.lora.sync_mode == "merged" or with_base or not self._base_sent
        self._prepare_plan(named, adapters if self.lora is not None and self.lora.sync_mode == "merged" else {},
                           model)
        params = dict(named)
        transport = self._transport
        self.lora_bytes_gathered = 0
        total = 0
        try:
            gather_times: list[dict[str, float]] = []
            if send_base:
                self._allocate_buffers()
                gather_times = self._run(transport, params, version, adapters)
                total += sum(manifest_bytes(m) for m in self._plan)
            if self.lora is not None and self.lora.sync_mode == "adapter":
                total += self._send_adapter(lora_named)
                self._base_sent = True
            versions = wait_engine_calls(self._call_mine("finish_weight_update", version), self.timeout_s)
        except BaseException as exc:
            if isinstance(transport, BroadcastTransport):
                self._broken = f"{type(exc).__name__}: {exc}"
                transport.abort(exc)
            raise
        for e, v in zip(self.my_engines, versions):
            if v != version:
                raise EngineCallError(f"engine {e}: finish_weight_update({version}) left weight_version {v}")
        self._last_version = version
        seconds = time.perf_counter() - start
        self.bucket_times = [{**gather_times[k], **transport.times.get(k, {})} for k in range(len(gather_times))]

        def summed(key: str) -> float:
            return float(sum(t.get(key, 0.0) for t in self.bucket_times))

        return {
            "bytes": float(total),
            "seconds": seconds,
            "GBps": total / seconds / 1e9,
            "buckets": float(len(self._plan)),
            "gather_seconds": summed("exchange_s"),
            "copy_seconds": summed("copy_s"),
            "send_wait_seconds": summed("send_wait_s"),
            "engine_seconds": summed("engine_s"),
            "engines": float(len(self.my_engines)),
            "lora_bytes_gathered": float(self.lora_bytes_gathered),
        }

    def _run(self, transport: Transport, params: dict[str, torch.nn.Parameter], version: int,
             adapters: dict[str, LoraTensors]) -> list[dict]:
        """The one double-buffer loop: gather bucket k into a free buffer (merged LoRA: add its adapters), send it,
        reuse after its wait."""
        transport.begin(self._wire_plan, version)
        in_flight: list[Any] = [None] * len(self._buffers)
        times: list[dict[str, float]] = [{} for _ in self._plan]
        for k, manifest in enumerate(self._plan):
            out = slot = None
            if self._buffers and transport.fills(k):
                slot = k % len(self._buffers)
                if in_flight[slot] is not None:
                    transport.wait(in_flight[slot])
                    in_flight[slot] = None
                out = self._buffers[slot][: manifest_bytes(manifest)].view(manifest.dtype)
            gather_bucket([params[s.name] for s in manifest.tensors], manifest, out, self._staging, times[k])
            if self._lora_plan and self._lora_plan[k] is not None:
                self._merge_adapters(manifest, self._lora_plan[k], adapters, out)
            if out is None:
                continue
            handle = transport.send(k, self._wire_plan[k], out)
            if handle is not None:
                if self.overlap:
                    in_flight[slot] = handle
                else:
                    transport.wait(handle)
        for handle in in_flight:
            if handle is not None:
                transport.wait(handle)
        transport.end(self._wire_plan, version)
        return times

    def _merge_adapters(self, manifest: BucketManifest, lora_manifest: BucketManifest,
                        adapters: dict[str, LoraTensors], out: torch.Tensor | None) -> None:
        """Gather the A / B of bucket ``manifest``'s adapted weights (collective: every rank) and add
        ``scaling * B @ A`` to those weights in ``out``, the send buffer (None on a rank that only gathers)."""
        pairs = [adapters[s.name[: -len(".lora_A")]].a if s.name.endswith(".lora_A")
                 else adapters[s.name[: -len(".lora_B")]].b for s in lora_manifest.tensors]
        flat = None if out is None else torch.empty(lora_manifest.numel, dtype=lora_manifest.dtype, device=out.device)
        gather_bucket(pairs, lora_manifest, flat, self._staging)
        self.lora_bytes_gathered += manifest_bytes(lora_manifest)
        if out is None:
            return
        halves = dict(lora_manifest.unflatten(flat))
        deltas = {name: (halves[f"{name}.lora_A"], halves[f"{name}.lora_B"])
                  for name in (s.name for s in manifest.tensors) if f"{name}.lora_A" in halves}
        merge_into_bucket(manifest, out, deltas, self.lora.scaling)

    def _send_adapter(self, lora_named: list[tuple[str, torch.nn.Parameter]]) -> int:
        """Adapter mode: gather the LoRA tensors only (one bucket, CPU) and load them into every engine served
        here; returns the bytes sent to one engine."""
        if not lora_named:
            raise ValueError("--lora.sync_mode adapter: the model has no LoRA tensors")
        meta = [(adapter_name(name), full_shape(p), p.dtype) for name, p in lora_named]
        dtypes = {dtype for _, _, dtype in meta}
        if len(dtypes) != 1:
            raise ValueError(f"--lora.sync_mode adapter: the LoRA tensors have dtypes {sorted(map(str, dtypes))}; "
                             "they must share the base's dtype")
        manifest = plan_buckets(meta, sum(math.prod(s) for _, s, _ in meta) * next(iter(dtypes)).itemsize)[0]
        flat = torch.empty(manifest.numel, dtype=manifest.dtype, device=self.device) if self.my_engines else None
        gather_bucket([p for _, p in lora_named], manifest, flat, self._staging)
        self.lora_bytes_gathered += manifest_bytes(manifest)
        if self.my_engines:
            import ray

            ref = ray.put(flat.cpu())
            config = self.lora.peft_config()
            wait_engine_calls(self._call_mine("load_lora_adapter", manifest, ref, config), self.timeout_s)
        return manifest_bytes(manifest)

    def _prepare_plan(self, named: list[tuple[str, torch.nn.Parameter]],
                      adapters: dict[str, LoraTensors] | None = None, model: torch.nn.Module | None = None) -> None:
        """Plan buckets when the model's names/shapes/dtypes changed, check them with the engines first. With
        ``adapters`` (merged LoRA) each bucket also gets the manifest of its weights' A / B. ``model``: what
        ``named`` came from, whose checkpoint names the engines are sent (:func:`_transformers_model`)."""
        meta = [(name, full_shape(p), p.dtype) for name, p in named]
        if meta == self._meta and bool(adapters) == bool(self._lora_plan):
            return
        plan = plan_buckets(meta, self.bucket_bytes)
        renames = saved_as(_transformers_model(model), meta) if model is not None else {}
        wire_plan = [checkpoint_manifest(manifest, renames) for manifest in plan]
        check_plan(
            wire_plan,
            lambda p: wait_engine_calls(self._call_mine("check_manifests", p), self.timeout_s),
            self.world_size,
            self.world_size > 1 and dist.is_available() and dist.is_initialized(),
        )
        self._meta, self._plan, self._wire_plan = meta, plan, wire_plan
        self._buffers = []
        self._lora_plan = []
        if adapters:
            for manifest in plan:
                lora_meta = []
                for spec in manifest.tensors:
                    if spec.name in adapters:
                        pair = adapters[spec.name]
                        lora_meta += [(f"{spec.name}.lora_A", full_shape(pair.a), pair.a.dtype),
                                      (f"{spec.name}.lora_B", full_shape(pair.b), pair.b.dtype)]
                if not lora_meta:
                    self._lora_plan.append(None)
                    continue
                dtypes = {d for _, _, d in lora_meta}
                if dtypes != {manifest.dtype}:
                    raise ValueError(f"merged LoRA sync: adapter dtypes {sorted(map(str, dtypes))} differ from their "
                                     f"base weights' {manifest.dtype}; the adapter must have the base's dtype")
                size = sum(math.prod(s) for _, s, _ in lora_meta) * manifest.dtype.itemsize
                self._lora_plan.append(plan_buckets(lora_meta, size)[0])

    def _allocate_buffers(self) -> None:
        """The plan's bucket buffers, unless held already (they are freed on a plan change and by
        :meth:`release_buffers`)."""
        plan, transport = self._plan, self._transport
        if self._buffers or not any(transport.fills(k) for k in range(len(plan))):
            return
        count = min(transport.max_buffers() if self.overlap else 1, len(plan))
        self._buffers = transport.buffers(max(manifest_bytes(m) for m in plan), count)

    def release_buffers(self) -> None:
        """Free the bucket buffers and the gather staging; the next sync allocates them again. Colocated runs
        call it after each sync, so the engines' KV cache gets that memory back while they generate."""
        self._buffers = []
        self._staging = GatherStaging()

    def buffer_bytes(self) -> int:
        """Bytes this rank holds for syncs between them: bucket buffers and gather staging."""
        return sum(b.nbytes for b in self._buffers) + self._staging.nbytes

    # ---- helpers and lifetime --------------------------------------------------------------
    def _call_mine(self, method: str, *args: Any) -> list[tuple[int, str, Any]]:
        return [(e, method, getattr(self.engines[e], method).remote(*args)) for e in self.my_engines]

    def close(self) -> None:
        """Leave the side group, free the buffers, delete a disk directory made here. The engines stay up."""
        errors = self._transport.close() if self._transport is not None else []
        if isinstance(self._transport, DiskTransport):
            self.disk_dir = self._transport.disk_dir
        self._transport = None
        self._buffers = []
        self._meta, self._plan, self._wire_plan = None, [], []
        self._lora_plan = []
        if errors:
            raise EngineCallError(f"WeightSyncer rank {self.rank}: close: {'; '.join(errors)}")


def _transformers_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside ``model``: a DeepSpeed engine's module, torch.compile's original, a PEFT
    model's base model."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if isinstance(inner, torch.nn.Module):
            model = inner
            continue
        base = unwrap_adapters(model)
        if base is model:
            return model
        model = base
