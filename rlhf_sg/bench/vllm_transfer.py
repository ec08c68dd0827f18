"""vLLM's own weight-transfer engines against this project's transports, into a real ``vllm.LLM``.

``python -m rlhf_sg.bench vllm-transfer [--pairs ipc,nccl] [--size 100m] [--bucket-mb 64] [--rounds 3]``

Runs on a GPU node with the CUDA build of vLLM 0.32 (``pip install 'rlhf-sg[vllm]'``). Each variant
gets a fresh engine process (``VLLMBackend`` on ``cuda:0``) and a trainer process holding the same
perturbed weights, connected by a pipe that stands in for the Ray call; the trainer times whole
syncs (first byte to ``finish``), the engine then checks every weight against the trainer's.

Pairs (time ours / time vLLM's; <= 1.0 means ours is at least as fast):

* ``ipc`` (one GPU, colocated): ours = flat buckets written into two reused trainer buffers, each
  handed over with ``VLLMBackend.pack_tensor_bucket`` (CUDA IPC + GPU UUID) and loaded with
  ``update_weights_from_tensor``; vLLM's = ``WeightTransferConfig(backend="ipc")`` driven by
  ``IPCTrainerWeightTransferEngine`` (packed, buffer = the same bucket size).
* ``nccl`` (two GPUs: trainer on ``cuda:1``): ours = flat buckets broadcast on the side group
  (``init_weight_update_group`` / ``update_weights_from_collective``); vLLM's =
  ``WeightTransferConfig(backend="nccl")`` driven by ``NCCLTrainerWeightTransferEngine`` (packed,
  same buffer size, two buffers as ours).

Every run also times ``engine-load``: the engine loading the same buckets from its own memory
(no transport), so each variant's time / that one is its transport's overhead.

Without CUDA it prints why neither of vLLM's engines can run (the errors vLLM raises) and stops.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import tempfile
import threading
import time
import traceback
from typing import Any

import torch

PAIRS = {"ipc": ("ours-ipc", "vllm-ipc"), "nccl": ("ours-nccl", "vllm-nccl")}
#: the engine loading the same buckets from its own memory: what no transport can beat
REFERENCE = "engine-load"
TIMEOUT_S = 600.0


def probe_cpu() -> dict[str, str]:
    """What vLLM 0.32's weight-transfer engines raise without CUDA: ``{engine: error}``.

    The NCCL engines (``nccl``, ``sparse_nccl``, ``nccl_m2n``) open a ``PyNcclCommunicator``, which
    loads libnccl only for CUDA / ROCm platforms; the IPC engine reads the GPU's UUID at
    construction and moves bytes with ``rebuild_cuda_tensor``; ``sharded_rdt`` uses CUDA streams and
    events. None has a CPU / gloo path.
    """
    found = {}
    try:
        from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary

        NCCLLibrary()
        found["nccl"] = "no error (libnccl loaded)"
    except Exception as exc:
        found["nccl"] = f"{type(exc).__name__}: {exc}"
    try:
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerWeightTransferEngine

        IPCTrainerWeightTransferEngine(client=None, source=None)
        found["ipc"] = "no error"
    except Exception as exc:
        found["ipc"] = f"{type(exc).__name__}: {exc}"
    return found


# ---- the weights both sides agree on ------------------------------------------------------------
def trainer_weights(model_path: str, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The model's weights plus seeded noise, in ``dtype`` on the CPU, in model order."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=gen) * 0.01
        out[name] = (param.detach() + noise).to(dtype).contiguous()
    return out


def plan(named: dict[str, torch.Tensor], bucket_bytes: int) -> list:
    """Flat buckets of at most ``bucket_bytes`` (a larger tensor alone), as manifests, in model order."""
    from backends.base import BucketManifest, TensorSpec

    groups, group, size = [], [], 0
    for name, tensor in named.items():
        nbytes = tensor.numel() * tensor.element_size()
        if group and size + nbytes > bucket_bytes:
            groups.append(group)
            group, size = [], 0
        group.append(name)
        size += nbytes
    if group:
        groups.append(group)
    dtype = next(iter(named.values())).dtype
    manifests = []
    for names in groups:
        specs, offset = [], 0
        for name in names:
            specs.append(TensorSpec(name, tuple(named[name].shape), dtype, offset))
            offset += named[name].numel()
        manifests.append(BucketManifest(tuple(specs), dtype, offset))
    return manifests


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the engine process ----------------------------------------------------------------------------
def _engine_main(variant: str, model_path: str, opts: dict[str, Any], conn, results) -> None:
    try:
        from backends.base import BackendConfig
        from backends.vllm_backend import VLLMBackend

        extra: dict[str, Any] = {"gpu_memory_utilization": opts["gpu_memory_utilization"]}
        if variant.startswith("vllm-"):
            extra["engine_kwargs"] = {"weight_transfer_config": {"backend": variant.removeprefix("vllm-")}}
        config = BackendConfig(
            model_path=model_path, device=opts["device"], dtype=opts["dtype"], max_model_len=256, extra=extra
        )
        if opts["device"] == "cpu":
            config.num_threads = 1
        backend = VLLMBackend(config)
        conn.send(("ready", None))
        state: dict[str, Any] = {}
        while True:
            op, args = conn.recv()
            if op == "stop":
                break
            try:
                if op == "tensor":
                    backend.update_weights_from_tensor(*args)
                    reply = None
                elif op == "group":
                    backend.init_weight_update_group(args)
                    reply = None
                elif op == "collective":
                    backend.update_weights_from_collective(args, 0)
                    reply = None
                elif op == "finish":
                    backend.finish_weight_update(args)
                    reply = None
                elif op == "vllm":  # vLLM's own control plane, called as its offline API documents
                    method, kwargs = args
                    reply = getattr(backend.llm, method)(**kwargs)
                elif op == "selfload":  # the reference: the same buckets from this process's own memory
                    if "local" not in state:
                        dtype, device = getattr(torch, opts["dtype"]), torch.device(opts["device"], 0)
                        if device.type == "cpu":
                            device = torch.device("cpu")
                        named = trainer_weights(model_path, opts["seed"], dtype)
                        named = {n: t.to(device) for n, t in named.items()}
                        buffer = torch.empty(max(m.numel for m in args[0]), dtype=dtype, device=device)
                        state["local"] = (named, buffer)
                    named, buffer = state["local"]
                    for manifest in args[0]:
                        backend.update_weights_from_tensor(manifest, _fill(buffer, named, manifest))
                    backend.finish_weight_update(args[1])
                    reply = None
                elif op == "check":
                    expected = trainer_weights(model_path, opts["seed"], getattr(torch, opts["dtype"]))
                    reply = [n for n, t in expected.items() if not torch.equal(backend.get_weights_by_name(n), t)]
                else:
                    raise ValueError(f"unknown op {op!r}")
                conn.send(("ok", reply))
            except Exception as exc:
                conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        backend.shutdown()
    except Exception as exc:
        results.put((variant, "engine", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        conn.send(("error", f"engine failed: {exc}"))


class _PipeClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol over the pipe to the engine process (one call at a time)."""

    def __init__(self, conn):
        self.conn = conn
        self.lock = threading.Lock()

    def call(self, op: str, args: Any) -> Any:
        with self.lock:
            self.conn.send((op, args))
            return _reply(self, op)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.call("vllm", ("init_weight_transfer_engine", {"request": {"init_info": init_info}}))

    def shutdown_weight_transfer_engine(self) -> None:
        self.call("vllm", ("shutdown_weight_transfer_engine", {}))

    def start_weight_update(self) -> None:
        self.call("vllm", ("start_weight_update", {}))

    def update_weights(self, update_info) -> None:
        self.call("vllm", ("update_weights", {"request": {"update_info": update_info}}))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.call("vllm", ("finish_weight_update", {"weight_version": weight_version}))


# ---- the trainer process ---------------------------------------------------------------------------
def _trainer_main(variant: str, model_path: str, opts: dict[str, Any], conn, results) -> None:
    try:
        device = torch.device("cpu" if opts["device"] == "cpu" else "cuda:1" if variant.endswith("nccl") else "cuda:0")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dtype = getattr(torch, opts["dtype"])
        named = {n: t.to(device) for n, t in trainer_weights(model_path, opts["seed"], dtype).items()}
        manifests = plan(named, opts["bucket_bytes"])
        client = _PipeClient(conn)
        status, reply = conn.recv() if conn.poll(TIMEOUT_S) else ("error", "the engine did not start in time")
        if status != "ready":
            raise RuntimeError(f"engine: {reply}")
        sync = _SYNCS[variant](named, manifests, client, device, opts)
        times = []
        for _ in range(opts["rounds"] + 1):  # the first is a warm-up
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            sync()
            times.append(time.perf_counter() - t0)
        wrong = client.call("check", None)
        nbytes = sum(m.numel * m.dtype.itemsize for m in manifests)
        results.put((variant, "ok", {"times": times[1:], "wrong": wrong, "bytes": nbytes, "buckets": len(manifests)}))
        conn.send(("stop", None))
    except Exception as exc:
        results.put((variant, "trainer", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        try:
            conn.send(("stop", None))
        except Exception:
            pass


def _fill(buffer: torch.Tensor, named, manifest) -> torch.Tensor:
    flat = buffer[: manifest.numel]
    for spec in manifest.tensors:
        flat[spec.offset : spec.offset + spec.numel].copy_(named[spec.name].reshape(-1))
    return flat


def _ours_ipc(named, manifests, client, device, opts):
    from backends.vllm_backend import VLLMBackend

    dtype = manifests[0].dtype
    buffers = [torch.empty(max(m.numel for m in manifests), dtype=dtype, device=device) for _ in range(2)]
    version = [0]

    def sync():
        in_flight = 0
        for k, manifest in enumerate(manifests):
            if in_flight == 2:  # the call that read this buffer must have returned
                _reply(client)
                in_flight -= 1
            flat = _fill(buffers[k % 2], named, manifest)
            client.conn.send(("tensor", (manifest, VLLMBackend.pack_tensor_bucket(manifest, flat, 1))))
            in_flight += 1
        for _ in range(in_flight):
            _reply(client)
        version[0] += 1
        client.call("finish", version[0])

    return sync


def _ours_nccl(named, manifests, client, device, opts):
    import datetime

    import torch.distributed as dist

    from backends.base import WeightGroupSpec
    from backends.embedded import open_weight_update_group

    spec = WeightGroupSpec("127.0.0.1", _free_port(), 1, 2, "bench_weights", "nccl", TIMEOUT_S)
    holder: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: holder.update(group=open_weight_update_group(spec, 0)), daemon=True)
    thread.start()
    client.call("group", spec)
    thread.join(TIMEOUT_S)
    group = holder["group"]
    dtype = manifests[0].dtype
    buffers = [torch.empty(max(m.numel for m in manifests), dtype=dtype, device=device) for _ in range(2)]
    version = [0]

    def broadcast(flat):
        opts_ = dist.BroadcastOptions()
        opts_.rootRank, opts_.rootTensor, opts_.timeout = 0, 0, datetime.timedelta(seconds=TIMEOUT_S)
        return group.broadcast([flat], opts_)

    def done(work):
        deadline = time.monotonic() + TIMEOUT_S
        while not work.is_completed():  # never a timed wait on NCCL work
            if time.monotonic() > deadline:
                raise TimeoutError("a broadcast did not complete")
            time.sleep(0.0005)
        work.wait()

    def sync():
        works = [None, None]
        for k, manifest in enumerate(manifests):
            if works[k % 2] is not None:
                done(works[k % 2])
            flat = _fill(buffers[k % 2], named, manifest)
            client.conn.send(("collective", manifest))  # the engine receives bucket k while we go on
            works[k % 2] = broadcast(flat)
        for work in works:
            if work is not None:
                done(work)
        for _ in manifests:
            _reply(client)
        version[0] += 1
        client.call("finish", version[0])

    return sync


def _source(named):
    """vLLM's ``WeightSource`` over the trainer's named tensors."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class DictSource(WeightSource):
        def metadata(self):
            return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in named.items()]

        def __iter__(self):
            return iter(list(named.items()))

    return DictSource()


def _vllm_ipc(named, manifests, client, device, opts):
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo, IPCTrainerWeightTransferEngine

    info = IPCTrainerInitInfo(rank=0, packed=True, packed_buffer_size_bytes=opts["bucket_bytes"])
    engine = IPCTrainerWeightTransferEngine.trainer_init(info, client=client, source=_source(named))
    return engine.send_weights


def _vllm_nccl(named, manifests, client, device, opts):
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine

    info = NCCLTrainerInitInfo(
        master_address="127.0.0.1",
        master_port=_free_port(),
        world_size=2,
        rank=0,
        packed=True,
        packed_buffer_size_bytes=opts["bucket_bytes"],
        packed_num_buffers=2,
    )
    engine = NCCLTrainerWeightTransferEngine.trainer_init(info, client=client, source=_source(named))
    return engine.send_weights


def _reply(client, op: str = "") -> Any:
    """The engine process's answer to the last request on ``client``'s pipe, within ``TIMEOUT_S``."""
    what = f" {op!r}" if op else ""
    if not client.conn.poll(TIMEOUT_S):
        raise TimeoutError(f"the engine did not answer{what} within {TIMEOUT_S} s")
    status, reply = client.conn.recv()
    if status != "ok":
        raise RuntimeError(f"engine:{what} failed: {reply}")
    return reply


def _engine_load(named, manifests, client, device, opts):
    version = [0]

    def sync():
        version[0] += 1
        client.call("selfload", (manifests, version[0]))

    return sync


_SYNCS = {
    "ours-ipc": _ours_ipc,
    "ours-nccl": _ours_nccl,
    "vllm-ipc": _vllm_ipc,
    "vllm-nccl": _vllm_nccl,
    REFERENCE: _engine_load,
}


# ---- driver ----------------------------------------------------------------------------------------
def run_variant(variant: str, model_path: str, opts: dict[str, Any]) -> dict[str, Any]:
    """One variant in a fresh engine process and trainer process; ``{"times", "wrong", "bytes", "buckets"}``."""
    ctx = mp.get_context("spawn")
    engine_end, trainer_end = ctx.Pipe()
    results = ctx.Queue()
    engine = ctx.Process(target=_engine_main, args=(variant, model_path, opts, engine_end, results))
    trainer = ctx.Process(target=_trainer_main, args=(variant, model_path, opts, trainer_end, results))
    engine.start()
    trainer.start()
    try:
        name, where, payload = results.get(timeout=TIMEOUT_S * 2)
    finally:
        trainer.join(TIMEOUT_S)
        engine.join(TIMEOUT_S)
        for proc in (trainer, engine):
            if proc.is_alive():
                proc.kill()
                proc.join(60)
    if where != "ok":
        raise RuntimeError(f"{variant}: the {where} process failed: {payload}")
    return payload


def run(
    pairs: list[str], size: str, bucket_mb: int, rounds: int, dtype: str = "bfloat16", device: str = "cuda"
) -> dict[str, dict]:
    """Run the variants of ``pairs`` on a tiny model of ``size``; prints a table and returns the results.

    ``device="cpu"`` runs our side of the ``ipc`` pair only (shared memory; vLLM's engines need CUDA).
    """
    from rlhf_sg.tiny import save_tiny_model

    if device == "cpu":
        pairs, variants = [], ["ours-ipc"]
    else:
        if torch.cuda.device_count() < 2 and "nccl" in pairs:
            print("nccl pair skipped: it needs two GPUs (the trainer's sender and the engine on different devices)")
            pairs = [p for p in pairs if p != "nccl"]
        variants = [v for p in pairs for v in PAIRS[p]]
    variants.append(REFERENCE)
    opts = {
        "device": device,
        "bucket_bytes": bucket_mb << 20,
        "rounds": rounds,
        "dtype": dtype,
        "seed": 7,
        "gpu_memory_utilization": 0.3 if device == "cuda" else 0.05,
    }
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_path = save_tiny_model(os.path.join(tmp, "model"), arch="qwen2", size=size)
        for variant in variants:
            out[variant] = run_variant(variant, model_path, opts)
    print(f"{device}: model {size} ({dtype}), bucket {bucket_mb} MiB, {rounds} timed syncs each (median)")
    for variant, res in out.items():
        t = statistics.median(res["times"])
        exact = "exact" if not res["wrong"] else f"{len(res['wrong'])} WRONG, e.g. {res['wrong'][:2]}"
        gbps = res["bytes"] / t / 1e9
        print(f"  {variant:10s} {t * 1e3:9.1f} ms/sync  {gbps:6.2f} GB/s  {res['buckets']:4d} buckets  weights {exact}")
    for pair in pairs:
        ours, theirs = PAIRS[pair]
        ratio = statistics.median(out[ours]["times"]) / statistics.median(out[theirs]["times"])
        print(f"  {pair}: time ours / vLLM's = {ratio:.2f}  (<= 1.0: ours at least as fast)")
    floor = statistics.median(out[REFERENCE]["times"])
    for variant in out:
        if variant != REFERENCE:
            print(f"  {variant}: time / {REFERENCE} = {statistics.median(out[variant]['times']) / floor:.2f}")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rlhf_sg.bench vllm-transfer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", default="ipc,nccl", help=f"comma-separated, of {sorted(PAIRS)}")
    parser.add_argument("--size", default="100m", help="tiny model size from rlhf_sg.tiny.SIZES")
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: our shared-memory side only")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: neither of vLLM 0.32's weight-transfer engines can run here")
        for engine, error in probe_cpu().items():
            print(f"  {engine}: {error}")
        return
    pairs = [p.strip() for p in args.pairs.split(",") if p.strip()]
    unknown = sorted(set(pairs) - set(PAIRS))
    if unknown:
        raise SystemExit(f"unknown pair(s) {unknown}; known: {sorted(PAIRS)}")
    run(pairs, args.size, args.bucket_mb, args.rounds, args.dtype, args.device)


if __name__ == "__main__":
    main()
