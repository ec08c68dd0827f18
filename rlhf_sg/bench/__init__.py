"""Benchmarks: ``python -m rlhf_sg.bench NAME``. Each prints a ratio against a baseline run in the same process."""

import os


def load_average() -> str:
    """The 1-minute load average as the benches print it: well above the number of cores, other work competed with
    the sides being timed."""
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:
        return "n/a"
