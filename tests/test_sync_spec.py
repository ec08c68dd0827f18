"""The weight syncer as a specification, in one process: trainer ranks as threads, engines in-process.

Every transport (collective, tensor, disk) moves a model into embedded engines, with engines and
trainer ranks in unequal numbers, mixed dtypes, several buckets, and several syncs on one syncer.
The property checked is always the same round trip: after ``sync(model, v)`` every engine holds the
trainer's weights (cast to the engine's dtype) and reports weight version ``v``.

Ray is replaced at its boundary only: an engine "handle" runs each ``.remote`` call of the real
:class:`~rlhf_sg.engine_actor.EngineActor` in a thread and returns a future as the object ref, and
``ray.wait`` / ``ray.get`` / ``ray.get_runtime_context`` answer for those futures (``ray.wait`` refusing the
arguments Ray refuses). Everything between (the syncer, the transports, the plan check, ``wait_engine_calls``)
runs unchanged. On the disk transport the trainer ranks' barrier (a gloo ``monitored_barrier`` across
processes) is a thread barrier here.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import threading
import time

import pytest
import torch

from backends.base import BackendConfig
from backends.embedded import EmbeddedBackend
from rlhf_sg.engine_actor import EngineActor, EngineCallError
from rlhf_sg.sync import DEFAULT_BUCKET_BYTES, WeightSyncer, named_weights, plan_buckets
from rlhf_sg.sync import transports as transports_module
from rlhf_sg.tiny import build_tiny_model, save_tiny_model

ray = pytest.importorskip("ray")

NODE = "node-of-this-process"
#: small buckets: the tiny llama (348 kB, 21 tensors) becomes about ten buckets, so buffers are reused
BUCKET_BYTES = 40_000
TIMEOUT_S = 60.0


# ---- the Ray boundary -----------------------------------------------------------------------------
class _Method:
    def __init__(self, handle: _Handle, name: str):
        self._handle, self._name = handle, name

    def remote(self, *args):
        return self._handle.pool.submit(getattr(self._handle.actor, self._name), *args)


class _Handle:
    """Stands for a Ray actor handle of ``actor``: ``handle.method.remote(*args)`` -> a future."""

    def __init__(self, actor: EngineActor, pool: concurrent.futures.Executor):
        self.actor, self.pool = actor, pool

    def __getattr__(self, name: str) -> _Method:
        return _Method(self, name)


class _Context:
    def get_node_id(self) -> str:
        return NODE


def _wait(refs, *, num_returns=1, timeout=None):
    """``ray.wait``: returns when ``num_returns`` refs are ready or at ``timeout``; refuses what Ray refuses."""
    if not isinstance(refs, list):
        raise TypeError(f"wait() expected a list of ray.ObjectRef, got {type(refs)}")
    if len(set(refs)) != len(refs):
        raise ValueError("Wait requires a list of unique ray_waitables.")
    if timeout is not None and timeout < 0:
        raise ValueError(f"The 'timeout' argument must be nonnegative. Received {timeout}")
    if num_returns <= 0:  # None: a TypeError, as in Ray
        raise ValueError(f"Invalid number of objects to return {num_returns}.")
    if num_returns > len(refs):
        raise ValueError("num_returns cannot be greater than the number of ray_waitables provided")
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        done = [r for r in refs if r.done()]
        left = None if deadline is None else deadline - time.monotonic()
        if len(done) >= num_returns or (left is not None and left <= 0):
            break
        concurrent.futures.wait([r for r in refs if not r.done()], timeout=left,
                                return_when=concurrent.futures.FIRST_COMPLETED)
    ready = done[:num_returns]
    return ready, [r for r in refs if r not in ready]


def _get(ref, timeout=None):
    try:
        return ref.result(timeout=timeout)
    except concurrent.futures.TimeoutError:
        raise
    except Exception as exc:  # what Ray raises for an actor method that raised
        raise ray.exceptions.RayTaskError("engine call", "", exc) from exc


@pytest.fixture
def fake_ray(monkeypatch):
    monkeypatch.setattr(ray, "wait", _wait)
    monkeypatch.setattr(ray, "get", _get)
    monkeypatch.setattr(ray, "get_runtime_context", _Context)
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [])
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    pool = concurrent.futures.ThreadPoolExecutor(16, thread_name_prefix="engine")
    yield pool
    pool.shutdown(wait=True)


@pytest.fixture(scope="module")
def engine_model_dir(tmp_path_factory):
    """The checkpoint every engine starts from: different weights from every trainer model below."""
    return save_tiny_model(str(tmp_path_factory.mktemp("engine") / "m"), arch="llama", seed=1)


def _engines(n: int, path: str, pool) -> list[_Handle]:
    return [
        _Handle(EngineActor("hf", BackendConfig(model_path=path, num_threads=1, seed=i), engine_index=i), pool)
        for i in range(n)
    ]


def _trainer_model(seed: int, mixed: bool = True) -> torch.nn.Module:
    """The trainer's tiny llama; ``mixed``: its norms in bf16 (a second dtype, so buckets of two dtypes)."""
    model = build_tiny_model("llama", "tiny", seed=seed)
    if mixed:
        for name, p in model.named_parameters():
            if "norm" in name:
                p.data = (p.data + 0.25 * torch.randn_like(p.data)).to(torch.bfloat16)
    return model


def _assert_engines_hold(engines: list[_Handle], model: torch.nn.Module, version: int) -> None:
    for e, handle in enumerate(engines):
        assert handle.actor.weight_version() == version, f"engine {e}"
        for name, p in named_weights(model):
            got = handle.actor.get_weights_by_name(name)
            assert torch.equal(got, p.detach().to(got.dtype)), f"engine {e}: {name} differs after sync {version}"


def _on_ranks(fn, world_size: int) -> list:
    """Run ``fn(rank)`` for every trainer rank concurrently (ranks are threads); results by rank."""
    with concurrent.futures.ThreadPoolExecutor(world_size) as pool:
        return [f.result(timeout=120) for f in [pool.submit(fn, r) for r in range(world_size)]]


@pytest.fixture
def rank_barrier(monkeypatch):
    """The disk transport's barrier across trainer ranks, for ranks that are threads of this process."""
    barriers: dict[int, threading.Barrier] = {}

    def install(world_size: int):
        barriers[0] = threading.Barrier(world_size, timeout=60)

        def barrier(self, what):
            barriers[0].wait()

        monkeypatch.setattr(transports_module.DiskTransport, "_barrier", barrier)

    return install


def _syncers(world_size, engines, transport, tmp_path, **kw):
    extra = {"disk_dir": str(tmp_path / "weights")} if transport == "disk" else {}
    return [
        WeightSyncer(r, world_size, engines, transport=transport, bucket_bytes=BUCKET_BYTES, timeout_s=TIMEOUT_S,
                     device="cpu", group_name=f"spec-{transport}", **extra, **kw)
        for r in range(world_size)
    ]


# ---- round trips ------------------------------------------------------------------------------------
@pytest.mark.parametrize("transport", ["collective", "tensor", "disk"])
@pytest.mark.parametrize("world_size, num_engines", [(2, 3), (3, 2)], ids=["2ranks-3engines", "3ranks-2engines"])
def test_every_transport_fills_every_engine_with_ranks_and_engines_in_unequal_numbers(
    fake_ray, engine_model_dir, rank_barrier, tmp_path, transport, world_size, num_engines
):
    engines = _engines(num_engines, engine_model_dir, fake_ray)
    rank_barrier(world_size)
    syncers = _syncers(world_size, engines, transport, tmp_path)
    # engine e is served by rank e % senders, senders = min(ranks, engines)
    assert sorted(e for s in syncers for e in s.my_engines) == list(range(num_engines))
    _on_ranks(lambda r: syncers[r].setup(), world_size)
    model = _trainer_model(seed=2)
    plan = plan_buckets([(n, tuple(p.shape), p.dtype) for n, p in named_weights(model)], BUCKET_BYTES)
    assert len({m.dtype for m in plan}) == 2 and len(plan) >= 6, "the case needs several buckets of two dtypes"

    stats = _on_ranks(lambda r: syncers[r].sync(model, 1), world_size)
    _assert_engines_hold(engines, model, 1)
    total_bytes = sum(p.numel() * p.element_size() for _, p in named_weights(model))
    for r, s in enumerate(stats):
        assert s["bytes"] == total_bytes and s["buckets"] == len(plan)
        assert s["engines"] == len(syncers[r].my_engines)
        assert len(syncers[r].bucket_times) == len(plan)
        assert 0 < s["seconds"] < 120 and s["GBps"] == pytest.approx(total_bytes / s["seconds"] / 1e9, rel=1e-12)
        if transport == "disk":  # bucket k is written by rank k % world_size, whatever engines the rank serves
            written = [k for k, t in enumerate(syncers[r].bucket_times) if "write_s" in t]
            assert written == [k for k in range(len(plan)) if k % world_size == r]
            assert s["engine_seconds"] == 0.0 and s["send_wait_seconds"] == 0.0  # nothing timed per bucket
    _on_ranks(lambda r: syncers[r].close(), world_size)


@pytest.mark.parametrize("transport", ["collective", "tensor", "disk"])
@pytest.mark.parametrize("overlap", [True, False])
def test_several_syncs_on_one_syncer_each_lands_and_versions_only_go_up(
    fake_ray, engine_model_dir, rank_barrier, tmp_path, transport, overlap
):
    engines = _engines(2, engine_model_dir, fake_ray)
    rank_barrier(1)
    (syncer,) = _syncers(1, engines, transport, tmp_path, overlap=overlap)
    syncer.setup()
    for version, seed in ((1, 2), (2, 3), (7, 4)):
        model = _trainer_model(seed)
        syncer.sync(model, version)
        _assert_engines_hold(engines, model, version)
    for stale in (7, 3, 0):
        with pytest.raises(ValueError, match=f"version {stale} is not newer than the last synced 7"):
            syncer.sync(model, stale)
    if transport == "disk":  # only the newest version's files are kept; each bucket's write is timed
        assert os.listdir(tmp_path / "weights") == ["v00000007"]
        assert all(0 < t["write_s"] < TIMEOUT_S for t in syncer.bucket_times)
    syncer.close()


@pytest.mark.parametrize("transport", ["collective", "tensor"])
def test_released_buffers_hold_no_memory_until_the_next_sync_allocates_them_again(
    fake_ray, engine_model_dir, tmp_path, transport
):
    """What colocated runs do after each sync (``release_buffers``, before the engines' KV cache wakes): the
    syncer holds no bucket buffer or staging memory, and the next sync allocates them again and lands."""
    from rlhf_sg.sync.plan import manifest_bytes

    engines = _engines(1, engine_model_dir, fake_ray)
    (syncer,) = _syncers(1, engines, transport, tmp_path)
    syncer.setup()
    syncer.sync(_trainer_model(2), 1)
    assert syncer.buffer_bytes() == 2 * max(manifest_bytes(m) for m in syncer._plan)  # two buffers, no staging
    syncer.release_buffers()
    assert syncer.buffer_bytes() == 0
    model = _trainer_model(3)
    syncer.sync(model, 2)
    _assert_engines_hold(engines, model, 2)
    assert syncer.buffer_bytes() > 0
    syncer.close()


def test_a_changed_model_is_planned_and_checked_again(fake_ray, engine_model_dir, tmp_path):
    """Same names, new dtypes: the second sync must plan anew (a stale plan would send the wrong bytes)."""
    engines = _engines(1, engine_model_dir, fake_ray)
    (syncer,) = _syncers(1, engines, "tensor", tmp_path)
    syncer.setup()
    first = _trainer_model(2, mixed=False)
    syncer.sync(first, 1)
    second = _trainer_model(3, mixed=True)
    syncer.sync(second, 2)
    _assert_engines_hold(engines, second, 2)
    syncer.close()


def test_close_then_setup_again_opens_a_new_group_and_syncs(fake_ray, engine_model_dir, tmp_path):
    engines = _engines(2, engine_model_dir, fake_ray)
    (syncer,) = _syncers(1, engines, "collective", tmp_path)
    syncer.setup()
    assert syncer.group_name == "spec-collective-rank0-setup1"
    with pytest.raises(RuntimeError, match="setup\\(\\) was already called"):
        syncer.setup()
    syncer.sync(_trainer_model(2), 1)
    syncer.close()
    with pytest.raises(RuntimeError, match="call setup\\(\\) before sync\\(\\)"):
        syncer.sync(_trainer_model(3), 2)
    syncer.setup()
    assert syncer.group_name == "spec-collective-rank0-setup2"
    model = _trainer_model(3)
    syncer.sync(model, 2)
    _assert_engines_hold(engines, model, 2)
    syncer.close()


def test_collective_meets_the_engines_at_the_given_address_with_the_given_group_builder(
    fake_ray, engine_model_dir, tmp_path
):
    engines = _engines(1, engine_model_dir, fake_ray)
    opened = []

    def open_group(spec, store):
        opened.append(spec)
        return EmbeddedBackend.open_sender_group(spec, store)

    syncer = WeightSyncer(0, 1, engines, transport="collective", bucket_bytes=BUCKET_BYTES, timeout_s=TIMEOUT_S,
                          device="cpu", master_address="localhost", open_group=open_group)
    syncer.setup()
    assert [(s.rank_offset, s.world_size, s.master_address) for s in opened] == [(0, 2, "localhost")]
    assert engines[0].actor.backend._group_spec.master_address == "localhost"
    model = _trainer_model(2)
    syncer.sync(model, 1)
    _assert_engines_hold(engines, model, 1)
    syncer.close()
    syncer.close()  # a second close has nothing left to release


def test_a_given_disk_directory_stays_after_close(fake_ray, engine_model_dir, tmp_path):
    engines = _engines(1, engine_model_dir, fake_ray)
    (syncer,) = _syncers(1, engines, "disk", tmp_path)
    syncer.setup()
    syncer.sync(_trainer_model(2), 1)
    syncer.close()
    assert syncer.disk_dir == str(tmp_path / "weights") and os.path.isdir(syncer.disk_dir)


def test_disk_without_a_directory_makes_one_and_close_removes_it(fake_ray, engine_model_dir):
    engines = _engines(1, engine_model_dir, fake_ray)
    syncer = WeightSyncer(0, 1, engines, transport="disk", bucket_bytes=BUCKET_BYTES, timeout_s=TIMEOUT_S,
                          device="cpu")
    syncer.setup()
    assert syncer.group_name == "weight-sync-rank0-setup1"  # the default group name
    made = syncer.disk_dir
    assert made and os.path.isdir(made)
    model = _trainer_model(2)
    syncer.sync(model, 1)
    _assert_engines_hold(engines, model, 1)
    syncer.close()
    assert not os.path.exists(made)


def test_an_engine_without_the_transport_is_refused_at_setup(fake_ray, engine_model_dir, tmp_path, monkeypatch):
    engines = _engines(2, engine_model_dir, fake_ray)
    describe = engines[1].actor.describe()
    monkeypatch.setattr(engines[1].actor, "describe", lambda: {**describe, "transports": ["collective"]})
    (syncer,) = _syncers(1, engines, "disk", tmp_path)
    with pytest.raises(ValueError, match=r"engine 1 \(hf\) has no 'disk' transport; use one of \['collective'\]"):
        syncer.setup()


def test_tensor_transport_refuses_an_engine_on_another_node(fake_ray, engine_model_dir, tmp_path, monkeypatch):
    engines = _engines(1, engine_model_dir, fake_ray)
    (syncer,) = _syncers(1, engines, "tensor", tmp_path)

    describe = engines[0].actor.describe()
    monkeypatch.setattr(engines[0].actor, "describe", lambda: {**describe, "node_id": "another-node"})
    with pytest.raises(ValueError, match="colocated engines: engine 0 runs on node another-node"):
        syncer.setup()


def test_a_model_the_engines_do_not_have_is_refused_before_any_byte(fake_ray, engine_model_dir, tmp_path):
    engines = _engines(2, engine_model_dir, fake_ray)
    (syncer,) = _syncers(1, engines, "tensor", tmp_path)
    syncer.setup()
    wrong = build_tiny_model("llama", "tiny", seed=2, vocab_size=120)
    with pytest.raises(ValueError, match="do not match the engines' model, nothing was sent: trainer rank 0"):
        syncer.sync(wrong, 1)
    for handle in engines:
        assert handle.actor.weight_version() == 0
    model = _trainer_model(2)
    syncer.sync(model, 1)  # the refusal left the syncer usable
    _assert_engines_hold(engines, model, 1)
    syncer.close()


def test_an_engine_left_at_another_version_fails_the_sync(fake_ray, engine_model_dir, tmp_path, monkeypatch):
    engines = _engines(1, engine_model_dir, fake_ray)
    (syncer,) = _syncers(1, engines, "tensor", tmp_path)
    syncer.setup()
    actor = engines[0].actor
    monkeypatch.setattr(actor, "finish_weight_update", lambda version: version - 1)
    with pytest.raises(EngineCallError, match=r"engine 0: finish_weight_update\(4\) left weight_version 3"):
        syncer.sync(_trainer_model(2), 4)
    syncer.close()


# ---- the gather: ZeRO-3 shards exchanged in one go, trainer ranks as threads ---------------------------------
class _ThreadGroup:
    """A process group of ``world`` trainer ranks that are threads of this process."""

    def __init__(self, world: int):
        self.world = world
        self.barrier = threading.Barrier(world, timeout=60)
        self.published: dict[tuple[int, int], torch.Tensor] = {}
        self.local = threading.local()


class _Work:
    def __init__(self, group: _ThreadGroup, key: tuple[int, int], tensor: torch.Tensor):
        self.group, self.key, self.tensor = group, key, tensor

    def wait(self):
        self.group.barrier.wait()  # every rank has published this broadcast
        if self.key[1] != self.group.local.rank:
            self.tensor.copy_(self.group.published[self.key])


class _ThreadDist:
    """``torch.distributed`` as the gather uses it, for a :class:`_ThreadGroup` (gloo's broadcast semantics).
    Every call must name the parameters' group; broadcasts must be asynchronous (all W in flight at once)."""

    def __init__(self, group: _ThreadGroup):
        self.group = group

    def _mine(self, group):
        assert group is self.group, "a collective on another group than the parameters'"
        return group

    def get_world_size(self, group):
        return self._mine(group).world

    def get_rank(self, group):
        return self._mine(group).local.rank

    def get_backend(self, group):
        self._mine(group)
        return "gloo"

    def get_global_rank(self, group, rank):
        self._mine(group)
        return rank

    def broadcast(self, tensor, src, group, async_op):
        assert async_op is True, "the W broadcasts of a gather must all be in flight at once"
        local = self._mine(group).local
        local.calls = getattr(local, "calls", 0) + 1
        key = (local.calls, src)
        if src == local.rank:
            group.published[key] = tensor.clone()
        return _Work(group, key, tensor)


def _zero3_param(full: torch.Tensor, rank: int, world: int, group, index: int) -> torch.nn.Parameter:
    """A ZeRO-3 partitioned parameter as DeepSpeed lays it out: W partitions of ceil(N / W) elements, the last
    one padded, partition ``rank`` in ``ds_tensor``; the parameter's own data is empty."""
    p = torch.nn.Parameter(torch.empty(0, dtype=full.dtype), requires_grad=False)
    size = -(-full.numel() // world)
    padded = torch.full((size * world,), -7, dtype=full.dtype)  # padding that must never reach the bucket
    padded[: full.numel()] = full.reshape(-1)
    p.ds_tensor = padded[rank * size : (rank + 1) * size].clone()
    p.ds_id, p.ds_shape, p.ds_process_group = index, tuple(full.shape), group
    p.ds_status = type("Status", (), {"name": "NOT_AVAILABLE"})()
    return p


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("names", [("a", "b", "c", "plain", "d"), ("b",)], ids=["five", "one"])
def test_gather_rebuilds_every_partitioned_parameter_exactly(monkeypatch, world, names):
    from rlhf_sg.sync import gather as gather_module
    from rlhf_sg.sync.gather import GatherStaging, gather_bucket

    # sizes that divide by W and that do not (a short last partition), one smaller than W, one not partitioned
    full = {"a": torch.arange(12.0).view(3, 4), "b": torch.arange(100.0, 107.0), "c": torch.tensor([5.5]),
            "plain": torch.arange(-3.0, 0.0), "d": torch.arange(200.0, 210.0).view(2, 5)}
    full = {n: full[n] for n in names}
    (manifest,) = plan_buckets([(n, tuple(t.shape), t.dtype) for n, t in full.items()], 1 << 20)
    group = _ThreadGroup(world)
    monkeypatch.setattr(gather_module, "dist", _ThreadDist(group))
    expected = torch.cat([full[t.name].reshape(-1) for t in manifest.tensors])

    def rank_gathers(rank):
        group.local.rank = rank
        params = [
            torch.nn.Parameter(full[t.name].clone(), requires_grad=False) if t.name == "plain"
            else _zero3_param(full[t.name], rank, world, group, i)
            for i, t in enumerate(manifest.tensors)
        ]
        out = torch.full((manifest.numel,), float("nan")) if rank != 1 else None  # rank 1 only takes part
        first: dict[str, float] = {}
        gather_bucket(params, manifest, out, GatherStaging(), first)
        # times add up across buckets: a second gather into the same dict adds to what is there
        timings = {"exchange_s": 100.0, "copy_s": 100.0}
        staging = GatherStaging()
        for _ in range(2):  # twice through one staging buffer: reuse must not leak the first round
            gather_bucket(params, manifest, out, staging, timings)
        return out, first, timings

    for rank, (out, first, timings) in enumerate(_on_ranks(rank_gathers, world)):
        if rank == 1:
            assert out is None and set(first) == {"exchange_s"}
        else:
            assert torch.equal(out, expected), f"rank {rank}"
            assert set(first) == {"exchange_s", "copy_s"} and 0 < first["copy_s"] < 1.0
            assert 100.0 < timings["copy_s"] < 101.0
        assert 0 < first["exchange_s"] < 1.0 and 100.0 < timings["exchange_s"] < 101.0


class _ThreadNccl(_ThreadDist):
    """The same group as NCCL presents it to the gather: one synchronous all-gather of every rank's row into
    the whole [W, S] buffer, no broadcasts."""

    def get_backend(self, group):
        self._mine(group)
        return "nccl"

    def broadcast(self, *args, **kwargs):
        raise AssertionError("on NCCL the shards are exchanged with one all-gather, not broadcasts")

    def all_gather_into_tensor(self, output, input, group):
        local = self._mine(group).local
        local.calls = getattr(local, "calls", 0) + 1
        assert output.numel() == group.world * input.numel(), "the output holds one row per rank"
        group.published[(local.calls, local.rank)] = input.clone()
        group.barrier.wait()
        output.view(group.world, -1).copy_(torch.stack([group.published[(local.calls, r)]
                                                        for r in range(group.world)]))
        group.barrier.wait()  # every rank has read the rows before a later call publishes more


@pytest.mark.parametrize("world", [2, 3])
def test_gather_on_nccl_stages_on_the_current_cuda_device_and_all_gathers_the_rows(monkeypatch, world):
    # the NCCL branch's logic, on CPU: the staging buffer is requested on the rank's current CUDA device (served
    # from CPU memory here) and the rows go through one all-gather; the parameters come out exactly
    from rlhf_sg.sync import gather as gather_module
    from rlhf_sg.sync.gather import GatherStaging, gather_bucket

    full = {"a": torch.arange(12.0).view(3, 4), "b": torch.arange(100.0, 107.0), "c": torch.tensor([5.5])}
    (manifest,) = plan_buckets([(n, tuple(t.shape), t.dtype) for n, t in full.items()], 1 << 20)
    group = _ThreadGroup(world)
    monkeypatch.setattr(gather_module, "dist", _ThreadNccl(group))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    expected = torch.cat([full[t.name].reshape(-1) for t in manifest.tensors])

    class CpuStaging(GatherStaging):
        def __init__(self):
            super().__init__()
            self.devices = []

        def get(self, numel, dtype, device):
            self.devices.append(device)
            return super().get(numel, dtype, torch.device("cpu"))

    def rank_gathers(rank):
        group.local.rank = rank
        params = [_zero3_param(full[t.name], rank, world, group, i) for i, t in enumerate(manifest.tensors)]
        out = torch.full((manifest.numel,), float("nan"))
        staging = CpuStaging()
        gather_bucket(params, manifest, out, staging)
        return out, staging.devices

    for rank, (out, devices) in enumerate(_on_ranks(rank_gathers, world)):
        assert torch.equal(out, expected), f"rank {rank}"
        assert devices == [torch.device("cuda", 3)]


def test_shards_are_exchanged_directly_only_when_every_one_is_a_plain_local_partition():
    from rlhf_sg.sync.gather import _exchangeable

    group, other = object(), object()

    def param(**changes):
        p = _zero3_param(torch.arange(6.0), 0, 2, group, 0)
        for key, value in changes.items():
            setattr(p, key, value)
        return p

    assert _exchangeable([param(), param()])
    swapped = param()
    swapped.ds_tensor.status = type("S", (), {"name": "NOT_AVAILABLE"})()  # shard swapped out to NVMe
    quantized = param()
    quantized.ds_tensor.ds_quant_scale = 0.5
    for odd in (param(ds_tensor=None), param(ds_status=type("S", (), {"name": "INFLIGHT"})()),
                swapped, quantized, param(ds_tensor=torch.arange(3.0).to(torch.bfloat16))):
        assert not _exchangeable([param(), odd]) and not _exchangeable([odd])
    # one group per exchange: a bucket whose parameters live in two groups is not exchanged
    assert not _exchangeable([param(), param(ds_process_group=other)])
    unsharded = param()
    del unsharded.ds_tensor  # a parameter with no shard attribute at all
    assert not _exchangeable([param(), unsharded])
    assert _exchangeable([param(ds_process_group=other)])


def test_gather_staging_reuses_its_memory_while_it_is_large_enough():
    from rlhf_sg.sync.gather import GatherStaging

    staging = GatherStaging()
    big = staging.get(10, torch.float32, torch.device("cpu"))
    assert big.shape == (10,) and big.dtype == torch.float32
    small = staging.get(16, torch.bfloat16, torch.device("cpu"))  # 32 bytes <= 40: the same memory
    assert small.shape == (16,) and small.dtype == torch.bfloat16 and small.data_ptr() == big.data_ptr()
    exact = staging.get(5, torch.float64, torch.device("cpu"))  # 40 bytes: exactly the buffer
    assert exact.data_ptr() == big.data_ptr()
    bigger = staging.get(11, torch.float32, torch.device("cpu"))
    assert bigger.shape == (11,) and bigger.data_ptr() != big.data_ptr()


# ---- failures and their messages ----------------------------------------------------------------------------
class OtherGroupBackend(EmbeddedBackend):
    """An engine whose trainer end of the side group is built another way (as SGLang's is)."""

    name = "hf-other-group"

    @classmethod
    def open_sender_group(cls, spec, store):
        return super().open_sender_group(spec, store)


class RecordingBackend(EmbeddedBackend):
    """The embedded engine's backend, recording what the tensor transport asks it to pack (sender side)."""

    name = "hf-recording"
    packed: list[tuple[int, int, bool]] = []  # (bucket numel, TP ranks, buffer in shared memory)

    @classmethod
    def pack_tensor_bucket(cls, manifest, flat, num_tp_ranks):
        cls.packed.append((manifest.numel, num_tp_ranks, flat.is_shared()))
        return super().pack_tensor_bucket(manifest, flat, num_tp_ranks)


def test_tensor_transport_packs_each_bucket_per_engine_from_shared_memory_and_times_each_phase(
    fake_ray, engine_model_dir, tmp_path, monkeypatch
):
    engines = _engines(2, engine_model_dir, fake_ray)
    describe = engines[0].actor.describe()
    # engine 0 is of a backend whose engines have 2 tensor-parallel ranks (it packs each bucket first, so it sees
    # the buffer before anything else could move it to shared memory); both engines time nothing
    monkeypatch.setattr(engines[0].actor, "describe", lambda: {**describe, "weight_group_size": 2})
    by_info = transports_module.backend_class
    monkeypatch.setattr(transports_module, "backend_class",
                        lambda info: RecordingBackend if info.get("weight_group_size") == 2 else by_info(info))
    for handle in engines:
        load = handle.actor.update_weights_from_tensor
        monkeypatch.setattr(handle.actor, "update_weights_from_tensor", lambda m, p, load=load: load(m, p) and None)
    monkeypatch.setattr(RecordingBackend, "packed", [])
    (syncer,) = _syncers(1, engines, "tensor", tmp_path)
    syncer.setup()
    model = _trainer_model(seed=2)
    plan = plan_buckets([(n, tuple(p.shape), p.dtype) for n, p in named_weights(model)], BUCKET_BYTES)
    stats = syncer.sync(model, 1)
    _assert_engines_hold(engines, model, 1)
    # the bucket's own manifest, engine 0's TP size, from a buffer the engine process can open without a copy
    assert RecordingBackend.packed == [(m.numel, 2, True) for m in plan]
    for k, times in enumerate(syncer.bucket_times):
        assert 0 < times["pack_s"] < 60 and 0 <= times["send_wait_s"] < 60, k
        assert times["engine_s"] == 0.0, k  # engines that report no seconds count 0
    assert stats["engine_seconds"] == 0.0
    syncer.close()


def test_weight_syncer_names_each_bad_argument():
    cases = [
        (dict(rank=-1, world_size=2), "WeightSyncer: rank -1 outside world_size 2"),
        (dict(timeout_s=0), "WeightSyncer: timeout_s must be > 0, got 0"),
        (dict(num_senders=0), "WeightSyncer: num_senders must be >= 1, got 0"),
        (dict(device="tpu"), "WeightSyncer: device must be 'cpu' or 'cuda', got 'tpu'"),
        (dict(bucket_bytes=0), "WeightSyncer: bucket_bytes must be a positive int, got 0"),
        (dict(bucket_bytes=1.5), "WeightSyncer: bucket_bytes must be a positive int, got 1.5"),
        (dict(transport="Disk"), "WeightSyncer: transport must be one of ('collective', 'tensor', 'disk'), got 'Disk'"),
        (dict(engines=[]), "WeightSyncer: engines is empty; pass the Ray handles of the rollout engines"),
    ]
    for kwargs, message in cases:
        args = dict(rank=0, world_size=1, engines=[object()], device="cpu") | kwargs
        with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
            WeightSyncer(**args)
    syncer = WeightSyncer(1, 2, [object()] * 3, device="cpu", timeout_s=5, group_name="g")
    assert syncer.timeout_s == 5.0 and isinstance(syncer.timeout_s, float)
    assert syncer.device == torch.device("cpu") and syncer.num_senders == 2 and syncer.my_engines == [1]
    assert syncer.group_name == "" and syncer.bucket_bytes == DEFAULT_BUCKET_BYTES
    defaults = WeightSyncer(0, 1, [object()], device="cpu")
    assert defaults.timeout_s == 600.0 and defaults.overlap is True and defaults.bucket_times == []
    assert WeightSyncer(0, 1, [object()], device="cpu", bucket_bytes=1).bucket_bytes == 1  # the smallest bucket
    # senders: at most one per trainer rank and one per engine
    assert WeightSyncer(0, 2, [object()] * 3, device="cpu", num_senders=5).num_senders == 2
    assert WeightSyncer(0, 4, [object()] * 3, device="cpu").num_senders == 3


def test_sync_refuses_versions_that_are_not_non_negative_ints(fake_ray, engine_model_dir, tmp_path):
    engines = _engines(1, engine_model_dir, fake_ray)
    (syncer,) = _syncers(1, engines, "tensor", tmp_path)
    syncer.setup()
    model = _trainer_model(2)
    for bad in (-1, "3", 2.0):
        with pytest.raises(ValueError, match=f"^sync: version must be an int >= 0, got {re.escape(repr(bad))}$"):
            syncer.sync(model, bad)
    stats = syncer.sync(model, 0)  # version 0 is a version
    assert stats["seconds"] > 0 and stats["GBps"] == pytest.approx(stats["bytes"] / stats["seconds"] / 1e9)
    assert stats["gather_seconds"] > 0 and stats["copy_seconds"] > 0 and stats["send_wait_seconds"] > 0
    assert stats["engine_seconds"] > 0
    assert all({"pack_s", "send_wait_s", "engine_s", "exchange_s", "copy_s"} <= set(t) for t in syncer.bucket_times)
    syncer.close()


def test_an_engine_failing_mid_collective_sync_breaks_the_syncer_until_set_up_again(
    fake_ray, engine_model_dir, tmp_path
):
    engines = _engines(1, engine_model_dir, fake_ray)
    (syncer,) = _syncers(1, engines, "collective", tmp_path)
    syncer.setup()
    engines[0].actor.destroy_weight_update_group()  # the engine can no longer receive
    start = time.monotonic()
    with pytest.raises(EngineCallError, match="^engine 0: update_weights_from_collective failed: BackendError: "
                                              ".*no weight-update group"):
        syncer.sync(_trainer_model(2), 1)
    assert time.monotonic() - start < TIMEOUT_S / 2, "the sender waited out its timeout instead of failing at once"
    with pytest.raises(RuntimeError, match=r"a previous sync failed \(EngineCallError: engine 0: .*the side groups "
                                           r"may be out of step: call close\(\) and setup\(\) again$"):
        syncer.sync(_trainer_model(2), 1)
    syncer.close()
    syncer.setup()
    model = _trainer_model(3)
    syncer.sync(model, 1)
    _assert_engines_hold(engines, model, 1)
    syncer.close()


class _PendingWork:
    """A broadcast's work handle that stays pending (``error``: completes, and its wait raises that)."""

    def __init__(self, error: Exception | None = None):
        self.error = error

    def is_completed(self):
        return self.error is not None

    def wait(self):
        raise self.error


@pytest.mark.parametrize("outcome", ["engine_fails", "send_fails", "send_times_out", "engine_fails_after_the_send",
                                     "engine_fails_after_the_timeout"])
def test_a_collective_send_that_does_not_complete_is_reported_with_the_engines_error_first(
    fake_ray, engine_model_dir, tmp_path, monkeypatch, outcome
):
    # the engine's receive call failing is raised while the broadcast is still pending (not after timeout_s);
    # a send that fails or times out while the engine says nothing names the bucket and the engine
    engines = _engines(2, engine_model_dir, fake_ray)
    # the send's deadline under test; the group is joined under a longer one (below), as a busy machine needs
    timeout_s = 1.5 if outcome in ("send_times_out", "engine_fails_after_the_timeout") else 30.0
    # the wait for an engine's own error after a failed send: shorter than the product's 5 s, as long as the
    # late failure below lands well inside it
    monkeypatch.setattr(transports_module.BroadcastTransport, "ENGINE_ERROR_GRACE_S", 2.5)
    (syncer,) = [WeightSyncer(0, 1, engines, transport="collective", bucket_bytes=BUCKET_BYTES, timeout_s=30.0,
                              device="cpu", group_name="pending")]
    syncer.setup()
    syncer._transport.ctx.timeout_s = timeout_s
    release = threading.Event()
    if outcome == "engine_fails":
        engines[0].actor.destroy_weight_update_group()  # its receive fails at once
    else:
        for handle in engines:  # receive nothing, report nothing
            monkeypatch.setattr(handle.actor, "update_weights_from_collective",
                                lambda plan, src: release.wait(60) and [])
    if outcome.startswith("engine_fails_after"):  # within the few seconds the sender gives it to say why
        delay = 1.0 if outcome == "engine_fails_after_the_send" else timeout_s + 0.5

        def late_failure(plan, src):
            time.sleep(delay)
            raise RuntimeError("receive failed late")

        monkeypatch.setattr(engines[1].actor, "update_weights_from_collective", late_failure)
    error = RuntimeError("connection reset") if outcome in ("send_fails", "engine_fails_after_the_send") else None
    monkeypatch.setattr(transports_module, "side_broadcast", lambda group, flat, src, timeout_s: _PendingWork(error))
    where = "weight-update group 'pending-rank0-setup1': trainer rank 0 (group rank 0)"
    start = time.monotonic()
    try:
        if outcome == "engine_fails":
            with pytest.raises(EngineCallError, match="^engine 0: update_weights_from_collective failed: "):
                syncer.sync(_trainer_model(2), 1)
            assert time.monotonic() - start < timeout_s / 2, "the engine's failure waited for the send's timeout"
        elif outcome.startswith("engine_fails_after"):
            with pytest.raises(EngineCallError, match="^engine 1: update_weights_from_collective failed: "
                                                      "RuntimeError: receive failed late"):
                syncer.sync(_trainer_model(2), 1)
        elif outcome == "send_fails":
            with pytest.raises(RuntimeError) as info:
                syncer.sync(_trainer_model(2), 1)
            assert str(info.value) == (f"{where}: sending bucket 0 to engine 0 (group rank 1), engine 1 (group rank 2) "
                                       "failed: connection reset")
        else:
            with pytest.raises(TimeoutError) as info:
                syncer.sync(_trainer_model(2), 1)
            assert str(info.value) == (f"{where} could not send bucket 0 to engine 0 (group rank 1), engine 1 (group "
                                       f"rank 2) within timeout_s={timeout_s}")
    finally:
        release.set()
        syncer.close()


def test_collective_sync_times_each_bucket_and_keeps_the_slowest_engine(fake_ray, engine_model_dir, tmp_path,
                                                                        monkeypatch):
    engines = _engines(3, engine_model_dir, fake_ray)
    reported = {0: lambda n: [0.5] * n, 1: lambda n: [2.0] + [0.25] * (n - 1), 2: lambda n: None}
    for e, handle in enumerate(engines):
        receive = handle.actor.update_weights_from_collective
        monkeypatch.setattr(handle.actor, "update_weights_from_collective",
                            lambda plan, src, receive=receive, e=e: receive(plan, src) and reported[e](len(plan)))
    (syncer,) = _syncers(1, engines, "collective", tmp_path)
    syncer.setup()
    model = _trainer_model(seed=2)
    stats = syncer.sync(model, 1)
    _assert_engines_hold(engines, model, 1)
    n = len(syncer.bucket_times)
    # engine seconds per bucket: the slowest engine's; an engine that reports none counts for nothing
    assert [t["engine_s"] for t in syncer.bucket_times] == [2.0] + [0.5] * (n - 1)
    assert stats["engine_seconds"] == pytest.approx(2.0 + 0.5 * (n - 1))
    assert all(0 <= t["send_wait_s"] < 60 for t in syncer.bucket_times)
    assert stats["send_wait_seconds"] == pytest.approx(sum(t["send_wait_s"] for t in syncer.bucket_times))
    syncer.close()


def test_collective_engines_are_told_the_group_their_ranks_and_its_backend(fake_ray, engine_model_dir, tmp_path,
                                                                          monkeypatch):
    engines = _engines(2, engine_model_dir, fake_ray)
    specs = {}
    for e, handle in enumerate(engines):
        join = handle.actor.init_weight_update_group
        monkeypatch.setattr(handle.actor, "init_weight_update_group",
                            lambda spec, join=join, e=e: specs.setdefault(e, spec) and join(spec))
    (syncer,) = _syncers(1, engines, "collective", tmp_path)
    syncer.setup()
    # one group: the sender is rank 0, each engine (one rank each here) the next ranks, in order
    assert [(s.rank_offset, s.world_size, s.group_name, s.backend, s.timeout_s) for s in (specs[0], specs[1])] == [
        (1, 3, "spec-collective-rank0-setup1", "gloo", TIMEOUT_S), (2, 3, "spec-collective-rank0-setup1", "gloo",
                                                                    TIMEOUT_S)]
    assert specs[0].master_port == specs[1].master_port
    syncer.close()
    # an engine that cannot join is named with the call that failed
    monkeypatch.setattr(engines[1].actor, "init_weight_update_group", lambda spec: 1 / 0)
    syncer = WeightSyncer(0, 1, engines, transport="collective", timeout_s=3.0, device="cpu", group_name="joins")
    with pytest.raises(EngineCallError, match="^engine 1: init_weight_update_group failed: ZeroDivisionError"):
        syncer.setup()
    syncer.close()
    # engines that answer but never join: both named; a group that cannot be built: the builder's error
    for handle in engines:
        monkeypatch.setattr(handle.actor, "init_weight_update_group", lambda spec: None)
    syncer = WeightSyncer(0, 1, engines, transport="collective", timeout_s=2.0, device="cpu", group_name="late")
    with pytest.raises(TimeoutError, match=r"^weight-update group 'late-rank0-setup1' \(gloo, world_size 3\) at "
                                           r"\S+: trainer rank 0 \(group rank 0\) waited timeout_s=2.0 for engine 0 "
                                           r"\(group rank 1\), engine 1 \(group rank 2\) to join; one did not"):
        syncer.setup()

    def bad_builder(spec, store):
        raise ValueError("no such interface")

    syncer = WeightSyncer(0, 1, engines, transport="collective", timeout_s=2.0, device="cpu", group_name="bad",
                          open_group=bad_builder)
    with pytest.raises(RuntimeError, match=r"^weight-update group 'bad-rank0-setup1' \(gloo, world_size 3\) at \S+: "
                                           r"trainer rank 0 \(group rank 0\): building the group failed: ValueError: "
                                           r"no such interface$"):
        syncer.setup()


def test_engines_whose_groups_are_built_differently_cannot_share_one(fake_ray, engine_model_dir, tmp_path,
                                                                    monkeypatch):
    engines = _engines(2, engine_model_dir, fake_ray)
    describe = engines[1].actor.describe()
    other = f"{os.path.abspath(__file__)}:OtherGroupBackend"
    monkeypatch.setattr(engines[1].actor, "describe", lambda: {**describe, "backend_class": other})
    (syncer,) = _syncers(1, engines, "collective", tmp_path)
    with pytest.raises(ValueError, match=r"^WeightSyncer rank 0: engines of backends \['hf', 'hf-other-group'\] share "
                                         "one side group but build it differently"):
        syncer.setup()


def test_an_engine_that_never_joins_the_group_times_out_naming_it(fake_ray, engine_model_dir, tmp_path, monkeypatch):
    engines = _engines(1, engine_model_dir, fake_ray)
    monkeypatch.setattr(engines[0].actor, "init_weight_update_group", lambda spec: None)  # answers, never joins
    syncer = WeightSyncer(0, 1, engines, transport="collective", timeout_s=1.0, device="cpu", group_name="lost")
    with pytest.raises(TimeoutError, match=r"^weight-update group 'lost-rank0-setup1' \(gloo, world_size 2\) at "
                                           r"127\.0\.0\.1:\d+: trainer rank 0 \(group rank 0\) waited timeout_s=1\.0 "
                                           r"for engine 0 \(group rank 1\) to join"):
        syncer.setup()


def test_close_reports_an_engine_that_cannot_leave_the_group(fake_ray, engine_model_dir, tmp_path, monkeypatch):
    engines = _engines(1, engine_model_dir, fake_ray)
    (syncer,) = _syncers(1, engines, "collective", tmp_path)
    syncer.setup()

    def stuck():
        raise RuntimeError("still receiving")

    monkeypatch.setattr(engines[0].actor, "destroy_weight_update_group", stuck)
    with pytest.raises(EngineCallError, match="^WeightSyncer rank 0: close: engine 0: destroy_weight_update_group "
                                              "failed: RuntimeError: still receiving$"):
        syncer.close()
    monkeypatch.undo()
    engines[0].actor.destroy_weight_update_group()


@pytest.mark.parametrize("exc, timeout", [
    (TimeoutError("x"), True), (RuntimeError("Socket Timeout after 5s"), True),
    (RuntimeError("the operation timed out"), True), (RuntimeError("connection reset"), False),
    (type("ConnectTimeout", (Exception,), {})("refused"), True),
])
def test_what_counts_as_a_timeout(exc, timeout):
    assert transports_module._is_timeout(exc) is timeout


def test_disk_transport_agrees_on_its_directory_and_waits_for_every_rank(tmp_path, monkeypatch):
    """With the trainer's default group up (here a one-process gloo group standing for W ranks) rank 0's
    directory reaches every rank, and each sync ends at a monitored barrier bounded by timeout_s."""
    import datetime

    import torch.distributed as dist

    from rlhf_sg.sync.transports import DiskTransport, SenderContext

    # without a default group, only rank 0 makes a directory; the others learn none
    lonely = DiskTransport(SenderContext(1, 2, [], [], 5.0, torch.device("cpu"), "g"), [])
    lonely.setup()
    assert lonely.disk_dir is None and not lonely._own_dir
    given = DiskTransport(SenderContext(0, 2, [], [], 5.0, torch.device("cpu"), "g"), [], str(tmp_path / "given"))
    given.setup()
    given.close()
    assert os.path.isdir(tmp_path / "given"), "a directory the user gave was deleted"

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ctx = SenderContext(0, 2, [], [], 7.0, torch.device("cpu"), "g")
        assert ctx.distributed() and not SenderContext(0, 1, [], [], 7.0, torch.device("cpu"), "g").distributed()
        transport = DiskTransport(ctx, [])
        transport.setup()
        made = transport.disk_dir
        assert os.path.basename(made).startswith("rlhf_sg-weights-") and transport._own_dir
        barriers = []
        monkeypatch.setattr(dist, "monitored_barrier", lambda timeout: barriers.append(timeout))
        monkeypatch.setattr(dist, "barrier", lambda: barriers.append("plain barrier"))
        transport.begin([], 3)
        transport.end([], 3)
        assert barriers == [datetime.timedelta(seconds=7.0)]

        def missing_rank(timeout):
            raise RuntimeError("rank 1 did not reach the barrier")

        monkeypatch.setattr(dist, "monitored_barrier", missing_rank)
        transport.begin([], 4)
        with pytest.raises(TimeoutError, match=f"^trainer rank 0: barrier after writing weight version 4 to "
                                               f"{re.escape(made)}/v00000004 failed: rank 1 did not reach"):
            transport.end([], 4)
        transport.close()
        assert not os.path.exists(made)
    finally:
        dist.destroy_process_group()
    assert not SenderContext(0, 2, [], [], 7.0, torch.device("cpu"), "g").distributed()


# ---- the plan: names, shapes, exact fits and the check across ranks ---------------------------------------
def test_hf_names_keep_a_lone_wrapper_word_and_full_shapes_come_from_zero3():
    from rlhf_sg.sync.plan import full_shape, hf_name

    assert hf_name("module") == "module" and hf_name("module.weight") == "weight"
    assert hf_name("_orig_mod.module.lm_head.weight") == "lm_head.weight"
    partitioned = torch.nn.Parameter(torch.empty(0))
    partitioned.ds_shape = torch.Size([3, 4])
    assert full_shape(partitioned) == (3, 4) and full_shape(torch.zeros(2, 5)) == (2, 5)


def test_named_weights_refuses_a_double_wrapper_and_an_empty_model():
    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))
            self.module = torch.nn.Module()
            self.module.w = torch.nn.Parameter(torch.zeros(1))

    with pytest.raises(ValueError, match="^two parameters map to the HF name 'w'; is the model wrapped twice\\?$"):
        named_weights(Twice())
    with pytest.raises(ValueError, match="^Sequential has no parameters to sync$"):
        named_weights(torch.nn.Sequential())


def test_plan_exact_fits_and_the_smallest_sizes():
    f32 = torch.float32
    # a tensor of exactly bucket_bytes fills its bucket: the next one, even empty, opens a new bucket
    plan = plan_buckets([("a", (4,), f32), ("empty", (0,), f32), ("b", (2,), f32)], 16)
    assert [[t.name for t in m.tensors] for m in plan] == [["a"], ["empty", "b"]]
    assert [m.numel for m in plan] == [4, 2]
    assert [m.numel for m in plan_buckets([("byte", (1,), torch.uint8)], 1)] == [1]  # the smallest bucket
    assert plan_buckets([("none", (0, 3), f32)], 8)[0].tensors[0].shape == (0, 3)  # empty tensors are tensors
    with pytest.raises(ValueError, match="^plan_buckets: bucket_bytes must be a positive int, got 0$"):
        plan_buckets([("a", (1,), f32)], 0)


def test_check_plan_reports_every_refusing_rank_before_any_byte(monkeypatch):
    from rlhf_sg.sync import plan as plan_module
    from rlhf_sg.sync.plan import check_plan

    plan = plan_buckets([("a", (2,), torch.float32)], 64)
    seen = []

    def accept(p):
        seen.append(p)

    check_plan(plan, accept, world_size=1, distributed=False)
    assert seen == [plan]

    def refuse(p):
        raise EngineCallError("engine 2: check_manifests failed: 'a' is not a weight of the engine's checkpoint")

    with pytest.raises(ValueError) as info:
        check_plan(plan, refuse, world_size=1, distributed=False)
    assert str(info.value) == ("the weights do not match the engines' model, nothing was sent: trainer rank 0: "
                               "engine 2: check_manifests failed: 'a' is not a weight of the engine's checkpoint")

    class ThreeRanks:  # all_gather_object as three trainer ranks would answer: this rank is rank 1
        @staticmethod
        def all_gather_object(out, obj):
            assert out == [None, None, None]
            out[:] = ["engine 0: refused", obj, "engine 4: refused"]

    monkeypatch.setattr(plan_module, "dist", ThreeRanks)
    with pytest.raises(ValueError) as info:
        check_plan(plan, accept, world_size=3, distributed=True)
    assert str(info.value) == ("the weights do not match the engines' model, nothing was sent: trainer rank 0: "
                               "engine 0: refused; trainer rank 2: engine 4: refused")
    with pytest.raises(ValueError) as info:  # this rank's own refusal reaches every rank
        check_plan(plan, refuse, world_size=3, distributed=True)
    assert "; trainer rank 1: engine 2: check_manifests failed: 'a' is not a weight" in str(info.value)


# ---- one transport at a time: devices, group specs, directories -----------------------------------------------
class _Answering:
    """An engine handle whose ``.remote`` calls are recorded and answer None at once, or as ``answers[name]``
    (a function of the call's future, then its arguments) decides."""

    def __init__(self, answers=None):
        self.calls: list[tuple[str, tuple]] = []
        self.answers = answers or {}

    def __getattr__(self, name):
        handle = self

        class _Call:
            def remote(self, *args):
                handle.calls.append((name, args))
                future = concurrent.futures.Future()
                handle.answers.get(name, lambda f, *a: f.set_result(None))(future, *args)
                return future

        return _Call()


class _StubGroup:
    def __init__(self):
        self.shut = False

    def shutdown(self):
        self.shut = True


def _ctx(device, engines=(), timeout_s=5.0, rank=0, world_size=1):
    from rlhf_sg.sync.transports import SenderContext

    return SenderContext(rank, world_size, list(engines), list(range(len(engines))), timeout_s, torch.device(device),
                         "g")


def test_bucket_buffers_live_on_the_trainers_device():
    # the meta device stands for an accelerator here: only a CPU tensor-transport buffer is made elsewhere
    # (shared memory, on the CPU)
    from rlhf_sg.sync.transports import BroadcastTransport, DiskTransport, HandOffTransport

    for cls in (BroadcastTransport, HandOffTransport, DiskTransport):
        buffers = cls(_ctx("meta"), []).buffers(24, 3)
        assert [(b.device.type, b.dtype, b.numel()) for b in buffers] == [("meta", torch.uint8, 24)] * 3, cls.name
    cpu = HandOffTransport(_ctx("cpu"), []).buffers(24, 2)
    assert [(b.device.type, b.numel(), b.is_shared()) for b in cpu] == [("cpu", 24, True)] * 2


@pytest.mark.parametrize("transport, overlap, buffers", [
    ("collective", True, 2), ("tensor", True, 2), ("disk", True, 1), ("collective", False, 1), ("tensor", False, 1),
], ids=lambda v: str(v))
def test_a_sender_holds_two_bucket_buffers_with_overlap_and_one_without_or_on_disk(
    fake_ray, engine_model_dir, rank_barrier, tmp_path, transport, overlap, buffers
):
    # double buffering: one buffer gathering while the other is sent; a disk write is over when send returns,
    # so a second buffer would be memory for nothing. Each buffer holds the largest bucket.
    from rlhf_sg.sync.plan import manifest_bytes

    engines = _engines(1, engine_model_dir, fake_ray)
    rank_barrier(1)
    (syncer,) = _syncers(1, engines, transport, tmp_path, overlap=overlap)
    syncer.setup()
    model = _trainer_model(seed=2)
    plan = plan_buckets([(n, tuple(p.shape), p.dtype) for n, p in named_weights(model)], BUCKET_BYTES)
    assert len(plan) > 2
    syncer.sync(model, 1)
    _assert_engines_hold(engines, model, 1)
    assert [b.numel() for b in syncer._buffers] == [max(manifest_bytes(m) for m in plan)] * buffers
    syncer.close()


@pytest.mark.parametrize("device, backend", [("cuda", "nccl"), ("cpu", "gloo")])
def test_the_side_group_is_nccl_for_a_cuda_trainer_and_gloo_for_a_cpu_one(fake_ray, device, backend):
    # setup on CPU with a CUDA context: the group builder is recorded, not run, so no GPU is touched
    from rlhf_sg.sync.transports import BroadcastTransport

    engines = [_Answering(), _Answering()]
    built, group = [], _StubGroup()

    def our_end(spec, store):
        built.append(spec)
        return group

    transport = BroadcastTransport(_ctx(device, engines), [{"weight_group_size": 2}, {"weight_group_size": 1}],
                                   master_address="127.0.0.1", open_group=our_end)
    transport.setup()
    joined = [args[0] for e in engines for name, args in e.calls if name == "init_weight_update_group"]
    assert [(s.rank_offset, s.world_size, s.backend) for s in built + joined] == [
        (0, 4, backend), (1, 4, backend), (3, 4, backend)]
    assert transport.close() == [] and group.shut
    assert [name for name, _ in engines[0].calls] == ["init_weight_update_group", "destroy_weight_update_group"]


def test_the_side_group_meets_at_the_ray_nodes_address_when_none_is_given(fake_ray, monkeypatch):
    # the engines may run on other nodes: 127.0.0.1 would not reach the trainer there. 127.0.0.2 stands for the
    # node's address (a loopback address, so the group's store can listen on it here)
    from rlhf_sg.sync.transports import BroadcastTransport

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.2")
    engines = [_Answering()]
    built = []
    transport = BroadcastTransport(_ctx("cpu", engines), [{"weight_group_size": 1}],
                                   open_group=lambda spec, store: built.append(spec) or _StubGroup())
    transport.setup()
    (name, (joined,)), = engines[0].calls
    assert (built[0].master_address, joined.master_address) == ("127.0.0.2", "127.0.0.2")
    assert joined.master_port == built[0].master_port > 0
    transport.close()


def test_an_engine_that_fails_to_join_is_reported_while_our_end_still_waits_for_it(fake_ray):
    # our end of the group blocks until every engine has joined; an engine whose join fails (a moment after
    # the call) is reported with its own error, not as a group that timed out
    from rlhf_sg.sync.transports import BroadcastTransport

    def fail_soon(future, spec):
        threading.Timer(0.2, future.set_exception, [RuntimeError("address already in use")]).start()

    release = threading.Event()

    def our_end(spec, store):
        if not release.wait(3.0):
            raise TimeoutError("timed out waiting for ranks to join")
        return _StubGroup()

    engines = [_Answering(), _Answering({"init_weight_update_group": fail_soon})]
    transport = BroadcastTransport(_ctx("cpu", engines, timeout_s=3.0), [{"weight_group_size": 1}] * 2,
                                   master_address="127.0.0.1", open_group=our_end)
    try:
        with pytest.raises(EngineCallError, match="^engine 1: init_weight_update_group failed: RuntimeError: "
                                                  "address already in use"):
            transport.setup()
    finally:
        release.set()


def test_disk_sync_keeps_a_users_file_in_its_directory_and_close_tolerates_a_directory_already_gone(
    fake_ray, tmp_path
):
    from rlhf_sg.sync.transports import DiskTransport

    # a directory the user gave may hold other files: a sync removes only the transport's older versions
    engine = _Answering()
    given = DiskTransport(_ctx("cpu", [engine]), [], str(tmp_path / "w"))
    given.setup()
    (tmp_path / "w" / "vocab.json").write_text("{}")
    (tmp_path / "w" / "vocab").mkdir()  # a directory whose name starts with "v" too
    (tmp_path / "w" / "v1").mkdir()  # not a version directory of the transport (8 digits)
    for version in (1, 2):
        given.begin([], version)
        given.end([], version)
    assert sorted(os.listdir(tmp_path / "w")) == ["v00000002", "v1", "vocab", "vocab.json"]
    assert engine.calls == [("update_weights_from_disk", (str(tmp_path / "w" / f"v0000000{v}"),)) for v in (1, 2)]
    assert given.close() == [] and os.path.isdir(tmp_path / "w")
    # a directory made here and removed by someone else (a temp cleaner) before close: close still succeeds
    made = DiskTransport(_ctx("cpu"), [])
    made.setup()
    path = made.disk_dir
    os.rmdir(path)
    assert made.close() == [] and made.disk_dir is None
    assert made.close() == []


def test_an_engine_description_naming_only_its_registry_name_resolves_to_that_backend():
    from backends.registry import get_backend_class

    assert transports_module.backend_class({"backend": "hf"}) is get_backend_class("hf")
    assert transports_module.backend_class({"backend": "hf", "backend_class": "hf"}).name == "hf"


# ---- the syncer: its device, the plan check across ranks, the version each transport is told -------------------
def test_the_syncer_sends_from_the_current_cuda_device_when_asked_or_by_default_when_cuda_is_there(monkeypatch):
    # no GPU touched: only which device the syncer chooses (its buffers and groups follow it)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    for device in (None, "cuda"):
        assert WeightSyncer(0, 1, [object()], device=device).device == torch.device("cuda", 3), device
    assert WeightSyncer(0, 1, [object()], device="cpu").device == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert WeightSyncer(0, 1, [object()]).device == torch.device("cpu")


@pytest.mark.parametrize("world_size", [1, 2])
def test_with_the_default_group_up_every_rank_sees_every_ranks_plan_check(fake_ray, engine_model_dir, tmp_path,
                                                                         monkeypatch, world_size):
    # trainer ranks > 1 with the default group up: the check's outcome is gathered from every rank (here rank 1's
    # engine refuses), so rank 0 refuses too, before any byte. One rank: nothing to gather, even with a group up.
    import types

    from rlhf_sg.sync import plan as plan_module
    from rlhf_sg.sync import syncer as syncer_module

    gathers = []

    def all_gather_object(out, obj):
        gathers.append(list(out))
        out[:] = [obj, "engine 1: check_manifests failed: refused"][:len(out)]

    monkeypatch.setattr(syncer_module, "dist", types.SimpleNamespace(is_available=lambda: True,
                                                                      is_initialized=lambda: True))
    monkeypatch.setattr(plan_module, "dist", types.SimpleNamespace(all_gather_object=all_gather_object))
    engines = _engines(world_size, engine_model_dir, fake_ray)
    syncer = WeightSyncer(0, world_size, engines, transport="tensor", bucket_bytes=BUCKET_BYTES,
                          timeout_s=TIMEOUT_S, device="cpu")
    syncer.setup()
    model = _trainer_model(seed=2)
    if world_size == 1:
        syncer.sync(model, 1)
        _assert_engines_hold(engines, model, 1)
        assert gathers == []
    else:
        with pytest.raises(ValueError) as info:
            syncer.sync(model, 1)
        assert str(info.value) == ("the weights do not match the engines' model, nothing was sent: trainer rank 1: "
                                   "engine 1: check_manifests failed: refused")
        assert gathers == [[None, None]]
        assert engines[0].actor.weight_version() != 1
    syncer.close()


def test_the_disk_barrier_waits_for_the_version_being_synced(fake_ray, engine_model_dir, tmp_path, monkeypatch):
    # every rank's files of this version are written before any engine reloads: the barrier (and its error) names it
    waited = []
    monkeypatch.setattr(transports_module.DiskTransport, "_barrier", lambda self, what: waited.append(what))
    engines = _engines(1, engine_model_dir, fake_ray)
    (syncer,) = _syncers(1, engines, "disk", tmp_path)
    syncer.setup()
    for version in (3, 5):
        syncer.sync(_trainer_model(seed=version), version)
    weights = tmp_path / "weights"
    assert waited == [f"writing weight version {v} to {weights}/v0000000{v}" for v in (3, 5)]
    syncer.close()
