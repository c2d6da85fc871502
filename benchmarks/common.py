"""Shared timing helpers: interleaved repeats, medians, JSON lines, the matmul limit of this machine."""

import itertools
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


def timed(fn):
    """`fn` as a callable that returns its own wall time in seconds (for `interleaved(..., self_timed=True)`)."""

    def call():
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    return call


def rounds(fn):
    """`fn(i)` as a callable of no arguments whose `i`-th call passes `i`: a new input each round of `interleaved`."""
    count = itertools.count()
    return lambda: fn(next(count))


def median(values):
    return statistics.median(values)


def paired_ratio(a, b):
    """`(median, min, max)` over rounds of `b[i] / a[i]`: for seconds, how many times faster `a` ran than `b`.

    `a` and `b` are the seconds of two callables from the same `interleaved` run. Both ran in the same round,
    seconds apart, so a drift of the machine's speed between rounds (up to ~2x on these VMs) cancels in
    each round's ratio; the range over rounds says how far one run's ratio can be trusted.
    """
    if len(a) != len(b) or not a:
        raise ValueError(f"`a` and `b` need the same, non-zero number of rounds. Received: {len(a)} and {len(b)}")
    ratios = [y / x for x, y in zip(a, b)]
    return median(ratios), min(ratios), max(ratios)


def significant(x, digits=4):
    """`x` rounded to `digits` significant digits, for ratios in JSON lines: decimal places would not do, since
    a slow system's ratio can be 0.0157 (3 decimals: 0.016, 2% off)."""
    return float(f"{x:.{digits}g}")


def ratio_text(ratio):
    """`(median, min, max)` as "1.35 (1.30-1.41 over rounds)"."""
    mid, low, high = ratio
    return f"{mid:.2f} ({low:.2f}-{high:.2f} over rounds)"


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
