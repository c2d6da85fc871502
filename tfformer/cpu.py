"""The CPU this process runs on. Imports nothing from tfformer, so every package may use it."""

import os


def cpu_cores():
    """The cores this process may run on, TensorFlow's default intra-op thread count: its CPU affinity, which a
    container or `taskset` can restrict (`os.cpu_count()` counts the host's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
