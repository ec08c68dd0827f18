"""A CPU rank keeps the memory it frees (glibc malloc), so a training step does not page its activations in again.

A training step allocates and frees the same activations every micro-batch: on the e2e bench's model a gated MLP's
``[tokens, intermediate]`` outputs are 13.5 MiB each. glibc serves such a request with its own ``mmap`` (above
its mmap threshold) or from the top of its heap, and hands the memory back to the kernel when it is freed (``munmap``;
the heap trimmed past its trim threshold). The next micro-batch then faults every 4 KiB page in again, zeroed by
the kernel: on the e2e bench's actor rank 40,000 to 200,000 minor faults and 0.1 to 0.4 CPU-seconds of system time a
training step.

:func:`retain_freed_memory` raises both thresholds (``mallopt``), as PyTorch's CPU tuning guide has a caching
allocator (jemalloc, tcmalloc) do: requests up to glibc's mmap ceiling (32 MiB on 64-bit) come from the heap, and
freed memory stays with the process up to ``trim_threshold`` bytes, so the process keeps about its peak resident
memory between steps (which the next step needs again). Larger requests still map their own pages. A process
whose allocator the user chose (``LD_PRELOAD`` of jemalloc or tcmalloc, a ``glibc.malloc`` tunable in
``GLIBC_TUNABLES``) is left as it is. GPU ranks allocate their tensors in CUDA's caching allocator; the workers
call this on CPU ranks only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

logger = logging.getLogger(__name__)

#: mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: the largest mmap threshold glibc takes on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX: 4 MiB x sizeof(long))
MMAP_THRESHOLD_MAX = 32 << 20
#: freed heap memory a process keeps before glibc trims it
DEFAULT_TRIM_THRESHOLD = 1 << 30


def users_allocator() -> str | None:
    """What the user set for this process's allocator, if anything: a preloaded jemalloc or tcmalloc, or a
    ``glibc.malloc`` tunable."""
    preload = os.environ.get("LD_PRELOAD", "")
    for name in ("jemalloc", "tcmalloc"):
        if name in preload:
            return f"LD_PRELOAD={preload}"
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc." in tunables:
        return f"GLIBC_TUNABLES={tunables}"
    return None


def retain_freed_memory(trim_threshold: int = DEFAULT_TRIM_THRESHOLD) -> bool:
    """Raise glibc's mmap threshold to its ceiling and its trim threshold to ``trim_threshold`` bytes in this
    process. Returns whether both took; False (with the reason logged) where the user chose the allocator or the
    C library is not glibc."""
    chosen = users_allocator()
    if chosen:
        logger.info("host memory: the allocator is the user's (%s); malloc thresholds left as they are", chosen)
        return False
    path = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(path)
        mallopt = libc.mallopt
        gnu = libc.gnu_get_libc_version
    except (OSError, AttributeError, TypeError):
        logger.info("host memory: %s is not glibc; malloc thresholds left as they are", path)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    gnu.restype = ctypes.c_char_p
    took = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1 and mallopt(M_TRIM_THRESHOLD, trim_threshold) == 1
    if not took:
        logger.warning("host memory: glibc %s refused mallopt; freed memory goes back to the kernel as before",
                       gnu().decode())
    return took
