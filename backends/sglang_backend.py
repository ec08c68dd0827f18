"""The SGLang rollout backend: SGLang's offline engine in-process, or running SGLang HTTP servers.

Two modes, one interface:

* **engine** (default): ``sglang.Engine`` is started inside this process (the engine's Ray actor)
  without its tokenizer (``skip_tokenizer_init=True``): token ids go in, token ids and log-probs come
  out. SGLang starts its scheduler(s) and detokenizer as child processes.
* **http** (``BackendConfig.extra["server_urls"]``): drives SGLang servers that are already running,
  e.g. one per node of a disaggregated cluster. Rollouts go through SGLang's router when
  ``extra["router_url"]`` is given (one request per completion, the router spreads them), else they
  are split evenly over the servers (one batched request per server). Weight updates, cache flushes,
  pause / continue and memory release go to every server; their TP ranks together form the engine's
  side of the weight-update group, server after server, so ``BackendConfig.tensor_parallel_size``
  must equal the sum of the servers' ``tp_size`` (checked at start).

Log-probs. SGLang returns, for each sampled token, its log-prob under ``softmax(logits / T)`` before
top-p / top-k truncation (greedy: ``T = 1``) unless ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` asks for the
unscaled values. That default is this project's convention, so the backend pins the variable to
``0`` in the engine's environment before SGLang starts (engine mode); servers must be launched
without it (the recipes in ``recipes/`` set it to ``0``).

Weights. Buckets arrive as one flat buffer each (see ``backends.base``) and SGLang loads them with
its ``"flattened_bucket"`` format, in both transports:

* collective: ``init_weights_update_group`` joins SGLang's side group (engine TP rank ``r`` is group
  rank ``rank_offset + r``), and ``update_weights_from_distributed(names, dtypes, shapes,
  load_format="flattened_bucket")`` receives each bucket as ONE broadcast of its bytes. The trainer
  broadcasts the bucket buffer as it is (its bytes equal SGLang's ``uint8`` receive buffer); the
  manifest's tensors must be packed back to back in manifest order, with no padding (checked). The
  trainer's side of the group must be built the way SGLang builds its own: use
  :func:`open_weight_update_group` on the trainer (it mirrors ``sglang.srt.utils.
  init_custom_process_group``: a ``PrefixStore(group_name)`` over the TCP store, then torch's
  process-group helper), otherwise the two sides rendezvous on different keys and hang.
* tensor (colocated): the trainer rank that owns the bucket packs it (:meth:`SGLangBackend.
  pack_tensor_bucket`): one serialized ``flattened_bucket`` payload per TP rank, shared memory on CPU,
  CUDA IPC on GPU. The engine passes the bytes to SGLang untouched (``Engine.update_weights_from_tensor``
  in engine mode; ``POST /update_weights_from_tensor`` in http mode, where the servers must run on the
  trainer rank's machine and GPU), and each TP rank opens the sender's memory itself.

SGLang 0.5.23 accepts weights only between ``begin_weight_update`` and ``end_weight_update``: the
first bucket of a sync pauses generation (mode ``"retract"``) and opens that window;
:meth:`SGLangBackend.finish_weight_update` closes it, flushes the prefix cache once (buckets load
with ``flush_cache=False``), records the version and continues generation. A ``generate``, ``sleep``
or disk reload that comes while the window is open closes it first (without a new version), so
the engine never waits on a sync nobody finishes.

The flush. SGLang flushes in two ways that reset the same state (radix tree, KV slot allocators,
request pool, grammar cache): ``Engine.flush_cache`` / ``POST /flush_cache`` ends in
``current_platform.empty_cache()``, which on CPU is a full ``gc.collect()`` of the scheduler's heap
(0.3-0.5 s on the tiny model, every sync); the flush an update call makes (``flush_cache=True``)
skips it (``torch_empty_cache=False``). Which bucket is a sync's last is known only at
``finish_weight_update``, so the window is closed with one more update call that loads nothing and
flushes: ``update_weights_from_tensor`` with an empty tensor list, local to each server whatever the
transport (2-5 ms). A disk reload flushes in its own update call. On GPU the skipped step is
``torch.cuda.empty_cache()``, which ``continue_generation`` (its ``torch_empty_cache`` default) runs
when generation resumes, so the allocator's cached blocks are still handed back once per sync; the
KV pool itself stays allocated either way (only ``sleep`` releases it).

Partial rollout (``supports_abort``). :meth:`SGLangBackend.abort_generation`, called from another thread
while ``generate`` runs, uses SGLang's own abort, ``abort_request(abort_all=True)``: queued onto the
in-process engine's asyncio loop (``Engine.generate`` runs that loop on the engine thread; the abort is a
thread-safe callback on it, never a second ``run_until_complete``), or ``POST /abort_request`` to every
server (an admin endpoint) in http mode. SGLang ends a running request after its next decode step, keeping
that token and its log-prob, and drops a queued one; ``generate`` then returns each completion with the tokens
sampled so far and ``finish_reason="abort"``. An abort SGLang reports that ``abort_generation`` did not ask for
is still an error.

Sleep / wake call ``release_memory_occupation`` / ``resume_memory_occupation`` with SGLang's memory
tags: our ``"weights"`` is SGLang's ``"weights"``, our ``"kv_cache"`` is its ``"kv_cache"`` and
``"cuda_graph"`` (graphs serve generation only, so they leave and come back with the KV cache). SGLang
releases memory only on an idle scheduler, so ``sleep`` pauses generation first; generation continues
once every tag is back. Only released tags are resumed (SGLang fails on a tag it did not release).
They free memory only when the engine runs with ``enable_memory_saver=True`` (``engine_kwargs``, GPU
only); on CPU they run but free nothing. Weight updates need the weights awake (``wake(("weights",))``
is enough; enforced). Weights released without ``enable_weights_cpu_backup=True`` come back as garbage,
so a full weight sync must then precede the next ``generate`` (enforced).

Seeds. SGLang honours a per-request seed only with ``enable_deterministic_inference=True``, which
needs a GPU attention backend (fa3 / flashinfer / triton). With it, each completion row gets its own
seed derived from ``SamplingParams.seed``; without it (always on CPU) the seed is ignored and the
engine's own random stream (seeded once by ``BackendConfig.seed``) is used: see ``honours_seed``.

CPU mode. On ``device="cpu"`` SGLang needs the shims of :mod:`backends.sglang_cpu` active in every
process (``recipes/install/sglang_cpu.sh`` installs them) and ``SGLANG_USE_CPU_ENGINE=1``, which the
backend sets. It runs the model in plain torch (no SGLang CPU kernels), float32 or bfloat16.

``BackendConfig.extra`` keys:

* ``engine_kwargs`` (dict): further ``sglang.Engine`` / ``ServerArgs`` fields, verbatim (engine mode),
  e.g. ``mem_fraction_static``, ``enable_memory_saver``, ``max_running_requests``;
* ``server_urls`` (list of str): switch to http mode, one URL per running server;
* ``router_url`` (str, http mode): send rollouts through this SGLang router;
* ``request_timeout_s`` (float, default 1800): the longest a generate or control call may take;
* ``max_concurrency`` (int, default 256, router only): requests in flight at once;
* ``api_key_env`` (str, http mode): the NAME of the environment variable holding the servers' (and the
  router's) ``--api-key``;
* ``admin_api_key_env`` (str, http mode): the NAME of the environment variable holding the servers'
  ``--admin-api-key``.

Keys (http mode). Keys never go in ``extra`` itself (it is part of the run's config, written to
``config.json`` and shell history): ``extra`` names environment variables, read in the process that
runs the backend (the engine's Ray actor: set them where its Ray worker starts). SGLang 0.5.23 checks
``Authorization: Bearer <key>`` per endpoint level (``sglang/srt/utils/auth.py``): ``/generate`` and
``/get_server_info`` are normal endpoints and take the API key; everything else this backend calls
(weight updates and their group, ``begin`` / ``end_weight_update``, ``flush_cache``, pause / continue,
memory release / resume, ``get_weights_by_name``) is an admin endpoint and takes the admin key when the
server has one, else the API key. The backend sends exactly that; a 401 / 403 becomes an error naming
the server, the endpoint and the variable to set. Redirects are not followed (they would carry the key
elsewhere), and https URLs get their certificates checked.
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import datetime
import importlib.util
import json
import logging
import os
import pickle
import re
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from backends.base import (
    MEMORY_KV_CACHE,
    MEMORY_WEIGHTS,
    BackendConfig,
    BackendError,
    BucketManifest,
    Completion,
    RolloutBackend,
    SamplingParams,
    WeightGroupSpec,
    check_generate_args,
    memory_tags,
)
from backends.embedded import row_seed

__all__ = ["SGLangBackend", "open_weight_update_group", "sglang_engine_kwargs", "sglang_sampling_params"]

logger = logging.getLogger(__name__)

#: how often a call waiting on the in-process engine checks that the engine's processes are alive, in seconds
_LIVENESS_POLL_S = 2.0
_DTYPES = ("float32", "bfloat16", "float16")
_EXTRA_KEYS = {
    "engine_kwargs", "server_urls", "router_url", "request_timeout_s", "max_concurrency", "api_key_env",
    "admin_api_key_env",
}  # fmt: skip
#: extra keys that would put a secret in the run's config: refused, pointing at the *_env key instead
_SECRET_EXTRA_KEYS = {"api_key": "api_key_env", "admin_api_key": "admin_api_key_env"}
#: SGLang 0.5.23's normal-level endpoints among those this backend calls (``@auth_level`` in
#: ``sglang/srt/entrypoints/http_server.py``); every other endpoint it calls is ``ADMIN_OPTIONAL``
_NORMAL_ENDPOINTS = frozenset({"generate", "get_server_info"})
#: the fields of a server's ``/get_server_info`` answer the backend uses
_SERVER_INFO_FIELDS = (
    "tp_size", "context_length", "enable_deterministic_inference", "enable_memory_saver", "enable_weights_cpu_backup",
)  # fmt: skip
INSTALL_CPU = "bash recipes/install/sglang_cpu.sh"
INSTALL_GPU = "pip install 'rlhf-sg[sglang]'"
#: our memory tags -> SGLang's (``sglang.srt.constants.GPU_MEMORY_TYPE_*``); CUDA graphs serve generation
#: only, so they go and come back with the KV cache
SGLANG_MEMORY_TAGS: dict[str, tuple[str, ...]] = {
    MEMORY_WEIGHTS: ("weights",),
    MEMORY_KV_CACHE: ("kv_cache", "cuda_graph"),
}
#: SGLang's fused weights and the HF projections stacked in them, in row order
_FUSED_PROJECTIONS = (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj")))
_DISCARD_NAME = "rlhf_sg.refused_bucket"  # matches no model's weight
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def sglang_sampling_params(params: SamplingParams, seed: int | None = None) -> dict[str, Any]:
    """One SGLang ``sampling_params`` dict for ``params``; every field is explicit.

    SGLang's default (``--sampling-defaults model``) fills missing fields from the model's
    generation_config, which would silently change the sampling distribution, so none is left out.
    ``seed`` is SGLang's per-request ``sampling_seed`` (honoured only with deterministic inference).
    """
    sampling = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": int(params.top_k) if params.top_k > 0 else -1,
        "min_p": 0.0,
        "min_new_tokens": 0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "repetition_penalty": 1.0,
        "stop_token_ids": list(params.stop_token_ids),
        "ignore_eos": False,
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    if seed is not None:
        sampling["sampling_seed"] = seed
    return sampling


def sglang_engine_kwargs(config: BackendConfig, user_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """``sglang.Engine``'s keyword arguments for ``config`` (engine mode), checked before the slow start.

    Raises :class:`BackendError` for what SGLang would only report later or less clearly (package
    missing, CPU mode not set up, bad model path, more TP ranks than devices). Sets the environment
    SGLang's processes inherit (CPU-mode switches, log-prob convention, thread count).
    """
    user_kwargs = {} if user_kwargs is None else user_kwargs
    if not isinstance(user_kwargs, dict):
        raise BackendError(f"BackendConfig.extra['engine_kwargs'] must be a dict, got {type(user_kwargs).__name__}")
    if importlib.util.find_spec("sglang") is None:
        raise BackendError(
            f"the SGLang backend needs the sglang package, not installed for {sys.executable}; install it "
            f"with `{INSTALL_CPU}` (CPU, its own venv) or `{INSTALL_GPU}` (GPU)"
        )
    device = torch.device(config.device).type
    if device not in ("cpu", "cuda"):
        raise BackendError(f"BackendConfig.device must be 'cpu' or 'cuda', got {config.device!r}")
    _check_model_path(config.model_path, allow_hub_id=device == "cuda")
    tp = config.tensor_parallel_size
    if device == "cuda":
        visible = torch.cuda.device_count()
        if visible == 0:
            raise BackendError(
                "BackendConfig.device='cuda' but torch sees no CUDA device; use device='cpu' "
                f"(SGLang's CPU mode, installed by `{INSTALL_CPU}`)"
            )
        if tp > visible:
            raise BackendError(
                f"BackendConfig.tensor_parallel_size={tp} but only {visible} CUDA device(s) are visible "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); lower it or give the "
                "engine more GPUs"
            )
    else:
        from backends import sglang_cpu

        problems = sglang_cpu.cpu_mode_problems()
        if problems:
            raise BackendError("SGLang on CPU needs its CPU mode set up: " + "; ".join(problems))
        if "sglang" in sys.modules and os.environ.get("SGLANG_USE_CPU_ENGINE") != "1":
            raise BackendError(
                "sglang was imported in this process before SGLANG_USE_CPU_ENGINE=1 was set, so it chose "
                "its GPU code paths; start the SGLang backend before importing sglang, or export "
                "SGLANG_USE_CPU_ENGINE=1"
            )
        slots = _cpu_tp_slots()
        if tp > slots:
            raise BackendError(
                f"BackendConfig.tensor_parallel_size={tp} but SGLang's CPU mode runs one TP rank per NUMA "
                f"node or per SGLANG_CPU_OMP_THREADS_BIND core group, and this machine offers {slots}; "
                "use tensor_parallel_size=1"
            )
        os.environ.update(sglang_cpu.CPU_ENGINE_ENV)
    # Our log-prob convention is SGLang's default; pin it against a stray environment setting.
    os.environ["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "0"
    if config.num_threads is not None:
        # SGLang's CPU schedulers take their thread count from the environment they inherit.
        os.environ["OMP_NUM_THREADS"] = str(config.num_threads)
        torch.set_num_threads(config.num_threads)
    kwargs: dict[str, Any] = {
        "model_path": config.model_path,
        "dtype": config.dtype,
        "device": device,
        "tp_size": tp,
        "random_seed": config.seed,
        "skip_tokenizer_init": True,
        "context_length": _context_length(config),
        "log_level": "error",
    }
    if device == "cpu":
        kwargs.update(
            attention_backend="torch_native",
            disable_cuda_graph=True,
            sleep_on_idle=True,  # an idle scheduler otherwise spins a core
            # SGLang sizes the KV cache from device memory; on CPU that reserves gigabytes.
            max_total_tokens=max(32768, 4 * _context_length(config)),
        )
    if config.memory_fraction is not None:
        kwargs["mem_fraction_static"] = config.memory_fraction
    if config.routed_experts:
        if device != "cuda":
            raise BackendError(
                "BackendConfig.routed_experts (--train.routing_replay): SGLang captures routed experts on CUDA only "
                "(its capture pins host memory through CUDA; on CPU its scheduler dies at start, measured with "
                "sglang 0.5.23); use --rollout.backend hf on CPU"
            )
        kwargs["enable_return_routed_experts"] = True
    if config.sleeps_while_training and device == "cuda":
        # release_memory_occupation frees memory only under the memory saver; the weights need no CPU backup,
        # as every wake of the weights is followed by a full sync
        kwargs["enable_memory_saver"] = True
    overridden = sorted(k for k in ("model_path", "skip_tokenizer_init") if k in user_kwargs)
    if overridden:
        raise BackendError(
            f"BackendConfig.extra['engine_kwargs'] may not set {overridden}: the backend "
            "relies on them (set model_path on BackendConfig)"
        )
    kwargs.update(user_kwargs)
    return kwargs


# ---- the trainer's side of the weight-update group ----------------------------------------------
@contextlib.contextmanager
def _not_split_from_default_group():
    """While building a side group, let torch see no device bound to this process's default group.

    DeepSpeed binds the trainer's default group to its GPU (``device_id``); torch then builds every later NCCL
    group by ``ncclCommSplit`` of that communicator (``_new_process_group_helper``: ``split_from =
    _get_split_source(default group)`` when it has a ``bound_device_id``), so the side group would hold the
    trainer's ranks only and the SGLang schedulers, which join through the store, would never be in it.
    Without a bound device the group is made from the store's unique id, as SGLang makes its end.
    """
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_group

    default = _get_default_group() if dist.is_initialized() else None
    bound = getattr(default, "bound_device_id", None)
    if bound is None:
        yield
        return
    default.bound_device_id = None
    try:
        yield
    finally:
        default.bound_device_id = bound


def open_weight_update_group(
    spec: WeightGroupSpec, rank: int = 0, store: torch.distributed.Store | None = None
) -> torch.distributed.ProcessGroup:
    """Build (trainer side, ``rank=0``) a weight-update group that SGLang's engines can join.

    SGLang's workers join with ``init_custom_process_group(init_method="tcp://addr:port",
    group_name=...)``: a ``PrefixStore(group_name)`` over the TCP store, then torch's process-group
    helper, which adds its own per-group and per-device key prefixes. This function builds the same
    thing, so both sides meet on the same keys. ``store``: an existing TCP store whose master is
    this rank (e.g. one bound to port 0; its port is then ``spec.master_port``); None creates one at
    ``spec.master_address:spec.master_port`` (master when ``rank == 0``). It does not import sglang.

    Blocks until all ``spec.world_size`` ranks have joined (at most ``spec.timeout_s``). The group is
    registered with torch under ``spec.group_name``: destroy it with
    ``torch.distributed.destroy_process_group(group)`` before reusing the name in this process.
    Returns a ``ProcessGroup``; broadcast with ``group.broadcast([flat], opts)``.
    """
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import Backend, _new_process_group_helper, _world

    where = (
        f"SGLang weight-update group {spec.group_name!r} ({spec.backend}) at {spec.master_address}:"
        f"{spec.master_port} as rank {rank} of {spec.world_size}"
    )
    if spec.backend not in ("gloo", "nccl"):
        raise BackendError(f"{where}: backend must be 'gloo' or 'nccl', got {spec.backend!r}")
    if not 0 <= rank < spec.world_size:
        raise BackendError(f"{where}: rank outside the group")
    if not spec.group_name:
        raise BackendError(f"{where}: group_name must be non-empty (SGLang refuses empty names)")
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    try:
        if store is None:
            store = dist.TCPStore(
                spec.master_address, spec.master_port, spec.world_size, is_master=rank == 0, timeout=timeout
            )
        prefixed = dist.PrefixStore(spec.group_name, store)
        with _not_split_from_default_group():
            group, _ = _new_process_group_helper(
                spec.world_size,
                rank,
                [],
                Backend(spec.backend),
                prefixed,
                group_name=spec.group_name,
                backend_options=None,
                timeout=timeout,
            )
    except Exception as exc:  # store connect / rendezvous / duplicate-name failures come as several types
        raise BackendError(
            f"building {where} failed (timeout_s={spec.timeout_s}): {type(exc).__name__}: {exc}. Are the "
            "engines joining (init_weight_update_group) at the same time, and is the group name unused here?"
        ) from exc
    # dist.broadcast(..., group=group) maps global ranks through this table, as SGLang's helper sets it.
    _world.pg_group_ranks[group] = {i: i for i in range(spec.world_size)}
    return group


# ---- drivers: the two ways of talking to SGLang ---------------------------------------------------
class _InFlight:
    """One running ``generate``: whether :meth:`SGLangBackend.abort_generation` asked to cut it short, and
    whether it has returned (set by the driver)."""

    __slots__ = ("aborted", "done")

    def __init__(self):
        self.aborted = False
        self.done = threading.Event()


class _EngineDriver:
    """``sglang.Engine`` in this process. Every call runs on one dedicated thread, with a deadline.

    SGLang's engine is driven through its own asyncio loop; keeping every call on one thread keeps
    that loop single-threaded, and lets a call that overruns its deadline be reported instead of
    hanging the actor (the engine is then unusable and must be shut down).
    """

    mode = "engine"

    def __init__(self, engine_kwargs: dict[str, Any], timeout_s: float):
        self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="sglang-engine")
        self._timeout_s = timeout_s
        self._stuck: str | None = None
        self.engine = None
        self._engine_children: list[int] = []  # the processes the engine started (schedulers, detokenizer)

        def start():
            import psutil
            from sglang.srt.entrypoints.engine import Engine

            before = {p.pid for p in psutil.Process().children()}
            engine = Engine(**engine_kwargs)
            self._engine_children = [p.pid for p in psutil.Process().children() if p.pid not in before]
            return engine

        try:
            self.engine = self.run("start sglang.Engine", start)
        except Exception as exc:
            self._thread.shutdown(wait=False, cancel_futures=True)
            if isinstance(exc, BackendError):
                raise
            raise BackendError(
                f"sglang.Engine failed to start ({type(exc).__name__}: {exc}); model {engine_kwargs['model_path']!r}, "
                f"device {engine_kwargs['device']!r}. SGLang's own log says more with "
                "extra={'engine_kwargs': {'log_level': 'info'}}"
            ) from exc
        self.server_info = self.engine.get_server_info()
        self.tp_sizes = [int(self.server_info["tp_size"])]

    def run(self, what: str, fn: Callable[[], Any], timeout_s: float | None = None) -> Any:
        if self._stuck is not None:
            raise BackendError(
                f"SGLang engine: {what}: an earlier call ({self._stuck}) overran its deadline; "
                "the engine is unusable, shut the backend down and start a new one"
            )
        timeout_s = self._timeout_s if timeout_s is None else timeout_s
        future = self._thread.submit(fn)
        deadline = time.monotonic() + timeout_s
        while True:
            # waited in short slices: a scheduler that died (an exception in a model's forward) leaves the call
            # waiting for outputs that never come, so the engine's processes are checked between slices
            try:
                return future.result(timeout=max(0.0, min(_LIVENESS_POLL_S, deadline - time.monotonic())))
            except concurrent.futures.TimeoutError:
                pass
            dead = self._dead_children()
            if dead:
                self._stuck = what
                raise BackendError(
                    f"SGLang engine: {what}: its process {dead} died while the call waited (a scheduler exits on an "
                    "exception in the model's forward; its traceback is in this engine's log, the Ray worker's "
                    "stderr); the engine is unusable, shut the backend down"
                )
            if time.monotonic() >= deadline:
                self._stuck = what
                raise BackendError(f"SGLang engine: {what} did not finish within {timeout_s} s") from None

    def _dead_children(self) -> str | None:
        """``pid (name)`` of a process the engine started that has exited, or None."""
        import psutil

        for pid in self._engine_children:
            try:
                proc = psutil.Process(pid)
                if proc.status() != psutil.STATUS_ZOMBIE:
                    continue
                name = proc.name()
            except psutil.NoSuchProcess:
                name = "gone"
            return f"{pid} ({name})"
        return None

    def generate(self, input_ids: list[list[int]], sampling: list[dict], inflight: _InFlight,
                 routed_experts: bool = False) -> list[dict]:
        def generate():
            try:
                return self.engine.generate(
                    input_ids=input_ids, sampling_params=sampling, return_logprob=True, logprob_start_len=-1,
                    return_routed_experts=routed_experts,
                )
            finally:
                inflight.done.set()  # on the engine thread: abort callbacks queued after this see it

        return self.run(f"generate ({len(input_ids)} rows)", generate)

    def tokens_so_far(self) -> int:
        """The fewest output tokens the tokenizer manager holds for any request of the running generate (0 when
        none runs). A request that does not stream reaches the tokenizer manager every
        ``SGLANG_FORCE_STREAM_INTERVAL`` tokens (50 by default), so this counts in those steps. Read from any
        thread: the engine loop may change the table while it is read, which is then read again."""
        tm = self.engine.tokenizer_manager
        for _ in range(8):
            try:
                states = list(tm.rid_to_state.values())
            except RuntimeError:  # "dictionary changed size during iteration"
                continue
            return min((len(state.output_ids) for state in states), default=0)
        return 0

    def abort(self, inflight: _InFlight) -> None:
        """From any thread: abort every request of the running ``generate`` (SGLang's ``abort_request(abort_all=
        True)``), on the engine's own loop thread.

        ``Engine.generate`` runs ``loop.run_until_complete`` on the engine thread, and the tokenizer manager's
        socket to the scheduler belongs to that loop, so the abort is a callback queued onto the loop
        (``call_soon_threadsafe``): it runs between the loop's steps while the generate waits for its outputs.
        A callback that comes too late (the generate has returned) sends nothing; one left queued on the idle
        loop would run first at its next run, before that run's requests are sent, so it could not reach them.
        """
        tm = self.engine.tokenizer_manager

        def abort_on_loop():
            if not inflight.done.is_set():
                tm.abort_request(abort_all=True)

        self.engine.loop.call_soon_threadsafe(abort_on_loop)

    def call(self, method: str, timeout_s: float | None = None, **kwargs) -> Any:
        """``Engine.<method>(**kwargs)``; SGLang's ``(success, message)`` answers are checked."""
        result = self.run(method, lambda: getattr(self.engine, method)(**kwargs), timeout_s)
        _check_answer(method, result)
        return result

    def init_group(self, spec: WeightGroupSpec) -> None:
        self.call(
            "init_weights_update_group",
            timeout_s=spec.timeout_s,
            master_address=spec.master_address,
            master_port=spec.master_port,
            rank_offset=spec.rank_offset,
            world_size=spec.world_size,
            group_name=spec.group_name,
            backend=spec.backend,
        )

    def pause(self) -> None:
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        tm = self.engine.tokenizer_manager
        self.run(
            "pause_generation",
            lambda: self.engine.loop.run_until_complete(tm.pause_generation(PauseGenerationReqInput(mode="retract"))),
        )

    def resume(self) -> None:
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput

        tm = self.engine.tokenizer_manager
        self.run(
            "continue_generation",
            lambda: self.engine.loop.run_until_complete(tm.continue_generation(ContinueGenerationReqInput())),
        )

    def update_from_bucket(self, payloads: list[bytes]) -> None:
        """Load one bucket from :meth:`SGLangBackend.pack_tensor_bucket`'s per-TP-rank payloads, untouched.

        ``Engine.update_weights_from_tensor`` passes ``"flattened_bucket"`` payloads straight to the
        schedulers, where TP rank ``r`` deserialises payload ``r`` and opens the sender's memory.
        """
        self.call(
            "update_weights_from_tensor", named_tensors=payloads, load_format="flattened_bucket", flush_cache=False
        )

    def get_weights(self, name: str) -> Any:
        return self.run(
            f"get_weights_by_name({name!r})", lambda: self.engine.get_weights_by_name(name, truncate_size=2**31 - 1)
        )

    def export_weights(self) -> dict[str, torch.Tensor]:
        """Every parameter as SGLang holds it (its own names, fused projections), via a sharded save.

        ``Engine.save_sharded_model`` writes each TP rank's state dict as safetensors files; with one
        rank those are the whole model.
        """
        if self.tp_sizes != [1]:
            raise BackendError("reading SGLang's weights back through a save needs tensor_parallel_size=1")
        from safetensors.torch import load_file

        with tempfile.TemporaryDirectory(prefix="rlhf_sg-sglang-export-") as path:
            self.run(
                "save_sharded_model", lambda: self.engine.save_sharded_model(path=path, pattern=None, max_size=None)
            )
            state: dict[str, torch.Tensor] = {}
            for file in sorted(Path(path).glob("*.safetensors")):
                state.update(load_file(str(file)))
        return state

    def flush_cache(self) -> None:
        """SGLang's standalone flush (on CPU it ends in a full ``gc.collect()`` of the scheduler)."""
        result = self.run("flush_cache", self.engine.flush_cache)
        if not getattr(result, "success", True):
            raise BackendError(f"SGLang engine: flush_cache failed: {getattr(result, 'message', result)}")

    def flush_in_update(self) -> None:
        """Flush through an update call that loads nothing (inside an open update window)."""
        self.call("update_weights_from_tensor", named_tensors=[], flush_cache=True)

    def shutdown(self) -> None:
        if self.engine is not None and self._stuck is None:
            self.run("shutdown", self._shutdown_engine, timeout_s=120)
        self._thread.shutdown(wait=self._stuck is None, cancel_futures=True)

    def _shutdown_engine(self) -> None:
        """``Engine.shutdown``, ending the engine's own processes and no others.

        SGLang's ``Engine.shutdown`` ends with ``kill_process_tree(os.getpid(), include_parent=False)``: a SIGKILL
        to every descendant of the host process. In a process that also started a local Ray cluster (a driver, a
        test session) that is the whole cluster, and torch's shared-memory manager with it. For the length of the
        call the engine module's ``kill_process_tree`` is narrowed to the processes the engine started.
        """
        import sglang.srt.entrypoints.engine as engine_module

        kill_tree = engine_module.kill_process_tree
        host = os.getpid()

        def kill_engine_processes(parent_pid, include_parent=True, skip_pid=None, wait_timeout=60):
            if parent_pid != host or include_parent:
                return kill_tree(parent_pid, include_parent=include_parent, skip_pid=skip_pid,
                                 wait_timeout=wait_timeout)
            for pid in self._engine_children:
                if pid != skip_pid:
                    kill_tree(pid, include_parent=True, skip_pid=skip_pid, wait_timeout=wait_timeout)

        engine_module.kill_process_tree = kill_engine_processes
        try:
            self.engine.shutdown()
        finally:
            engine_module.kill_process_tree = kill_tree


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Refuse redirects: urllib would resend the Authorization header to wherever one points."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        raise urllib.error.HTTPError(req.full_url, code, f"redirect to {newurl} refused", headers, fp)


def _key_from_env(extra: dict[str, Any], name: str) -> str | None:
    """The key held by the environment variable ``extra[name]`` names (None when not named)."""
    var = extra.get(name)
    if var is None:
        return None
    if not (isinstance(var, str) and var.isascii() and var.isidentifier()):
        raise BackendError(
            f"BackendConfig.extra['{name}'] takes the NAME of an environment variable holding the key (letters, "
            "digits, underscores), not the key itself"
        )
    key = os.environ.get(var, "").strip()
    if not key:
        raise BackendError(
            f"BackendConfig.extra['{name}'] names environment variable {var}, which is not set (or empty) in the "
            f"process running the SGLang backend (pid {os.getpid()}); export {var} where that process starts (for "
            "an engine actor: before ray.init / ray start on its node)"
        )
    return key


class _HTTPDriver:
    """Running SGLang servers (optionally behind SGLang's router), over their HTTP API."""

    mode = "http"

    def __init__(
        self,
        server_urls: list[str],
        router_url: str | None,
        timeout_s: float,
        max_concurrency: int,
        keys: dict[str, tuple[str, str] | None],
    ):
        self.server_urls = [u.rstrip("/") for u in server_urls]
        self.router_url = router_url.rstrip("/") if router_url else None
        self._timeout_s = timeout_s
        # (extra key, variable, key) for each level; the admin level falls back to the API key, as
        # SGLang's ADMIN_OPTIONAL endpoints accept it on a server started without --admin-api-key
        api, admin = keys.get("api_key_env"), keys.get("admin_api_key_env")
        self._auth = {
            "normal": ("api_key_env", *api) if api else None,
            "admin": ("admin_api_key_env", *admin) if admin else ("api_key_env", *api) if api else None,
        }
        self._opener = urllib.request.build_opener(_NoRedirect())
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(max_concurrency, len(self.server_urls)), thread_name_prefix="sglang-http"
        )
        try:
            infos = self._on_every_server("get_server_info", "GET", None, timeout_s=60)
        except BackendError:
            self._pool.shutdown(wait=False)
            raise
        # SGLang 0.5.23 answers with its whole configuration, both keys included (at several places):
        # keep only what the backend reads
        self.server_info = {k: infos[0][k] for k in _SERVER_INFO_FIELDS if k in infos[0]}
        self.tp_sizes = [int(info["tp_size"]) for info in infos]

    def __repr__(self) -> str:  # no keys in reprs
        return f"_HTTPDriver(server_urls={self.server_urls}, router_url={self.router_url})"

    def request(self, base: str, endpoint: str, method: str, body: Any, timeout_s: float | None = None) -> Any:
        """``method`` ``base/endpoint`` with the key ``endpoint``'s SGLang auth level takes; JSON in and out."""
        data = None if body is None else json.dumps(body).encode()
        level = "normal" if endpoint in _NORMAL_ENDPOINTS else "admin"
        auth = self._auth[level]
        headers = {"Content-Type": "application/json"}
        if auth is not None:
            headers["Authorization"] = f"Bearer {auth[2]}"
        req = urllib.request.Request(f"{base}/{endpoint}", data=data, method=method, headers=headers)
        timeout_s = self._timeout_s if timeout_s is None else timeout_s
        try:
            with self._opener.open(req, timeout=timeout_s) as resp:
                text = resp.read().decode()
        except urllib.error.HTTPError as exc:
            if exc.code in (401, 403):
                raise BackendError(_auth_refused(base, endpoint, method, exc.code, level, auth)) from None
            if 300 <= exc.code < 400:
                raise BackendError(
                    f"SGLang server {base}: {method} /{endpoint} answered {exc.code}, a redirect to "
                    f"{exc.headers.get('Location')}; redirects are not followed (they would carry the key "
                    "elsewhere): list the servers' final URLs in extra['server_urls']"
                ) from None
            detail = exc.read().decode()[:2000]
            raise BackendError(f"SGLang server {base}: {method} /{endpoint} answered {exc.code}: {detail}") from exc
        except (urllib.error.URLError, TimeoutError, OSError) as exc:
            raise BackendError(
                f"SGLang server {base}: {method} /{endpoint} failed within {timeout_s} s: {exc}; is the server "
                "running and reachable from this node?"
            ) from exc
        try:
            return json.loads(text) if text else None
        except json.JSONDecodeError:
            return text

    def _on_every_server(self, endpoint: str, method: str, body: Any, timeout_s: float | None = None) -> list[Any]:
        futures = [self._pool.submit(self.request, url, endpoint, method, body, timeout_s) for url in self.server_urls]
        return [f.result() for f in futures]

    def generate(self, input_ids: list[list[int]], sampling: list[dict], inflight: _InFlight,
                 routed_experts: bool = False) -> list[dict]:
        try:
            return self._generate(input_ids, sampling, routed_experts)
        finally:
            inflight.done.set()

    def abort(self, inflight: _InFlight) -> None:
        """From any thread: ``POST /abort_request {"abort_all": true}`` to every server (an admin endpoint).

        Sent from the calling thread, not through the pool the generate's requests may fill.
        """
        for url in self.server_urls:
            if inflight.done.is_set():
                return
            self.request(url, "abort_request", "POST", {"abort_all": True}, timeout_s=min(self._timeout_s, 60.0))

    def _generate(self, input_ids: list[list[int]], sampling: list[dict], routed_experts: bool) -> list[dict]:
        if self.router_url is not None:
            futures = [
                self._pool.submit(
                    self.request,
                    self.router_url,
                    "generate",
                    "POST",
                    {"input_ids": ids, "sampling_params": sp, "return_logprob": True, "logprob_start_len": -1,
                     "return_routed_experts": routed_experts},
                )
                for ids, sp in zip(input_ids, sampling)
            ]
            return [f.result() for f in futures]
        n = len(self.server_urls)
        bounds = [len(input_ids) * i // n for i in range(n + 1)]
        futures = [
            self._pool.submit(
                self.request,
                url,
                "generate",
                "POST",
                {
                    "input_ids": input_ids[lo:hi],
                    "sampling_params": sampling[lo:hi],
                    "return_logprob": True,
                    "logprob_start_len": -1,
                    "return_routed_experts": routed_experts,
                },
            )
            for url, lo, hi in zip(self.server_urls, bounds, bounds[1:])
            if hi > lo
        ]
        return [out for f in futures for out in f.result()]

    def call(self, method: str, timeout_s: float | None = None, **kwargs) -> Any:
        answers = self._on_every_server(method, "POST", kwargs, timeout_s)
        for url, answer in zip(self.server_urls, answers):
            _check_answer(f"{method} on {url}", answer)
        return answers

    def init_group(self, spec: WeightGroupSpec) -> None:
        """Every server joins at once (the group forms only when all ranks are in); ranks follow server order."""
        futures = [
            self._pool.submit(
                self.request,
                url,
                "init_weights_update_group",
                "POST",
                {
                    "master_address": spec.master_address,
                    "master_port": spec.master_port,
                    "rank_offset": spec.rank_offset + sum(self.tp_sizes[:i]),
                    "world_size": spec.world_size,
                    "group_name": spec.group_name,
                    "backend": spec.backend,
                },
                spec.timeout_s,
            )
            for i, url in enumerate(self.server_urls)
        ]
        for url, future in zip(self.server_urls, futures):
            _check_answer(f"init_weights_update_group on {url}", future.result())

    def pause(self) -> None:
        self._on_every_server("pause_generation", "POST", {"mode": "retract"})

    def resume(self) -> None:
        self._on_every_server("continue_generation", "POST", {})

    def update_from_bucket(self, payloads: list[bytes]) -> None:
        """POST each server its TP ranks' payloads (base64, as SGLang's HTTP API takes bytes)."""
        import base64

        start = 0
        for url, tp in zip(self.server_urls, self.tp_sizes):
            body = {
                "serialized_named_tensors": [base64.b64encode(p).decode("ascii") for p in payloads[start : start + tp]],
                "load_format": "flattened_bucket",
                "flush_cache": False,
            }
            _check_answer(
                f"update_weights_from_tensor on {url}", self.request(url, "update_weights_from_tensor", "POST", body)
            )
            start += tp

    def get_weights(self, name: str) -> Any:
        return self.request(
            self.server_urls[0], "get_weights_by_name", "POST", {"name": name, "truncate_size": 2**31 - 1}
        )

    def export_weights(self) -> dict[str, torch.Tensor]:
        raise BackendError("SGLang http mode cannot read weights back beyond what the servers' model class exports")

    def flush_cache(self) -> None:
        """SGLang's standalone flush on every server (on CPU it ends in a full ``gc.collect()``)."""
        for url, answer in zip(self.server_urls, self._on_every_server("flush_cache", "POST", None)):
            _check_answer(f"flush_cache on {url}", answer)

    def flush_in_update(self) -> None:
        """Flush every server through an update call that loads nothing (inside an open update window).

        The payload is each TP rank's serialized empty tensor list (SGLang's unpickler reads plain
        pickles), so no sglang import is needed here.
        """
        empty = base64.b64encode(pickle.dumps([])).decode("ascii")
        futures = [
            self._pool.submit(
                self.request,
                url,
                "update_weights_from_tensor",
                "POST",
                {"serialized_named_tensors": [empty] * tp, "flush_cache": True},
            )
            for url, tp in zip(self.server_urls, self.tp_sizes)
        ]
        for url, future in zip(self.server_urls, futures):
            _check_answer(f"update_weights_from_tensor (flush) on {url}", future.result())

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _auth_refused(
    base: str, endpoint: str, method: str, code: int, level: str, auth: tuple[str, str, str] | None
) -> str:
    """The message for a 401 / 403: the server, the endpoint, the key it takes and the variable to set."""
    if level == "normal":
        wants = "a normal endpoint: it takes the server's --api-key"
        name = "api_key_env"
    else:
        wants = (
            "an admin endpoint (weight updates, flush, pause, memory): it takes the server's --admin-api-key, "
            "or its --api-key when it was started without an admin key"
        )
        name = "admin_api_key_env"
    if auth is None:
        sent = (
            f"no key was sent: put the key in an environment variable and name that variable with "
            f"BackendConfig.extra['{name}'] (--rollout.engine_kwargs)"
        )
    else:
        sent = f"the key in environment variable {auth[1]} (extra['{auth[0]}']) was refused: set it to the right key"
        if level == "admin" and auth[0] == "api_key_env":
            sent += f", or name the admin key's variable with extra['{name}']"
    return f"SGLang server {base}: {method} /{endpoint} answered {code} ({wants}); {sent}"


def decode_routed_experts(value: Any, tokens: int, num_layers: int, top_k: int, moe_layers: list[int]) -> torch.Tensor:
    """SGLang's ``meta_info["routed_experts"]`` (base64 of int32 ``[tokens, num_layers, top_k]``: every decoder layer,
    ``tokens`` = prompt + completion - 1) -> ``Completion.routed_experts`` ``[tokens, len(moe_layers), top_k]`` int16,
    the MoE layers' columns in decoder order. BackendError when it is missing or of another size."""
    import base64

    import numpy as np

    if value is None:
        raise BackendError("SGLang returned no routed_experts for a request that asked for them; start the engine "
                           "with enable_return_routed_experts (servers: --enable-return-routed-experts)")
    raw = np.frombuffer(base64.b64decode(value), dtype=np.int32) if isinstance(value, str) else np.asarray(value)
    if raw.size != tokens * num_layers * top_k:
        raise BackendError(f"SGLang's routed_experts hold {raw.size} values; {tokens} tokens x {num_layers} layers x "
                           f"top-{top_k} need {tokens * num_layers * top_k}")
    routes = torch.from_numpy(raw.astype(np.int16).reshape(tokens, num_layers, top_k))
    return routes[:, moe_layers].contiguous()


def _check_answer(what: str, answer: Any) -> None:
    """Raise on SGLang's ``(False, message)`` / ``{"success": False}`` answers."""
    if isinstance(answer, dict) and answer.get("success") is False:
        raise BackendError(f"SGLang: {what} failed: {answer.get('message')}")
    if isinstance(answer, tuple) and answer and answer[0] is False:
        raise BackendError(f"SGLang: {what} failed: {answer[1] if len(answer) > 1 else ''}")


# ---- the backend ----------------------------------------------------------------------------------
#: architectures SGLang 0.5.23 starts but does not serve as transformers 5.19 computes them, measured on CPU with
#: ``python -m rlhf_sg.bench engine-families --backend sglang`` (the matrix's tiny configs): refused at start
_MEASURED_UNSERVED = {
    "Cohere2ForCausalLM": "its engine log-probs were 0.18 off the model's before any weight update",
    "Gemma2ForCausalLM": "its scheduler fails at start reading transformers 5's Gemma2Config (no hidden_act) and "
                         "SIGQUITs the process that started it",
}


def _measured_unserved(model_path: str) -> str | None:
    """Why SGLang is known not to serve this model's architecture (:data:`_MEASURED_UNSERVED`), or None."""
    import json

    try:
        with open(os.path.join(model_path, "config.json")) as f:
            architectures = json.load(f).get("architectures") or []
    except (OSError, ValueError):
        return None
    for arch in architectures:
        if arch in _MEASURED_UNSERVED:
            return (f"model {model_path!r} ({arch}): SGLang does not serve it as transformers computes it: "
                    f"{_MEASURED_UNSERVED[arch]}; use --rollout.backend hf")
    return None


def _unserved_window(model_path: str, max_model_len: int) -> str | None:
    """Why SGLang would not compute this model's attention as transformers does, or None: transformers attends over
    a sliding window (``config.sliding_window`` on the layers ``layer_types`` marks sliding, or all of them without
    ``layer_types``: Mistral, Mixtral, Qwen2 with ``use_sliding_window``, Starcoder2, Phi-3), while the SGLang model
    class it resolves to passes no ``sliding_window_size`` to its attention (read from that class's module source),
    and the engine's context is longer than the window. Measured on CPU: the matrix's tiny Mistral and windowed Qwen2
    (window 4) differed from transformers by 0.14 and 0.087 in log-prob before any weight update."""
    import inspect

    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(model_path)
    except Exception:  # unreadable here: SGLang reports it at start
        return None
    text = hf_config.get_text_config()
    window = getattr(text, "sliding_window", None)
    layer_types = getattr(text, "layer_types", None)
    if not window or max_model_len <= window or (layer_types is not None and "sliding_attention" not in layer_types):
        return None
    from sglang.srt.models.registry import ModelRegistry

    try:
        model_cls, arch = ModelRegistry.resolve_model_cls(list(hf_config.architectures or []))
    except Exception:  # an architecture SGLang does not have: it refuses it at start, naming it
        return None
    module = inspect.getmodule(model_cls)
    if module is None or "sliding_window_size" in inspect.getsource(module):
        return None
    return (
        f"model {model_path!r} ({arch}) attends over a sliding window of {window} tokens in transformers "
        f"(config.sliding_window), but SGLang's {module.__name__} passes no window to its attention: sequences "
        f"longer than {window} tokens would get other log-probs from the engine than from the trainer. Set "
        f"--rollout.max_model_len to at most {window}, or use --rollout.backend hf"
    )


class SGLangBackend(RolloutBackend):
    """SGLang behind the rollout-backend interface (see the module docstring)."""

    name = "sglang"
    transports = frozenset({"collective", "tensor", "disk"})
    supports_abort = True
    supports_routed_experts = True  # started with BackendConfig.routed_experts, on CUDA (SGLang's capture)

    def __init__(self, config: BackendConfig):
        super().__init__(config)
        extra = dict(config.extra)
        for literal, named in _SECRET_EXTRA_KEYS.items():
            if literal in extra:
                raise BackendError(
                    f"BackendConfig.extra['{literal}']: keys never go in the config (it is saved with the run and "
                    f"reaches shell history); put the key in an environment variable and set extra['{named}'] to "
                    "that variable's name"
                )
        unknown = sorted(set(extra) - _EXTRA_KEYS)
        if unknown:
            raise BackendError(
                f"BackendConfig.extra has key(s) {unknown} the SGLang backend does not know; known: "
                f"{sorted(_EXTRA_KEYS)} (put sglang.Engine arguments under extra['engine_kwargs'])"
            )
        if config.dtype not in _DTYPES:
            raise BackendError(f"BackendConfig.dtype must be one of {list(_DTYPES)}, got {config.dtype!r}")
        if config.tensor_parallel_size < 1:
            raise BackendError(f"BackendConfig.tensor_parallel_size must be >= 1, got {config.tensor_parallel_size}")
        timeout_s = float(extra.get("request_timeout_s", 1800.0))
        if timeout_s <= 0:
            raise BackendError(f"BackendConfig.extra['request_timeout_s'] must be > 0, got {timeout_s}")
        self._timeout_s = timeout_s
        self._inflight: _InFlight | None = None  # the running generate, for abort_generation
        self._group_name: str | None = None
        self._group_timeout_s = timeout_s
        self._update_open = False  # inside begin_weight_update .. end_weight_update
        self._asleep = False  # some memory tag is released (generate refused)
        self._released: set[str] = set()  # our memory tags released by sleep, not yet woken
        self._weights_lost = False  # released without a CPU backup: a full sync must come first
        self._closed = True  # until the driver is up
        self._warned_seed = False
        self._export: dict[str, torch.Tensor] | None = None  # weights read back through a save, until an update
        self._native_readback = True  # SGLang's model class has get_weights_by_name (until it says otherwise)

        if "server_urls" in extra:
            urls = extra["server_urls"]
            if isinstance(urls, str) or not urls or not all(isinstance(u, str) and u for u in urls):
                raise BackendError(f"BackendConfig.extra['server_urls'] must be a non-empty list of URLs, got {urls!r}")
            if "engine_kwargs" in extra:
                raise BackendError(
                    "BackendConfig.extra: 'engine_kwargs' is for engine mode; the servers of "
                    "'server_urls' take their arguments on their own command lines"
                )
            keys = {}
            for name in ("api_key_env", "admin_api_key_env"):
                key = _key_from_env(extra, name)
                keys[name] = (extra[name], key) if key is not None else None
            self._driver = _HTTPDriver(
                urls, extra.get("router_url"), timeout_s, int(extra.get("max_concurrency", 256)), keys
            )
            if sum(self._driver.tp_sizes) != config.tensor_parallel_size:
                self._driver.shutdown()
                raise BackendError(
                    f"BackendConfig.tensor_parallel_size={config.tensor_parallel_size}, but the servers of "
                    f"server_urls run tp_size {self._driver.tp_sizes} (sum {sum(self._driver.tp_sizes)}): set it "
                    "to the sum, the number of ranks the engine takes in a weight-update group"
                )
        else:
            for name in ("router_url", "api_key_env", "admin_api_key_env"):
                if name in extra:
                    raise BackendError(f"BackendConfig.extra['{name}'] needs extra['server_urls'] (http mode)")
            engine_kwargs = sglang_engine_kwargs(config, extra.get("engine_kwargs", {}))
            # after the engine's settings: they set SGLang's CPU mode, which must precede any import of sglang
            unserved = (_measured_unserved(config.model_path)
                        or _unserved_window(config.model_path, config.max_model_len))
            if unserved is not None:
                raise BackendError(unserved)
            self._driver = _EngineDriver(engine_kwargs, timeout_s)
        self._closed = False
        info = self._driver.server_info
        self._context_len = int(info.get("context_length") or config.max_model_len)
        self._vocab_size = _vocab_size(config.model_path)
        self._shapes = _checkpoint_shapes(config.model_path)
        self._deterministic = bool(info.get("enable_deterministic_inference", False))
        self._unseeded = torch.Generator().manual_seed(config.seed)

    # ---- rollout -------------------------------------------------------------------------
    @property
    def decode_steps(self) -> int | None:
        """The running generate's progress in tokens (engine mode; None over HTTP): see
        :meth:`_EngineDriver.tokens_so_far`."""
        if isinstance(self._driver, _EngineDriver) and self._driver.engine is not None:
            return self._driver.tokens_so_far()
        return None

    @property
    def honours_seed(self) -> bool:
        """True when ``SamplingParams.seed`` makes a call reproducible (SGLang deterministic inference)."""
        return self._deterministic

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Sample ``params.n`` completions per prompt; prompt-major, ``len(prompts) * n`` of them."""
        self._check_usable("generate")
        check_generate_args(prompts, params, self._vocab_size, self._context_len, routed_experts=True)
        if params.return_routed_experts and not self.config.routed_experts:
            raise BackendError("generate: SamplingParams.return_routed_experts, but this SGLang backend was started "
                               "without BackendConfig.routed_experts (SGLang's enable_return_routed_experts); start "
                               "it with routed_experts=True (servers: --enable-return-routed-experts)")
        if self._update_open:  # buckets came without finish_weight_update; SGLang serves only once the window closes
            self._close_update()
        if self._weights_lost:
            raise BackendError(
                "generate: sleep() released the weights without a CPU backup; push a full weight sync first "
                "(or start with engine_kwargs enable_weights_cpu_backup=True)"
            )
        if params.seed is not None and not self._deterministic and not self._warned_seed:
            logger.warning(
                "SGLang ignores SamplingParams.seed without enable_deterministic_inference (GPU attention "
                "backends only); sampling uses the engine's own random stream"
            )
            self._warned_seed = True
        rows = len(prompts) * params.n
        if self._deterministic:
            call_seed = params.seed
            if call_seed is None:
                call_seed = int(torch.randint(0, 2**62, (1,), generator=self._unseeded))
            # one seed per completion row, so the n samples of a prompt differ (SGLang takes int64)
            sampling = [
                sglang_sampling_params(params, row_seed(call_seed, i, j) >> 1)
                for i in range(len(prompts))
                for j in range(params.n)
            ]
        else:
            # one dict for every row, as SGLang itself expands a single sampling dict over a batch
            sampling = [sglang_sampling_params(params)] * rows
        input_ids = [list(map(int, p)) for p in prompts for _ in range(params.n)]
        inflight = _InFlight()
        self._inflight = inflight
        try:
            outputs = self._driver.generate(input_ids, sampling, inflight, params.return_routed_experts)
        finally:
            inflight.done.set()
            self._inflight = None
        if len(outputs) != len(input_ids):
            raise BackendError(f"SGLang returned {len(outputs)} outputs for {len(input_ids)} requests")
        layout = self._route_layout() if params.return_routed_experts else None
        completions = [self._completion(out, row // params.n, inflight.aborted) for row, out in enumerate(outputs)]
        if layout is not None:
            for row, (out, c) in enumerate(zip(outputs, completions)):
                c.routed_experts = decode_routed_experts(out["meta_info"].get("routed_experts"),
                                                         len(input_ids[row]) + len(c.token_ids) - 1, *layout)
        return completions

    def _route_layout(self) -> tuple[int, int, list[int]]:
        """(decoder layers, experts per token, MoE layers' indices) of the served model, for
        :func:`decode_routed_experts` (the layers from a meta-device build of its config: no weights read)."""
        if getattr(self, "_routes_layout", None) is None:
            from transformers import AutoConfig, AutoModelForCausalLM

            from rlhf_sg.moe import RouteRecorder

            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.config.model_path))
            recorder = RouteRecorder(model)
            layers = int(model.config.get_text_config().num_hidden_layers)
            self._routes_layout = (layers, recorder.top_k, [layer for _, layer in recorder.layers])
        return self._routes_layout

    def abort_generation(self) -> None:
        """Cut the running ``generate`` short (from another thread; a no-op when none runs), and return once it
        has returned.

        SGLang's own abort: ``abort_request(abort_all=True)``, queued onto the in-process engine's event loop or
        ``POST /abort_request`` to every server. The scheduler ends each running request after its next decode
        step (that token is kept, with its log-prob) and drops queued ones; the generate then returns every
        request with SGLang's finish reason ``"abort"`` and the tokens sampled so far. Requests still on their
        way to the scheduler when the abort arrives are not in it yet, so the abort is sent again, at growing
        intervals, until the generate has returned (at most ``request_timeout_s``).
        """
        inflight = self._inflight
        if inflight is None or self._closed:
            return
        inflight.aborted = True
        deadline = time.monotonic() + self._timeout_s
        pause = 0.02
        while not inflight.done.is_set():
            self._driver.abort(inflight)
            if inflight.done.wait(pause):
                return
            if time.monotonic() > deadline:
                raise BackendError(
                    f"abort_generation: the running generate did not return within request_timeout_s="
                    f"{self._timeout_s} s of the abort"
                )
            pause = min(2 * pause, 0.5)

    def _completion(self, out: dict, prompt_index: int, aborted: bool = False) -> Completion:
        meta = out["meta_info"]
        finish = meta.get("finish_reason") or {}
        kind = finish.get("type")
        # "abort" after abort_generation: the tokens so far (none when the request never left the queue); an
        # abort nobody asked for is the engine's own (a bad request, a timeout) and an error
        if kind not in ("stop", "length") and not (kind == "abort" and aborted):
            raise BackendError(f"SGLang aborted the completion of prompt {prompt_index}: {finish}")
        token_ids = [int(t) for t in out["output_ids"]]
        entries = meta.get("output_token_logprobs") or []  # (log-prob, token id, text) per token
        if [e[1] for e in entries] != token_ids:
            raise BackendError(
                f"SGLang's log-probs for prompt {prompt_index} do not line up with its tokens "
                f"({len(entries)} log-probs, {len(token_ids)} tokens)"
            )
        return Completion(
            token_ids=token_ids,
            logprobs=[float(e[0]) for e in entries],
            finish_reason=kind,
            weight_version=self._weight_version,
            prompt_index=prompt_index,
            cached_tokens=int(meta["cached_tokens"]) if meta.get("cached_tokens") is not None else None,
        )

    def _check_usable(self, what: str) -> None:
        if self._closed:
            raise BackendError(f"{what}: the SGLang backend is shut down")
        if self._asleep and what == "generate":
            raise BackendError(
                f"generate: the SGLang backend is asleep (released: {sorted(self._released)}); call wake() first"
            )
        if MEMORY_WEIGHTS in self._released and what.startswith("update_weights"):
            raise BackendError(
                f"{what}: the SGLang backend released its weights; call wake(('weights',)) before pushing weights"
            )

    # ---- weights -------------------------------------------------------------------------
    def init_weight_update_group(self, spec: WeightGroupSpec) -> None:
        """Join the trainer's weight-update group; returns once every rank has joined."""
        self._check_usable("init_weight_update_group")
        if self._group_name is not None:
            raise BackendError(f"already in weight-update group {self._group_name!r}; destroy it first")
        ranks = self.config.tensor_parallel_size
        if spec.rank_offset < 1 or spec.rank_offset + ranks > spec.world_size:
            raise BackendError(
                f"WeightGroupSpec: this engine's {ranks} rank(s) from rank_offset={spec.rank_offset} do not fit in "
                f"world_size={spec.world_size} with the trainer's sender at rank 0"
            )
        self._driver.init_group(spec)
        self._group_name = spec.group_name
        self._group_timeout_s = spec.timeout_s

    @classmethod
    def open_sender_group(cls, spec: WeightGroupSpec, store: Any) -> Any:
        """The trainer's end of the group, on SGLang's key layout (see :func:`open_weight_update_group`)."""
        return open_weight_update_group(spec, 0, store=store)

    def update_weights_from_collective(self, manifest: BucketManifest, src_rank: int = 0) -> None:
        """Receive one bucket broadcast by group rank 0 (the trainer's sender) and load it."""
        self._check_usable("update_weights_from_collective")
        if self._group_name is None:
            raise BackendError("update_weights_from_collective: no weight-update group; call init_weight_update_group")
        if src_rank != 0:
            raise BackendError(f"SGLang receives weight broadcasts from group rank 0 only, got src_rank={src_rank}")
        _check_packed(manifest)
        refusal = self._refusal([(t.name, t.shape) for t in manifest.tensors], "update_weights_from_collective")
        if refusal is None:
            names = [t.name for t in manifest.tensors]
            dtypes = [str(manifest.dtype).removeprefix("torch.")] * len(names)
            shapes = [list(t.shape) for t in manifest.tensors]
        else:
            # The sender broadcasts this bucket whatever we think of it; receive its bytes under a name
            # no model has (SGLang's loaders skip unknown names), so nothing is copied and the group
            # stays in step for the next bucket.
            names, dtypes, shapes = [_DISCARD_NAME], ["uint8"], [[manifest.numel * manifest.dtype.itemsize]]
        self._open_update()
        self._driver.call(
            "update_weights_from_distributed",
            timeout_s=self._group_timeout_s,
            names=names,
            dtypes=dtypes,
            shapes=shapes,
            group_name=self._group_name,
            flush_cache=False,
            load_format="flattened_bucket",
        )
        if refusal is not None:
            raise BackendError(refusal)

    def destroy_weight_update_group(self) -> None:
        if self._group_name is None or self._closed:
            return
        name, self._group_name = self._group_name, None
        self._driver.call("destroy_weights_update_group", group_name=name)

    @classmethod
    def pack_tensor_bucket(
        cls, manifest: BucketManifest, flat: torch.Tensor, num_tp_ranks: int, _children_only: bool = False
    ) -> list[bytes]:
        """Sender side of the tensor transport: one ``flattened_bucket`` payload per TP rank.

        Runs in the process that owns ``flat`` (the trainer rank). Each payload is SGLang's own format
        for ``update_weights_from_tensor(load_format="flattened_bucket")``: the ForkingPickler bytes
        (what ``sglang.srt.utils.MultiprocessingSerializer.serialize`` makes) of ``{"flattened_tensor":
        the bucket's bytes as uint8, "metadata": [one record per tensor]}``. The bytes go by shared
        memory on CPU and by CUDA IPC on GPU, the device named by UUID as SGLang's receivers expect
        (see :mod:`backends.shared_tensor`). The records are ``types.SimpleNamespace`` with the fields
        of SGLang's ``FlattenedTensorMetadata`` (its loader reads them by attribute; its unpickler
        admits the type), so the trainer never imports sglang. Each rank deserialises only its own
        payload, so every payload is made here, by the owner of the memory. ``_children_only``: the
        engine runs in this process (see :func:`backends.shared_tensor.share`).
        """
        from types import SimpleNamespace

        from backends.shared_tensor import share

        if num_tp_ranks < 1:
            raise BackendError(f"pack_tensor_bucket: num_tp_ranks must be >= 1, got {num_tp_ranks}")
        if flat.dim() != 1 or flat.numel() != manifest.numel or flat.dtype != manifest.dtype:
            raise BackendError(
                f"pack_tensor_bucket: buffer is {tuple(flat.shape)} {flat.dtype}, manifest expects "
                f"[{manifest.numel}] {manifest.dtype}"
            )
        if not flat.is_contiguous():  # a contiguous copy would be freed before the engine opens it
            raise BackendError("pack_tensor_bucket: the bucket buffer must be contiguous")
        _check_packed(manifest)
        itemsize = manifest.dtype.itemsize
        metadata = [
            SimpleNamespace(
                name=t.name,
                shape=torch.Size(t.shape),
                dtype=manifest.dtype,
                start_idx=t.offset * itemsize,
                end_idx=(t.offset + t.numel) * itemsize,
                numel=t.numel * itemsize,
            )
            for t in manifest.tensors
        ]
        if flat.is_cuda:
            torch.cuda.current_stream(flat.device).synchronize()
        payload = {"flattened_tensor": flat.view(torch.uint8), "metadata": metadata}
        return [share(payload, children_only=_children_only) for _ in range(num_tp_ranks)]

    def update_weights_from_tensor(self, manifest: BucketManifest, flat: Any) -> None:
        """Load one bucket handed over in memory (colocated): the per-TP-rank payloads of
        :meth:`pack_tensor_bucket`, passed to SGLang untouched. A tensor (in-process use) is packed here,
        by this process, which then owns its memory."""
        self._check_usable("update_weights_from_tensor")
        ranks = self.config.tensor_parallel_size
        if isinstance(flat, torch.Tensor):
            # This process owns the tensor; an in-process engine's schedulers are its own children.
            flat = self.pack_tensor_bucket(
                manifest, flat, ranks, _children_only=isinstance(self._driver, _EngineDriver)
            )
        if (
            not isinstance(flat, (list, tuple))
            or len(flat) != ranks
            or not all(isinstance(p, (bytes, bytearray)) for p in flat)
        ):
            kind = f"{len(flat)} items" if isinstance(flat, (list, tuple)) else type(flat).__name__
            raise BackendError(
                f"update_weights_from_tensor: expected {ranks} payload(s) (bytes, one per TP rank) from "
                f"SGLangBackend.pack_tensor_bucket in the process that owns the bucket, got {kind}"
            )
        refusal = self._refusal([(t.name, t.shape) for t in manifest.tensors], "update_weights_from_tensor")
        if refusal is not None:
            raise BackendError(refusal)
        self._open_update()
        self._driver.update_from_bucket([bytes(p) for p in flat])

    def update_weights_from_disk(self, path: str) -> None:
        """Reload every weight from a directory of HF-named safetensors files."""
        self._check_usable("update_weights_from_disk")
        if not os.path.isdir(path) or not any(Path(path).glob("*.safetensors")):
            raise BackendError(f"update_weights_from_disk: {path!r} is not a directory of .safetensors files")
        refusal = self._refusal(list(_checkpoint_shapes(path).items()), f"update_weights_from_disk({path!r})")
        if refusal is not None:
            raise BackendError(refusal)
        if self._update_open:
            self._close_update(flush=False)  # the reload below flushes
        self._export = None
        self._driver.pause()
        try:
            self._driver.call("update_weights_from_disk", model_path=path)
        finally:
            self._driver.resume()
        self._weights_lost = False

    def finish_weight_update(self, version: int) -> None:
        """Close the sync: flush the prefix cache once (in the update window), end it, record ``version``.

        With no window open no bucket has loaded since the last flush (closing a window flushes, a
        disk reload flushes in SGLang's own update call), so nothing is flushed again.
        """
        self._check_usable("finish_weight_update")
        if self._update_open:
            self._close_update()
        self._weights_lost = False
        self._weight_version = int(version)

    def _open_update(self) -> None:
        """Pause generation and open SGLang's weight-update window (once per sync)."""
        self._export = None
        if not self._update_open:
            self._driver.pause()
            try:
                self._driver.call("begin_weight_update")
            except BackendError:
                self._driver.resume()
                raise
            self._update_open = True

    def _close_update(self, flush: bool = True) -> None:
        """Flush stale KV inside the window (cheap; see the module docstring), end it, continue generation.

        ``flush=False`` when the caller flushes right after (a disk reload does, in its update call).
        """
        self._update_open = False
        try:
            try:
                if flush:
                    self._driver.flush_in_update()
            finally:
                self._driver.call("end_weight_update")  # SGLang finalises the loaded weights
        finally:
            self._driver.resume()

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight the engine loads, HF name -> shape, read from the checkpoint it started from.

        Cheap (safetensors headers only) and available for every model, unlike
        :meth:`get_weights_by_name`; empty when ``model_path`` is not readable here (http mode).
        """
        return dict(self._shapes)

    def _refusal(self, tensors: list[tuple[str, tuple[int, ...]]], what: str) -> str | None:
        """Why SGLang must not load these (name, shape) pairs, or None; checked before any byte is copied."""
        if not self._shapes:
            return None
        for name, shape in tensors:
            if name not in self._shapes:
                return f"{what}: tensor {name!r} is not a weight of this model ({self.config.model_path})"
            if tuple(shape) != self._shapes[name]:
                return (
                    f"{what}: tensor {name!r} has shape {tuple(shape)}, the engine's weight is "
                    f"{self._shapes[name]}; send the trainer's weights of the same model"
                )
        return None

    def get_weights_by_name(self, name: str) -> torch.Tensor:
        """A float32 CPU copy of one parameter (HF name), at the checkpoint's shape.

        SGLang's own ``get_weights_by_name`` serves the model classes that implement it (in 0.5.23
        the Llama family, Granite, OPT, Exaone4). For the others (Qwen2, ...) the weights are exported
        once per update through ``Engine.save_sharded_model`` (engine mode, one TP rank) and the HF
        name is cut out of SGLang's fused projections (``qkv_proj``, ``gate_up_proj``), so this is slow
        the first time after each update: it is for checks and debugging.
        """
        self._check_usable("get_weights_by_name")
        if self._shapes and name not in self._shapes:
            raise BackendError(f"get_weights_by_name: {name!r} is not a weight of {self.config.model_path}")
        values = self._driver.get_weights(name) if self._native_readback else None
        if values is not None and not isinstance(values, dict):
            weight = torch.tensor(values, dtype=torch.float32)
        else:
            self._native_readback = False  # this model class has none; do not ask (and log) again
            weight = self._exported_weight(name)
        shape = self._shapes.get(name)
        if shape is not None and tuple(weight.shape) != shape:
            # SGLang pads vocabulary-sized weights to a multiple of its tile; the extra rows are not weights.
            weight = weight[tuple(slice(0, n) for n in shape)].contiguous()
        return weight

    def _exported_weight(self, name: str) -> torch.Tensor:
        if self._export is None:
            self._export = self._driver.export_weights()
        state = self._export
        if name in state:
            return state[name].float()
        # A projection SGLang fuses: its rows sit in the fused weight after its siblings' rows.
        for fused, parts in _FUSED_PROJECTIONS:
            for i, part in enumerate(parts):
                if f".{part}." not in name:
                    continue
                fused_name = name.replace(f".{part}.", f".{fused}.")
                siblings = [name.replace(f".{part}.", f".{p}.") for p in parts]
                if fused_name not in state or any(s not in self._shapes for s in siblings):
                    break
                start = sum(self._shapes[s][0] for s in siblings[:i])
                return state[fused_name][start : start + self._shapes[name][0]].float()
        raise BackendError(
            f"get_weights_by_name: SGLang's model holds no weight for {name!r} (its classes of this model "
            "neither export it nor fuse it in a way this backend knows)"
        )

    # ---- memory and lifetime ---------------------------------------------------------------
    def sleep(self, tags: tuple[str, ...] | None = None) -> None:
        """Release ``tags`` (None: all) with SGLang's ``release_memory_occupation``, generation paused.

        Frees device memory only with ``enable_memory_saver``; released tags stay released until :meth:`wake`.
        """
        self._check_usable("sleep")
        wanted = [t for t in memory_tags(tags, "sleep") if t not in self._released]
        if not wanted:
            return
        if self._update_open:
            self._close_update()
        self._export = None
        self._driver.pause()  # SGLang asserts an idle scheduler before it releases anything
        self._driver.call("release_memory_occupation", tags=_sglang_tags(wanted))
        self._released.update(wanted)
        self._asleep = True
        saver = self._driver.server_info
        if MEMORY_WEIGHTS in wanted and saver.get("enable_memory_saver") and not saver.get("enable_weights_cpu_backup"):
            self._weights_lost = True

    def wake(self, tags: tuple[str, ...] | None = None) -> None:
        """Resume the released ``tags`` (None: all) with ``resume_memory_occupation``; generation continues
        once nothing is released any more."""
        self._check_usable("wake")
        wanted = [t for t in memory_tags(tags, "wake") if t in self._released]
        if not wanted:
            return
        self._driver.call("resume_memory_occupation", tags=_sglang_tags(wanted))
        self._released.difference_update(wanted)
        self._asleep = bool(self._released)
        if not self._asleep:
            self._driver.resume()

    def reset_prefix_cache(self) -> None:
        """Drop cached KV now: SGLang's standalone ``flush_cache`` (a weight sync needs no call to this)."""
        self._check_usable("reset_prefix_cache")
        self._driver.flush_cache()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._driver.shutdown()


# ---- helpers ------------------------------------------------------------------------------------
def _sglang_tags(tags: list[str]) -> list[str]:
    """SGLang's memory tags for ours (see :data:`SGLANG_MEMORY_TAGS`)."""
    return [sglang_tag for tag in tags for sglang_tag in SGLANG_MEMORY_TAGS[tag]]


def _check_packed(manifest: BucketManifest) -> None:
    """SGLang's receive buffer packs the tensors back to back in manifest order; so must the bucket."""
    offset = 0
    for t in manifest.tensors:
        if t.offset != offset:
            raise BackendError(
                f"bucket tensor {t.name!r} starts at element {t.offset}, SGLang expects {offset}: its collective "
                "receive packs the manifest's tensors back to back in order, without padding"
            )
        offset += t.numel
    if offset != manifest.numel:
        raise BackendError(f"bucket holds {manifest.numel} elements, its tensors {offset}: SGLang expects no padding")


def _check_model_path(path: str, allow_hub_id: bool) -> None:
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise BackendError(f"BackendConfig.model_path {path!r} has no config.json; point it at a saved HF model")
        return
    if allow_hub_id and _HUB_ID.match(path) and not os.path.exists(path):
        return  # a model-hub id, fetched by SGLang on GPU machines
    raise BackendError(f"BackendConfig.model_path {path!r} is not a directory (a saved HF model with config.json)")


def _model_config(path: str) -> dict[str, Any]:
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        return {}
    with open(config_file) as f:
        return json.load(f)


def _context_length(config: BackendConfig) -> int:
    model_len = _model_config(config.model_path).get("max_position_embeddings")
    return min(config.max_model_len, int(model_len)) if model_len else config.max_model_len


def _checkpoint_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor in the safetensors files under ``path`` (headers only)."""
    if not os.path.isdir(path):
        return {}
    from safetensors import safe_open

    shapes = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118  (safe_open is not a mapping)
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def _vocab_size(path: str) -> int:
    vocab = _model_config(path).get("vocab_size")
    return int(vocab) if vocab else 2**31 - 1


def _cpu_tp_slots() -> int:
    """TP ranks SGLang's CPU mode can place: its core groups if given, else NUMA nodes."""
    bind = os.environ.get("SGLANG_CPU_OMP_THREADS_BIND", "")
    if bind and bind != "all":
        return len(bind.split("|"))
    nodes = list(Path("/sys/devices/system/node").glob("node[0-9]*"))
    return max(1, len(nodes))
