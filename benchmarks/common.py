"""Shared timing helpers: interleaved repeats, medians, JSON lines, the matmul limit of this machine."""

import json
import os
import platform
import resource
import statistics
import time

import numpy as np
import tensorflow as tf


def peak_rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def interleaved(callables, repeats=5, warmup=1, self_timed=False):
    """{name: [seconds...]} running each callable in turn, `repeats` rounds after `warmup` rounds.

    With `self_timed`, each callable returns its own duration in seconds (e.g. one measured in a worker
    process, without the IPC around it) and that is recorded instead of the wall time of the call.
    """
    for _ in range(warmup):
        for fn in callables.values():
            fn()
    times = {name: [] for name in callables}
    for _ in range(repeats):
        for name, fn in callables.items():
            start = time.perf_counter()
            seconds = fn()
            times[name].append(seconds if self_timed else time.perf_counter() - start)
    return times


def median(values):
    return statistics.median(values)


def emit(record):
    record = {"host": platform.node(), "cpus": os.cpu_count(), **record}
    print(json.dumps(record), flush=True)
    return record


def matmul_limit(size=2048, dtype=tf.float32, repeats=5, jit_compile=False):
    """Achieved GFLOP/s of a `size`^3 matmul (2*n^3 FLOPs), median of `repeats`: the machine's limit."""
    a = tf.constant(np.random.default_rng(0).normal(size=(size, size)), dtype)
    fn = tf.function(lambda x: tf.matmul(x, x), jit_compile=jit_compile)
    fn(a).numpy()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(a).numpy()
        times.append(time.perf_counter() - start)
    return 2 * size**3 / median(times) / 1e9


def table(rows, columns):
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(str(row.get(c, "")) for c in columns) + " |")
    return "\n".join(lines)
