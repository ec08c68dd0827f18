"""Benchmarks: ``python -m rlhf_sg.bench NAME``. Each prints a ratio against a baseline run in the same process."""
