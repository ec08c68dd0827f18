"""DeepSpeed's CPU communication op, compiled ahead of the slow tests.

DeepSpeed compiles ``deepspeed_shm_comm`` (torch's JIT extension build, cached under ``TORCH_EXTENSIONS_DIR``) the
first time a process group starts on CPU: about 30 s on one core of CI's machine kind, paid by whichever slow test
comes first. The test session (``conftest.py``) and ``.ci/run`` compile it beside the fast tier, which keeps one
core busy and leaves the other idle, so the slow tests find it built. Once built, a run only loads it (~2 s).

    python tests/deepspeed_ops.py        # compile (or load) it in this process
"""

from __future__ import annotations

import os
import subprocess
import sys

BUILD = "from deepspeed.comm.torch import build_shm_op; build_shm_op()"


def start_build(log_path: str) -> subprocess.Popen:
    """Compile the op in a process of its own (output to ``log_path``); the caller waits for it."""
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    with open(log_path, "w") as log:
        return subprocess.Popen([sys.executable, "-c", BUILD], env=env, stdout=log, stderr=subprocess.STDOUT)


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    exec(BUILD)
