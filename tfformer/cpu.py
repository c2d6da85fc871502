"""The CPU and memory of this process. Imports nothing from tfformer, so every package may use it."""

import ctypes
import gc
import os


def cpu_cores():
    """The cores this process may run on, TensorFlow's default intra-op thread count: its CPU affinity, which a
    container or `taskset` can restrict (`os.cpu_count()` counts the host's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def release_freed_memory():
    """Return the heap memory this process has freed to the operating system: glibc keeps freed blocks for reuse,
    still resident, so a finished phase (TensorFlow's converter: 0.4 GB after a SmolLM2-135M conversion, AMD EPYC
    Zen 4) would add to the peak of the phases after it. `malloc_trim` where glibc is the C library; elsewhere
    nothing. Python's reference cycles are collected first."""
    gc.collect()
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)
