"""DeepSpeed's CPU communication op, compiled ahead of the slow tests.

DeepSpeed compiles ``deepspeed_shm_comm`` (torch's JIT extension build, cached under ``TORCH_EXTENSIONS_DIR``) the
first time a process group starts on CPU: about 30 s on one core of CI's machine kind, paid by whichever slow test
comes first. The test session (``conftest.py``) and ``.ci/run`` compile it beside the fast tier, which keeps one
core busy and leaves the other idle, so the slow tests find it built. Once built, a run only loads it (~2 s).

Torch holds ``<build dir>/lock`` while it compiles and removes it in a ``finally``; a build killed outright skips
that, and every later build of the op then waits on the file forever. So the build here unwinds on SIGTERM as on
Ctrl-C (the ``finally`` runs and removes the lock), runs in a session of its own (a signal to the test session's
process group, a CI time-out's kill, does not reach it: it finishes by itself), and is ended with SIGTERM, never
SIGKILL (:func:`finish_build`).

    python tests/deepspeed_ops.py        # compile (or load) it in this process
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

#: built in the directory the workers load it from (one per Python environment: rlhf_sg.distributed)
BUILD = ("from rlhf_sg.distributed import pin_torch_extensions_dir; pin_torch_extensions_dir()\n"
         "from deepspeed.comm.torch import build_shm_op; build_shm_op()")
#: run first in the build's process: SIGTERM raises KeyboardInterrupt, so torch's ``finally`` removes its lock
UNWIND_ON_SIGTERM = "import signal; signal.signal(signal.SIGTERM, signal.default_int_handler)\n"


def start_build(log_path: str, code: str = BUILD, env: dict | None = None) -> subprocess.Popen:
    """Compile the op (or run another extension build, ``code``) in a process of its own, in a session of its own,
    output to ``log_path``; the caller ends it with :func:`finish_build`."""
    env = dict(os.environ if env is None else env, DS_ACCELERATOR="cpu")
    with open(log_path, "w") as log:
        return subprocess.Popen([sys.executable, "-c", UNWIND_ON_SIGTERM + code], env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)


def finish_build(process: subprocess.Popen, timeout_s: float, stop_s: float = 30.0) -> int | str:
    """Wait up to ``timeout_s`` for the build; past that, stop it with SIGTERM (the build unwinds, removing torch's
    lock; ninja and its compilers, each in a process group of its own, get it too, so none is left compiling) and
    wait up to ``stop_s`` more. Returns its exit status, or why there is none; a build that outlives both is left
    to finish by itself, never killed (a kill would leave the lock)."""
    import psutil  # DeepSpeed's dependency

    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        root = psutil.Process(process.pid)
        build = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:  # it ended meanwhile
        build = []
    for member in build:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=stop_s)
    except subprocess.TimeoutExpired:
        return f"still running after {timeout_s + stop_s:.0f} s; left to finish by itself (pid {process.pid})"
    psutil.wait_procs(build[1:], timeout=stop_s)
    return f"stopped after {timeout_s:.0f} s"

if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    exec(UNWIND_ON_SIGTERM + BUILD)
