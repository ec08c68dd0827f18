"""One cheap flush per weight sync into SGLang, counted where the backend meets the real engine.

SGLang's standalone ``flush_cache`` ends in ``current_platform.empty_cache()``, on CPU a full
``gc.collect()`` of the scheduler's heap (0.3-0.5 s on a tiny model); the flush an update call makes
(``flush_cache=True``) resets the same caches without it. These tests wrap the engine's
``TokenizerManager`` (every engine call goes through it to the scheduler) and count, per sync, the
flushes each transport makes: exactly one, and never the standalone kind.

Runs in the SGLang venv (``recipes/install/sglang_cpu.sh``); skipped elsewhere.
"""

from __future__ import annotations

import functools
import importlib.util
import threading
import time

import pytest
import torch

from backends.base import BackendConfig, SamplingParams, WeightGroupSpec
from rlhf_sg.tiny import BOS_ID, build_tiny_model, save_tiny_model

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang not installed"),
    pytest.mark.slow,
]
TIMEOUT_S = 120.0
_UPDATES = ("update_weights_from_tensor", "update_weights_from_distributed", "update_weights_from_disk")


class FlushCounter:
    """Wraps the engine's tokenizer manager: counts standalone flushes and update calls that flush."""

    def __init__(self, engine):
        self.standalone = 0
        self.in_update = 0
        tm = engine.tokenizer_manager
        original_flush = tm.flush_cache

        @functools.wraps(original_flush)
        async def flush_cache(*args, **kwargs):
            self.standalone += 1
            return await original_flush(*args, **kwargs)

        tm.flush_cache = flush_cache
        for name in _UPDATES:
            setattr(tm, name, self._counting(getattr(tm, name)))

    def _counting(self, original):
        @functools.wraps(original)
        async def update(obj, *args, **kwargs):
            if obj.flush_cache:
                self.in_update += 1
            return await original(obj, *args, **kwargs)

        return update

    def take(self) -> tuple[int, int]:
        """(update-call flushes, standalone flushes) since the last take."""
        counts = (self.in_update, self.standalone)
        self.in_update = self.standalone = 0
        return counts


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return save_tiny_model(str(tmp_path_factory.mktemp("sglang-flush")), arch="llama", size="tiny", seed=0)


@pytest.fixture(scope="module")
def backend(model_dir):
    from backends.sglang_backend import SGLangBackend

    engine = SGLangBackend(
        BackendConfig(model_path=model_dir, dtype="float32", max_model_len=128, seed=0, num_threads=1)
    )
    engine.counter = FlushCounter(engine._driver.engine)
    yield engine
    engine.shutdown()


def _two_buckets(seed: int):
    """The tiny Llama's weights at ``seed``, planned into two buckets: [(manifest, flat)]."""
    from rlhf_sg.sync.plan import plan_buckets

    params = dict(build_tiny_model("llama", "tiny", seed=seed).named_parameters())
    total = sum(p.numel() * p.element_size() for p in params.values())
    plan = plan_buckets([(n, p.shape, p.dtype) for n, p in params.items()], total // 2 + 1)
    assert len(plan) >= 2
    return [(m, torch.cat([params[t.name].detach().reshape(-1) for t in m.tensors])) for m in plan]


def _generate(backend) -> None:
    backend.generate([[BOS_ID, 5, 6, 7]] * 4, SamplingParams(max_new_tokens=3, temperature=0.0))


def test_tensor_sync_flushes_once_inside_an_update_call(backend):
    _generate(backend)  # a prefix cache to drop
    backend.counter.take()
    buckets = _two_buckets(seed=3)
    for manifest, flat in buckets:
        backend.update_weights_from_tensor(manifest, flat)
    backend.finish_weight_update(backend.weight_version + 1)
    assert backend.counter.take() == (1, 0)  # (flushes in update calls, standalone flushes)
    name = buckets[-1][0].tensors[-1].name
    assert torch.equal(
        backend.get_weights_by_name(name),
        dict(build_tiny_model("llama", "tiny", seed=3).named_parameters())[name].detach(),
    )
    _generate(backend)
    assert backend.counter.take() == (0, 0)


def test_disk_sync_flushes_once(backend, model_dir):
    _generate(backend)
    backend.counter.take()
    backend.update_weights_from_disk(model_dir)
    backend.finish_weight_update(backend.weight_version + 1)
    assert backend.counter.take() == (1, 0)


def test_generate_inside_a_sync_flushes_for_the_window_it_closes(backend):
    """A generate that interrupts a sync closes (and flushes) the window; the next window flushes again."""
    (first, flat_first), (second, flat_second) = _two_buckets(seed=5)[:2]
    backend.counter.take()
    backend.update_weights_from_tensor(first, flat_first)
    _generate(backend)
    assert backend.counter.take() == (1, 0)
    backend.update_weights_from_tensor(second, flat_second)
    backend.finish_weight_update(backend.weight_version + 1)
    assert backend.counter.take() == (1, 0)


def test_collective_sync_flushes_once(backend):
    import torch.distributed as dist

    from backends.sglang_backend import open_weight_update_group
    from rlhf_sg.distributed import create_group_store

    buckets = _two_buckets(seed=7)
    store = create_group_store("127.0.0.1", TIMEOUT_S)
    spec = WeightGroupSpec("127.0.0.1", store.port, 1, 2, "flush_count_sync", "gloo", TIMEOUT_S)
    errors: list[BaseException] = []

    def sender():
        try:
            group = open_weight_update_group(spec, 0, store=store)
            try:
                for _, flat in buckets:
                    opts = dist.BroadcastOptions()
                    opts.rootRank = 0
                    work = group.broadcast([flat], opts)
                    deadline = time.monotonic() + TIMEOUT_S
                    while not work.is_completed():
                        if time.monotonic() > deadline:
                            raise TimeoutError("broadcast to the SGLang engine did not complete")
                        time.sleep(0.005)
            finally:
                dist.destroy_process_group(group)
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    thread = threading.Thread(target=sender, daemon=True)
    thread.start()
    backend.init_weight_update_group(spec)
    backend.counter.take()
    for manifest, _ in buckets:
        backend.update_weights_from_collective(manifest)
    backend.finish_weight_update(backend.weight_version + 1)
    counts = backend.counter.take()
    thread.join(TIMEOUT_S)
    backend.destroy_weight_update_group()
    assert not errors, errors
    assert counts == (1, 0)


def test_in_process_tensor_update_does_not_need_the_shared_memory_manager(backend, monkeypatch):
    """An engine hosted in this process takes a plain tensor without torch's ``torch_shm_manager``.

    Sharing CPU memory by name goes through that manager, a child process of the host, which SGLang's own
    ``Engine.shutdown`` kills with every other child (the backend narrows that to the engine's processes, but a
    host may lose it otherwise), and torch cannot reconnect to a new one. The engine's own schedulers are this
    process's children and take the memory by descriptor, as SGLang's own ``update_weights_from_tensor`` hands
    it over. Here sharing by name is made to fail for the length of the test (leaving the process's manager,
    which later tests need, alone), and the update still lands.
    """
    from backends.shared_tensor import share

    def refused(self, *args, **kwargs):
        raise RuntimeError("sharing by name is refused in this test")

    monkeypatch.setattr(torch.UntypedStorage, "_share_filename_cpu_", refused)
    with pytest.raises(RuntimeError, match="sharing by name is refused"):  # the patch stops by-name sharing
        share(torch.zeros(4))
    (manifest, flat), *_ = _two_buckets(seed=7)
    backend.update_weights_from_tensor(manifest, flat)
    backend.finish_weight_update(backend.weight_version + 1)
    name = manifest.tensors[0].name
    want = dict(build_tiny_model("llama", "tiny", seed=7).named_parameters())[name].detach()
    assert torch.equal(backend.get_weights_by_name(name), want)


def test_shutdown_ends_the_engines_processes_and_no_others(backend):
    """Shutting the in-process engine down ends the processes it started and leaves the host's other children
    (a local Ray cluster, torch's shared-memory manager) running: SGLang's own ``Engine.shutdown`` SIGKILLs every
    descendant of its host. Runs last in this module: it shuts the module's engine down."""
    import subprocess
    import sys

    import psutil

    engine_pids = list(backend._driver._engine_children)
    assert engine_pids, "the driver recorded no engine processes"
    bystander = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        backend.shutdown()
        assert bystander.poll() is None, "the engine's shutdown killed a child of the host it did not start"
        gone, alive = psutil.wait_procs([psutil.Process(p) for p in engine_pids if psutil.pid_exists(p)], timeout=30)
        assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], f"engine processes left: {alive}"
    finally:
        bystander.stdin.close()
        bystander.wait(timeout=30)
