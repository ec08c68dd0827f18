"""``python -m rlhf_sg.bench weight-sync``: bucketed weight sync against the per-tensor baseline.

A ZeRO-3 trainer (``--ranks`` Ray actors, gloo on CPU) pushes a model of about 100M parameters into
``--engines`` embedded rollout engines. In every round, one after another:

(a) baseline: each parameter gathered alone and broadcast by rank 0 to all engines, one engine
    call per tensor (:class:`PerTensorBaseline`, here rather than in the library);
(b) buckets, one sender (rank 0), no overlap;
(c) buckets, every rank a sender for its engines, gather of bucket k+1 overlapped with the send of k;
(d) the limit: the same bytes as one flat broadcast from a ready buffer per sender (the topology of
    (c)), no gather, received into a ready buffer (nothing loaded);

and, to explain (c) against (d), the ZeRO-3 gather of all buckets alone (no send), and where a bucket's
time goes in (b) and (c), measured by the syncer on rank 0 and by the engines: the shard exchange
(gather), the copy into the bucket buffer (copy), the sender blocked on the broadcast (wire: with
overlap, only what the gather did not hide) and the engine's receive and load (engine). GB/s is one
copy of the model over the wall time of the sync (every engine receives the whole model). Medians
over the rounds; the ratios are c/a and c/d.

:class:`Zero3SyncRank` (one trainer rank with a weight syncer) is also what the weight-sync tests
drive.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch

from rlhf_sg.distributed import (
    create_group_store,
    init_torch_distributed,
    open_side_group,
    side_broadcast,
    zero3_config,
)
from rlhf_sg.sync import GatherStaging, gather_bucket, gathered, named_weights, plan_buckets

__all__ = ["FlatReceiver", "PerTensorBaseline", "Zero3SyncRank", "main", "start_trainer_ranks"]


class PerTensorBaseline:
    """The baseline the bucketed sync is measured against: every parameter gathered alone, broadcast
    by trainer rank 0 on the same side group as the syncer's, one engine call per tensor.

    The same interface as :class:`~rlhf_sg.sync.WeightSyncer` (setup / sync / close); every rank
    takes part in each gather, rank 0 alone sends.
    """

    def __init__(self, rank: int, world_size: int, engines: list, timeout_s: float = 600.0, **_: Any):
        self.rank, self.world_size, self.engines, self.timeout_s = rank, world_size, list(engines), timeout_s
        self.my_engines = list(range(len(self.engines))) if rank == 0 else []
        self.bucket_times: list[dict[str, float]] = []
        self._transport = None

    def setup(self) -> None:
        from rlhf_sg.engine_actor import wait_engine_calls
        from rlhf_sg.sync.transports import BroadcastTransport, SenderContext

        ctx = SenderContext(
            self.rank, self.world_size, self.engines, self.my_engines, self.timeout_s, torch.device("cpu"),
            f"per-tensor-baseline-{time.monotonic_ns()}",
        )
        infos = wait_engine_calls(ctx.call_mine("describe"), self.timeout_s)
        self._transport = BroadcastTransport(ctx, infos)
        self._transport.setup()

    def sync(self, model: torch.nn.Module, version: int) -> dict[str, float]:
        from backends.base import BucketManifest, TensorSpec
        from rlhf_sg.engine_actor import wait_engine_calls
        from rlhf_sg.sync import full_shape

        transport, ctx = self._transport, self._transport.ctx
        named = named_weights(model)
        total = 0
        for name, param in named:
            shape = full_shape(param)
            numel = 1
            for size in shape:
                numel *= size
            manifest = BucketManifest((TensorSpec(name, shape, param.dtype, 0),), param.dtype, numel)
            total += numel * param.dtype.itemsize
            if ctx.my_engines:
                transport.begin([manifest], version)  # one engine call for this tensor
            with gathered([param]):
                if ctx.my_engines:
                    transport.wait(transport.send(0, manifest, param.data.reshape(-1)))
                    transport.end([manifest], version)
        versions = wait_engine_calls(ctx.call_mine("finish_weight_update", version), self.timeout_s)
        if any(v != version for v in versions):
            raise RuntimeError(f"per-tensor baseline: engines report weight versions {versions}, not {version}")
        return {"buckets": float(len(named)), "bytes": float(total), "engines": float(len(ctx.my_engines))}

    def close(self) -> None:
        self._transport.close()


class Zero3SyncRank:
    """One DeepSpeed ZeRO-3 rank holding a causal LM, with a :class:`~rlhf_sg.sync.WeightSyncer`."""

    def __init__(self, rank: int, world_size: int, master_port: int, model_path: str, timeout_s: float = 300.0,
                 lora_rank: int = 0):
        torch.set_num_threads(1)
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        init_torch_distributed(rank, world_size, "127.0.0.1", master_port, backend="gloo", timeout_s=timeout_s)
        import deepspeed
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.lora = None
        if lora_rank:  # a LoRA policy: all-linear adapters, B random (a trained adapter's)
            from rlhf_sg.lora import LoraSpec, apply_lora

            self.lora = LoraSpec(rank=lora_rank, alpha=2.0 * lora_rank)
            model = apply_lora(model, self.lora, disable_dropout=True)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "lora_B" in name:
                        p.normal_(0.0, 0.01)
        self.engine, *_ = deepspeed.initialize(model=model, config=zero3_config(train=False))
        self.syncer = None
        self._flat: torch.Tensor | None = None

    def shard_numels(self) -> dict[str, tuple[int, int]]:
        """``name -> (elements held on this rank, elements of the full tensor)``."""
        return {name: (p.ds_tensor.numel(), p.ds_numel) for name, p in named_weights(self.engine)}

    @torch.no_grad()
    def perturb(self, seed: int, scale: float = 0.02) -> None:
        """Change the weights the way an optimizer step does: each rank updates its own shards."""
        gen = torch.Generator().manual_seed(seed * 1000 + self.rank)
        for _, p in named_weights(self.engine):
            p.ds_tensor.add_(torch.randn(p.ds_tensor.shape, generator=gen) * scale)

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every full weight, gathered one at a time (small models only; collective: call on every rank)."""
        state = {}
        for name, p in named_weights(self.engine):
            with gathered([p]):
                state[name] = p.data.detach().clone()
        return state

    def setup_syncer(self, engines: list, baseline: bool = False, lora_sync: str | None = None, **kwargs: Any) -> None:
        """A :class:`~rlhf_sg.sync.WeightSyncer` (or, ``baseline=True``, the :class:`PerTensorBaseline`);
        ``lora_sync``: a LoRA rank's sync mode ("merged" or "adapter")."""
        import dataclasses

        from rlhf_sg.sync import WeightSyncer

        if lora_sync is not None:
            kwargs["lora"] = dataclasses.replace(self.lora, sync_mode=lora_sync)
        cls = PerTensorBaseline if baseline else WeightSyncer
        self.syncer = cls(self.rank, self.world_size, engines, **kwargs)
        self.syncer.setup()

    def bucket_times(self) -> list[dict[str, float]]:
        """Seconds by phase for each bucket of the last sync (see ``WeightSyncer.bucket_times``)."""
        return self.syncer.bucket_times

    def sync(self, version: int) -> dict[str, float]:
        return self.syncer.sync(self.engine, version)

    def close_syncer(self) -> None:
        if self.syncer is not None:
            self.syncer.close()
            self.syncer = None

    def gather_only(self, bucket_bytes: int, deepspeed_api: bool = False) -> float:
        """Seconds to gather every bucket into a buffer, sending nothing (the gather's share of a sync).

        ``deepspeed_api``: gather each bucket with ``deepspeed.zero.GatheredParameters`` (per-parameter
        all-gathers) instead of the sync's shard exchange, for comparison.
        """
        named = named_weights(self.engine)
        plan = plan_buckets([(n, p.ds_shape, p.dtype) for n, p in named], bucket_bytes)
        params = dict(named)
        buffer = torch.empty(max(m.numel for m in plan), dtype=plan[0].dtype)
        staging = GatherStaging()
        start = time.perf_counter()
        for manifest in plan:
            bucket = [params[s.name] for s in manifest.tensors]
            out = buffer[: manifest.numel]
            if deepspeed_api:
                with gathered(bucket), torch.no_grad():
                    for spec, p in zip(manifest.tensors, bucket):
                        out[spec.offset : spec.offset + spec.numel].copy_(p.data.reshape(-1))
            else:
                gather_bucket(bucket, manifest, out, staging)
        return time.perf_counter() - start

    # ---- the limit: one flat broadcast of ready bytes ----------------------------------------
    def open_flat_store(self) -> int:
        self._flat_store = create_group_store("127.0.0.1", self.timeout_s)
        return self._flat_store.port

    def open_flat_group(self, world: int, numel: int) -> None:
        self._flat_group = open_side_group(self._flat_store, 0, world, "gloo", self.timeout_s, f"flat-r{self.rank}")
        self._flat = torch.randn(numel)

    def broadcast_flat(self) -> None:
        side_broadcast(self._flat_group, self._flat, 0, self.timeout_s).wait()


class FlatReceiver:
    """A process that receives the limit's flat broadcast into a ready buffer."""

    def __init__(self):
        torch.set_num_threads(1)

    def join(self, port: int, rank: int, world: int, numel: int, timeout_s: float) -> None:
        import datetime

        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
        self._group = open_side_group(store, rank, world, "gloo", timeout_s, "flat")
        self._buffer = torch.empty(numel)
        self._timeout_s = timeout_s

    def receive(self) -> None:
        side_broadcast(self._group, self._buffer, 0, self._timeout_s).wait()


def start_trainer_ranks(model_path: str, world_size: int, timeout_s: float = 300.0, lora_rank: int = 0) -> list:
    """``world_size`` :class:`Zero3SyncRank` Ray actors (one CPU each, DeepSpeed's CPU accelerator); ``lora_rank``:
    a LoRA policy of that rank."""
    import ray

    from rlhf_sg.distributed import free_port

    env = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cls = ray.remote(num_cpus=1, runtime_env={"env_vars": env})(Zero3SyncRank)
    port = free_port()
    ranks = [cls.remote(r, world_size, port, model_path, timeout_s, lora_rank) for r in range(world_size)]
    ray.get([r.shard_numels.remote() for r in ranks], timeout=timeout_s)
    return ranks


def _timed(refs: list, timeout_s: float) -> tuple[float, list]:
    import ray

    start = time.perf_counter()
    out = ray.get(refs, timeout=timeout_s)
    return time.perf_counter() - start, out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rlhf_sg.bench weight-sync", description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="100m", help="rlhf_sg.tiny size preset (default 100m)")
    parser.add_argument("--arch", default="qwen2", choices=["qwen2", "llama"])
    parser.add_argument("--ranks", type=int, default=2, help="ZeRO-3 trainer ranks")
    parser.add_argument("--engines", type=int, default=2, help="embedded rollout engines")
    parser.add_argument("--bucket-mb", type=float, default=32.0, help="bucket size in MiB (overlap needs >= 2)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of (a) (b) (c) (d), alternated")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="compare a LoRA policy's merged and adapter syncs of this rank with the full model's sync")
    args = parser.parse_args(argv)
    if args.lora_rank:
        return lora_main(args)

    import ray

    from backends.base import BackendConfig
    from rlhf_sg.engine_actor import start_engine_actors
    from rlhf_sg.tiny import save_tiny_model

    for flag, value in (("--ranks", args.ranks), ("--engines", args.engines), ("--rounds", args.rounds)):
        if value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")
    if args.bucket_mb <= 0:
        parser.error(f"--bucket-mb must be > 0, got {args.bucket_mb}")
    bucket_bytes = int(args.bucket_mb * 2**20)
    workdir = tempfile.mkdtemp(prefix="rlhf_sg-bench-weight-sync-")
    try:
        model_path = save_tiny_model(os.path.join(workdir, "model"), arch=args.arch, size=args.size)
        ray.init(num_cpus=args.ranks + args.engines, include_dashboard=False, log_to_driver=False)
        engines = start_engine_actors("hf", BackendConfig(model_path=model_path, num_threads=1), args.engines)
        ranks = start_trainer_ranks(model_path, args.ranks, args.timeout_s)
        shards = ray.get(ranks[0].shard_numels.remote())
        numel = sum(full for _, full in shards.values())
        model_bytes = numel * 4
        senders = min(args.ranks, args.engines)
        receivers = _start_flat_receivers(ranks, senders, args.engines, numel, args.timeout_s)

        modes = {
            "a": dict(baseline=True),
            "b": dict(num_senders=1, overlap=False),
            "c": dict(num_senders=senders, overlap=True),
        }
        times: dict[str, list[float]] = {k: [] for k in ("a", "b", "c", "d", "g", "g_ds")}
        phases: dict[str, list[dict[str, float]]] = {"b": [], "c": []}  # rank 0's buckets, every round
        version = 0
        for _ in range(args.rounds):
            for key, kwargs in modes.items():
                ray.get(
                    [
                        r.setup_syncer.remote(engines, bucket_bytes=bucket_bytes, timeout_s=args.timeout_s, **kwargs)
                        for r in ranks
                    ],
                    timeout=args.timeout_s,
                )
                version += 1  # the first sync after set-up plans and checks the buckets: not timed
                ray.get([r.sync.remote(version) for r in ranks], timeout=args.timeout_s)
                version += 1
                seconds, stats = _timed([r.sync.remote(version) for r in ranks], args.timeout_s)
                times[key].append(seconds)
                if key in phases:
                    buckets = int(stats[0]["buckets"])
                    phases[key] += ray.get(ranks[0].bucket_times.remote(), timeout=args.timeout_s)
                ray.get([r.close_syncer.remote() for r in ranks], timeout=args.timeout_s)
            refs = [ranks[s].broadcast_flat.remote() for s in range(senders)]
            times["d"].append(_timed(refs + [rc.receive.remote() for rc in receivers], args.timeout_s)[0])
            times["g"].append(_timed([r.gather_only.remote(bucket_bytes) for r in ranks], args.timeout_s)[0])
            refs = [r.gather_only.remote(bucket_bytes, deepspeed_api=True) for r in ranks]
            times["g_ds"].append(_timed(refs, args.timeout_s)[0])
    finally:
        ray.shutdown()
        shutil.rmtree(workdir, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in times.items()}
    gbps = {k: model_bytes / v / 1e9 for k, v in med.items()}
    print(
        f"weight-sync: {args.arch} {args.size} ({numel / 1e6:.1f}M params, {model_bytes / 1e6:.0f} MB fp32), "
        f"{args.ranks} ZeRO-3 ranks (gloo, CPU), {args.engines} engines, buckets of {args.bucket_mb:g} MiB "
        f"({buckets} buckets), median of {args.rounds} rounds"
    )
    rows = [
        ("a", "baseline: per tensor, rank 0 sends, 1 call/tensor"),
        ("b", "buckets, one sender, no overlap"),
        ("c", f"buckets, {senders} senders, overlap"),
        ("d", f"limit: one flat broadcast per sender ({senders}), no gather"),
        ("g", "ZeRO-3 gather alone, the sync's shard exchange, no send"),
        ("g_ds", "ZeRO-3 gather alone, DeepSpeed GatheredParameters, no send"),
    ]
    for key, label in rows:
        runs = " ".join(f"{t:.2f}" for t in times[key])
        print(f"  {'(' + key + ')':<7}{label:<60} {med[key]:7.3f} s  {gbps[key]:6.3f} GB/s   [{runs}]")
    print(f"  c/a = {med['a'] / med['c']:.2f}x (target >= 5)   c/d = {med['d'] / med['c']:.0%} (target >= 70%)")
    ratios = f"b/a = {med['a'] / med['b']:.2f}x   c/b = {med['b'] / med['c']:.2f}x"
    print(f"  {ratios}   g/c = {med['g'] / med['c']:.0%}   g_ds/g = {med['g_ds'] / med['g']:.2f}x")
    print(f"  per bucket ({buckets} buckets of <= {args.bucket_mb:g} MiB, median over buckets and rounds, ms):")
    header = f"    {'':<22}{'gather':>9}{'copy':>9}{'wire':>9}{'engine':>9}"
    print(header + "   (summed over a sync, s: gather copy wire engine)")
    for key, label in (("b", "(b) one sender, serial"), ("c", "(c) overlap")):
        cols = [("exchange_s", "gather"), ("copy_s", "copy"), ("send_wait_s", "wire"), ("engine_s", "engine")]
        med_ms = [1e3 * statistics.median(t.get(c, 0.0) for t in phases[key]) for c, _ in cols]
        sums = [sum(t.get(c, 0.0) for t in phases[key]) / args.rounds for c, _ in cols]
        print(f"    {label:<22}" + "".join(f"{v:9.1f}" for v in med_ms) + "   " + " ".join(f"{v:.3f}" for v in sums))
    # On one machine the gather's bytes cross the same loopback and cores as the sends: with perfect
    # overlap (c) still costs about (d) plus the gather's traffic, which bounds c/d below 100%.
    print(f"  estimate when gather and send share the cores: c/d <= d/(d+g) = {med['d'] / (med['d'] + med['g']):.0%}")


def lora_main(args) -> None:
    """Bytes and seconds per sync of the full model (no LoRA), a LoRA policy merged, and its adapter alone
    (every rank a sender, overlap; median of ``--rounds`` syncs after an untimed first)."""
    import ray

    from backends.base import BackendConfig
    from rlhf_sg.engine_actor import start_engine_actors
    from rlhf_sg.tiny import save_tiny_model

    if args.lora_rank < 1:
        raise SystemExit(f"--lora-rank must be >= 1, got {args.lora_rank}")
    bucket_bytes = int(args.bucket_mb * 2**20)
    workdir = tempfile.mkdtemp(prefix="rlhf_sg-bench-weight-sync-")
    results: dict[str, tuple[float, float, float]] = {}  # mode -> (bytes, median seconds, LoRA bytes gathered)
    try:
        model_path = save_tiny_model(os.path.join(workdir, "model"), arch=args.arch, size=args.size)
        ray.init(num_cpus=args.ranks + args.engines, include_dashboard=False, log_to_driver=False)
        engines = start_engine_actors("hf", BackendConfig(model_path=model_path, num_threads=1), args.engines)
        version = 0
        for lora_rank, modes in ((0, [None]), (args.lora_rank, ["merged", "adapter"])):
            ranks = start_trainer_ranks(model_path, args.ranks, args.timeout_s, lora_rank=lora_rank)
            for mode in modes:
                ray.get([r.setup_syncer.remote(engines, bucket_bytes=bucket_bytes, timeout_s=args.timeout_s,
                                               lora_sync=mode) for r in ranks], timeout=args.timeout_s)
                version += 1  # untimed: plans and checks the buckets (adapter mode: sends the base once)
                ray.get([r.sync.remote(version) for r in ranks], timeout=args.timeout_s)
                seconds, stats = [], None
                for _ in range(args.rounds):
                    version += 1
                    elapsed, stats = _timed([r.sync.remote(version) for r in ranks], args.timeout_s)
                    seconds.append(elapsed)
                results[mode or "full"] = (stats[0]["bytes"], statistics.median(seconds),
                                           stats[0].get("lora_bytes_gathered", 0.0))
                ray.get([r.close_syncer.remote() for r in ranks], timeout=args.timeout_s)
            for r in ranks:
                ray.kill(r)
    finally:
        ray.shutdown()
        shutil.rmtree(workdir, ignore_errors=True)
    full_bytes, full_s, _ = results["full"]
    print(f"weight-sync --lora-rank {args.lora_rank}: {args.arch} {args.size}, {args.ranks} ZeRO-3 ranks (gloo, CPU), "
          f"{args.engines} embedded engines, buckets of {args.bucket_mb:g} MiB, median of {args.rounds} syncs")
    for mode, label in (("full", "full fine-tune: every weight"), ("merged", "LoRA merged: W + s*B@A per bucket"),
                        ("adapter", "LoRA adapter: LoRA tensors only")):
        nbytes, secs, lora = results[mode]
        print(f"  {mode:<8}{label:<38}{nbytes / 1e6:10.2f} MB/engine {secs:8.3f} s  LoRA gathered {lora / 1e6:7.2f} MB"
              f"   bytes x{full_bytes / nbytes:6.1f} fewer, {full_s / secs:5.2f}x faster than full")


def _start_flat_receivers(ranks: list, senders: int, num_engines: int, numel: int, timeout_s: float) -> list:
    """One :class:`FlatReceiver` per engine, joined to its sender's group as in (c), warmed up."""
    import ray

    cls = ray.remote(num_cpus=0)(FlatReceiver)
    receivers = [cls.remote() for _ in range(num_engines)]
    ports = ray.get([ranks[s].open_flat_store.remote() for s in range(senders)], timeout=timeout_s)
    groups: dict[int, list[int]] = {s: [e for e in range(num_engines) if e % senders == s] for s in range(senders)}
    refs = [ranks[s].open_flat_group.remote(1 + len(groups[s]), numel) for s in range(senders)]
    for s, members in groups.items():
        refs += [
            receivers[e].join.remote(ports[s], i + 1, 1 + len(members), numel, timeout_s) for i, e in enumerate(members)
        ]
    ray.get(refs, timeout=timeout_s)
    # One untimed broadcast first, as (a)-(c) each sync once untimed: fresh buffers page-fault.
    warm = [ranks[s].broadcast_flat.remote() for s in range(senders)] + [r.receive.remote() for r in receivers]
    ray.get(warm, timeout=timeout_s)
    return receivers


if __name__ == "__main__":
    main()
