"""A CPU rank keeps its freed memory (rlhf_sg.kernels.host_memory): a step's activations are not faulted in again."""

import json
import os
import subprocess
import sys

import pytest

from rlhf_sg.kernels import host_memory

TESTS = os.path.dirname(os.path.abspath(__file__))


def _faults_in_a_new_process(retain: bool, **env) -> dict:
    """A new interpreter: :func:`retain_freed_memory` called or not, then :func:`zero3_rank.activation_faults`."""
    script = (
        "import json, sys\n"
        f"sys.path.insert(0, {TESTS!r})\n"
        "from rlhf_sg.kernels.host_memory import retain_freed_memory\n"
        f"took = retain_freed_memory() if {retain} else None\n"
        "from zero3_rank import activation_faults\n"
        "faults, pages = activation_faults()\n"
        "print(json.dumps({'took': took, 'faults': faults, 'pages': pages}))\n")
    environ = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "GLIBC_TUNABLES")}
    done = subprocess.run([sys.executable, "-c", script], env={**environ, "OMP_NUM_THREADS": "1", **env},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_retained_memory_is_not_faulted_in_again_at_each_step():
    """With glibc's defaults a step's activations are faulted in again at every step (freed memory goes back to the
    kernel); after retain_freed_memory, not one page."""
    default = _faults_in_a_new_process(False)
    retained = _faults_in_a_new_process(True)
    assert default["faults"] > 0.5 * default["pages"]
    assert retained["took"] is True
    assert retained["faults"] < 0.01 * retained["pages"]


def test_the_users_malloc_tunables_are_left_as_they_are():
    """A glibc.malloc tunable the user set stands: here one that trims every free, so every step faults again."""
    mine = _faults_in_a_new_process(True, GLIBC_TUNABLES="glibc.malloc.trim_threshold=0")
    assert mine["took"] is False
    assert mine["faults"] > 0.5 * mine["pages"]


@pytest.mark.parametrize("env, chosen", [
    ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, "LD_PRELOAD"),
    ({"LD_PRELOAD": "libtcmalloc_minimal.so.4"}, "LD_PRELOAD"),
    ({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}, "GLIBC_TUNABLES"),
    ({"GLIBC_TUNABLES": "glibc.rtld.optional_static_tls=4096"}, None),
    ({"LD_PRELOAD": "libfoo.so"}, None),
])
def test_a_preloaded_caching_allocator_or_malloc_tunable_is_the_users_choice(monkeypatch, env, chosen):
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    found = host_memory.users_allocator()
    assert (found.split("=")[0] if found else None) == chosen
