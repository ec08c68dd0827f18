"""Tensors handed between processes of one machine without copying: the tensor transport's payloads.

A payload is the bytes of ``multiprocessing.reduction.ForkingPickler`` (the serializer torch and
SGLang use for this) over an object holding tensors, made by the process that owns their memory:

* a CPU tensor travels as the name of its shared-memory segment. Torch's default sharing strategy,
  ``"file_descriptor"``, would pass a descriptor through a socket authenticated with the sender's
  ``multiprocessing`` authkey; unrelated processes (Ray actors, SGLang's schedulers) have different
  keys and the receiver fails with ``AuthenticationError``. :func:`share` therefore pickles under the
  ``"file_system"`` strategy, whose segment names any process of the machine can open;
* a CUDA tensor travels as a CUDA IPC handle, its device named by UUID rather than by index (the
  receiver may see the GPUs under other indices). SGLang's receivers map the UUID back
  (``sglang.srt.utils.patch_torch``); :func:`open_shared` does the same for ours, onto whichever
  local GPU has that UUID, or, given ``device``, onto that device only.

The sender keeps the tensor alive and unchanged until the receiver has finished with it. Torch counts
references per payload (the sender adds one each time it pickles, each opening removes one), so a
payload is opened once: a tensor for several receivers is shared once per receiver.

This module is also the home of a device's cross-process identity (:func:`device_identity`: the GPU's
UUID, or the host and its boot on CPU) and of :class:`SharedBucket`, a flat bucket's payloads with the
sender's identity, which a receiver opens with :func:`open_shared_bucket` only on that same device.
"""

from __future__ import annotations

import contextlib
import copyreg
import functools
import io
import pickle
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing as torch_mp

__all__ = [
    "SharedBucket",
    "check_same_device",
    "cpu_sharing",
    "device_description",
    "device_identity",
    "open_shared",
    "open_shared_bucket",
    "share",
    "share_bucket",
    "shared_cpu_buffer",
]

_STRATEGY_LOCK = threading.Lock()
_DEVICE_ARG = 6  # position of the device index in reduce_tensor's arguments for a CUDA tensor


@contextlib.contextmanager
def cpu_sharing() -> Iterator[None]:
    """Inside the block CPU storages are shared by segment name (torch's ``"file_system"`` strategy)."""
    with _STRATEGY_LOCK:
        old = torch_mp.get_sharing_strategy()
        torch_mp.set_sharing_strategy("file_system")
        try:
            yield
        finally:
            torch_mp.set_sharing_strategy(old)


def shared_cpu_buffer(nbytes: int) -> torch.Tensor:
    """[nbytes] uint8 in shared memory that :func:`share` hands over without a copy."""
    with cpu_sharing():
        return torch.empty(nbytes, dtype=torch.uint8).share_memory_()


def _reduce_tensor_by_uuid(tensor: torch.Tensor):
    from torch.multiprocessing.reductions import reduce_tensor

    rebuild, args = reduce_tensor(tensor)
    if tensor.is_cuda:
        uuid = str(torch.cuda.get_device_properties(args[_DEVICE_ARG]).uuid)
        args = (*args[:_DEVICE_ARG], uuid, *args[_DEVICE_ARG + 1 :])
    return rebuild, args


class _Pickler(ForkingPickler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        import torch.multiprocessing.reductions  # noqa: F401  (registers torch's reducers)

        table = copyreg.dispatch_table.copy()
        table.update(ForkingPickler._extra_reducers)
        table[torch.Tensor] = _reduce_tensor_by_uuid
        table[torch.nn.Parameter] = _reduce_tensor_by_uuid
        self.dispatch_table = table


def share(obj: Any, children_only: bool = False) -> bytes:
    """The payload of ``obj`` (tensors, lists, dicts, ...), to be opened in another process.

    Call it in the process that owns the tensors' memory. CUDA tensors must be ready (their stream
    synchronised); CPU tensors not yet in shared memory are moved there (a copy: allocate with
    :func:`shared_cpu_buffer` to avoid it).

    ``children_only=True``: the receivers are ``multiprocessing`` children of this process (an engine
    hosted in this process, whose workers share its authkey), so CPU memory goes by descriptor, torch's
    default. Sharing by name needs this process's ``torch_shm_manager``, a child process that an engine
    host may lose (SGLang's own ``Engine.shutdown`` kills every child of its host), after which no CPU tensor
    of this process can be shared by name again.
    """
    buf = io.BytesIO()
    with contextlib.nullcontext() if children_only else cpu_sharing():
        _Pickler(buf).dump(obj)
    return buf.getvalue()


def _rebuild_cuda_tensor_by_uuid(*args, target: torch.device | None = None):
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    device = args[_DEVICE_ARG]
    if isinstance(device, str):
        if target is not None:
            if target.type != "cuda":
                raise RuntimeError(f"tensor hand-off: the payload holds a tensor on GPU {device}, not on {target}")
            index = torch.cuda.current_device() if target.index is None else target.index
            if str(torch.cuda.get_device_properties(index).uuid) != device:
                check_same_device(f"GPU-{device}", f"GPU-{device}", device_identity(target), device_description(target))
            local = [index]
        else:
            count = torch.cuda.device_count()
            local = [i for i in range(count) if str(torch.cuda.get_device_properties(i).uuid) == device]
        if not local:
            raise RuntimeError(
                f"tensor hand-off: the sender's GPU {device} is not visible in this process (CUDA_VISIBLE_DEVICES="
                "?); the tensor transport needs the engine on the trainer rank's GPU: colocate them or use "
                "transport='collective'"
            )
        args = (*args[:_DEVICE_ARG], local[0], *args[_DEVICE_ARG + 1 :])
    return rebuild_cuda_tensor(*args)


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, target: torch.device | None):
        super().__init__(file)
        self._target = target

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
            return functools.partial(_rebuild_cuda_tensor_by_uuid, target=self._target)
        return super().find_class(module, name)


def open_shared(payload: bytes, device: torch.device | None = None) -> Any:
    """The object :func:`share` made ``payload`` of, its tensors mapped from the sender's memory.

    A CUDA tensor opens on the local GPU whose UUID the payload names; with ``device`` (a CUDA
    device of this process) it opens there or not at all, refused with both devices named when
    ``device`` is another physical GPU.
    """
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise TypeError(f"open_shared: expected the bytes share() made, got {type(payload).__name__}")
    target = None if device is None else torch.device(device)
    return _Unpickler(io.BytesIO(bytes(payload)), target).load()


# ---- device identity -------------------------------------------------------------------------
def device_identity(device: torch.device) -> str:
    """What names ``device`` across processes: the GPU's UUID, or for the CPU the host and its boot.

    Two processes see the same physical GPU exactly when their UUIDs agree, whatever each
    process's ``CUDA_VISIBLE_DEVICES`` numbers it; two CPU processes share ``/dev/shm`` only on
    the same host (hostname and kernel boot id).
    """
    device = torch.device(device)
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        return f"GPU-{torch.cuda.get_device_properties(index).uuid}"
    if device.type == "cpu":
        return _host_identity()
    raise ValueError(f"device_identity: no cross-process identity for device type {device.type!r}")


@functools.lru_cache(maxsize=1)
def _host_identity() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown"
    return f"host {socket.gethostname()} boot {boot}"


def device_description(device: torch.device) -> str:
    """``cuda:0 (NVIDIA H100 80GB HBM3, GPU-…)`` or ``cpu (host …)``: a device as messages name it."""
    device = torch.device(device)
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        return f"cuda:{index} ({torch.cuda.get_device_name(index)}, {device_identity(device)})"
    return f"cpu ({device_identity(device)})"


def check_same_device(sender_id: str, sender_name: str, receiver_id: str, receiver_name: str) -> None:
    """Raise when a bucket shared on device ``sender_id`` is to be opened on device ``receiver_id``.

    CUDA IPC memory belongs to one physical GPU: opened on another it is either refused by the
    driver or, worse, read through peer access from the wrong device. Shared memory on the CPU
    exists only on the sender's host.
    """
    if sender_id == receiver_id:
        return
    raise RuntimeError(
        f"the tensor bucket was shared on {sender_name} but this worker runs on {receiver_name}: the tensor "
        "transport hands memory over by reference and needs the sender and every engine worker on the same "
        "physical device (same GPU UUID; same host on CPU). Colocate the engine with the trainer rank that "
        "serves it (one engine worker per trainer GPU), or use the collective transport"
    )


# ---- a flat bucket with its sender's identity --------------------------------------------------
@dataclass(frozen=True)
class SharedBucket:
    """A flat bucket handed over by reference, with the identity of the device it lives on.

    Plain data (picklable by Ray, by vLLM's RPC, by anything), made by :func:`share_bucket` in the
    process that owns the bucket and passed untouched to each receiver, which opens it itself with
    :func:`open_shared_bucket`. ``payloads`` holds one :func:`share` payload of the bucket per
    receiver (receiver ``i`` opens ``payloads[i]``); the rest describes the bucket for checks and
    messages. ``device_id`` is the sender's :func:`device_identity`: a receiver whose own device has
    another identity refuses the bucket (:func:`check_same_device`).
    """

    device_type: str  # "cpu" | "cuda"
    device_id: str
    device_name: str  # for messages
    dtype: str
    numel: int
    payloads: tuple[bytes, ...]


def share_bucket(flat: torch.Tensor, num_receivers: int = 1) -> SharedBucket:
    """Sender side: a :class:`SharedBucket` of the 1-D tensor ``flat`` for ``num_receivers`` receivers.

    ``flat`` stays alive and unchanged until every receiver has finished with it. On CUDA the device
    is synchronised first, so every write into ``flat`` (on any stream) is done before a receiver can
    read it. On CPU the first call moves the bucket's storage into shared memory (one copy; the
    buffer's other views follow it), later calls on the same buffer are free.
    """
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(f"share_bucket: flat must be a contiguous 1-D tensor, got shape {tuple(flat.shape)}")
    if flat.device.type not in ("cpu", "cuda"):
        raise ValueError(f"share_bucket: cannot share a tensor on {flat.device}; use a CPU or CUDA buffer")
    if num_receivers < 1:
        raise ValueError(f"share_bucket: num_receivers must be >= 1, got {num_receivers}")
    if flat.is_cuda:
        torch.cuda.synchronize(flat.device)
    return SharedBucket(
        device_type=flat.device.type,
        device_id=device_identity(flat.device),
        device_name=device_description(flat.device),
        dtype=str(flat.dtype).removeprefix("torch."),
        numel=int(flat.numel()),
        payloads=tuple(share(flat) for _ in range(num_receivers)),
    )


def open_shared_bucket(bucket: SharedBucket, device: torch.device, receiver: int = 0) -> torch.Tensor:
    """Receiver side: the sender's memory as a 1-D tensor on ``device``, after the device check.

    ``receiver`` picks this receiver's payload. The result aliases the sender's buffer: copy out of
    it, wait for the copy, and drop it before the sender may reuse the buffer.
    """
    device = torch.device(device)
    if bucket.device_type != device.type:
        raise RuntimeError(
            f"the tensor bucket was shared on {bucket.device_name} but this worker runs on "
            f"{device_description(device)}: sender and engine must use the same kind of device"
        )
    check_same_device(bucket.device_id, bucket.device_name, device_identity(device), device_description(device))
    if not 0 <= receiver < len(bucket.payloads):
        raise RuntimeError(
            f"the tensor bucket was packed for {len(bucket.payloads)} receiver(s) but receiver {receiver} opens "
            "it: pack it with one payload per tensor-parallel rank of the engine"
        )
    flat = open_shared(bucket.payloads[receiver], device if device.type == "cuda" else None)
    dtype = getattr(torch, bucket.dtype)
    if not isinstance(flat, torch.Tensor) or flat.dtype != dtype or tuple(flat.shape) != (bucket.numel,):
        got = f"{tuple(flat.shape)} {flat.dtype}" if isinstance(flat, torch.Tensor) else type(flat).__name__
        raise RuntimeError(f"the shared bucket opened as {got}, its sender announced [{bucket.numel}] {dtype}")
    return flat
