"""Shared timing helpers: interleaved repeats, medians, JSON lines, the matmul limit of this machine."""

import itertools
import json
import os
import platform
import random
import statistics
import time

import numpy as np
import tensorflow as tf

from benchmarks import SYSTEMS
from benchmarks.torch_worker import peak_rss_mb  # noqa: F401  (this process's own peak, VmHWM)
from tfformer import training
from tfformer.cpu import cpu_cores as cores  # the cores this process may run on


# On these VMs a core that has idled for a few tenths of a second runs the next tens of milliseconds of work
# slower (docs/performance.md, "Cold cores"). A call timed right after a mostly single-threaded system, or after
# a worker process's run, would pay that, and most of all a system that spreads short kernels over both cores
# (tfformer's batch-1 decoding). So `interleaved` keeps every core busy this long before each timed call: the
# same untimed TensorFlow work before every system.
WARM_SECONDS = 0.06


class BudgetWithFloor(training.TimeBudget):
    """`TimeBudget(seconds)` that never stops before `min_steps` batches."""

    def __init__(self, seconds, min_steps=0):
        super().__init__(seconds)
        self.min_steps = min_steps
        self.steps = 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        if self.steps >= self.min_steps:
            super().on_train_batch_end(batch, logs)


def set_tf_threads(intra, inter=None):
    """Give TensorFlow `intra` intra-op threads (and `inter` inter-op threads unless None); whether it runs with them.

    The counts take only before TensorFlow's runtime starts. After that this returns True when the runtime
    already has them (an intra-op count of 0, TensorFlow's default, counts as `cores()`), else False; the caller
    says what that means for its numbers.
    """
    try:
        tf.config.threading.set_intra_op_parallelism_threads(intra)
        if inter is not None:
            tf.config.threading.set_inter_op_parallelism_threads(inter)
        return True
    except RuntimeError:  # the runtime is up (e.g. a test ran another benchmark in this process)
        current = tf.config.threading.get_intra_op_parallelism_threads() or cores()
        return current == intra and (inter is None or tf.config.threading.get_inter_op_parallelism_threads() == inter)


def warm_cores(seconds=WARM_SECONDS):
    """Keep every core busy for `seconds`: 512^3 float32 matmuls on TensorFlow's intra-op threads."""
    if seconds <= 0:
        return
    if not _WARM:
        _WARM.append((tf.function(lambda x: tf.matmul(x, x)), tf.ones((512, 512))))
    fn, x = _WARM[0]
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        fn(x).numpy()


_WARM = []  # the traced matmul and its operand, made on first use


def interleaved(callables, repeats=5, warmup=1, self_timed=False, warm_seconds=WARM_SECONDS):
    """{name: [seconds...]} running each callable in turn, `repeats` rounds after `warmup` rounds.

    Each round runs the callables in its own order, shuffled with a fixed seed (warm-up rounds: in the given
    order): no system always runs right after the same other one (whose memory traffic or threads could slow
    what follows it), so such an effect spreads over all systems instead of biasing one pair's ratio in every
    round. (`paired_ratio` cancels drifts between rounds; this, effects of the order within a round.)
    Before each timed call, `warm_cores(warm_seconds)` (untimed): every call starts on busy cores.

    With `self_timed`, each callable returns its own duration in seconds (e.g. one measured in a worker
    process, without the IPC around it) and that is recorded instead of the wall time of the call.
    """
    for _ in range(warmup):
        for fn in callables.values():
            fn()
    names = list(callables)
    times = {name: [] for name in names}
    order = random.Random(0)
    for _ in range(repeats):
        for name in order.sample(names, len(names)):
            fn = callables[name]
            warm_cores(warm_seconds)
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
    seconds apart, so a drift of the machine's speed between rounds (large on these VMs; docs/performance.md,
    "Measuring on a shared VM") cancels in each round's ratio; the range over rounds says how far one run's
    ratio can be trusted.
    """
    if len(a) != len(b) or not a:
        raise ValueError(f"`a` and `b` need the same, non-zero number of rounds. Received: {len(a)} and {len(b)}")
    ratios = [y / x for x, y in zip(a, b)]
    return median(ratios), min(ratios), max(ratios)


def significant(x, digits=4):
    """`x` rounded to `digits` significant digits, for ratios in JSON lines: decimal places would not do, since
    a slow system's ratio can be as small as 0.0157, which 3 decimals would round to 0.016."""
    return float(f"{x:.{digits}g}")


def ratio_text(ratio):
    """`(median, min, max)` as "1.35 (1.30-1.41 over rounds)"."""
    mid, low, high = ratio
    return f"{mid:.2f} ({low:.2f}-{high:.2f} over rounds)"


def emit(record):
    record = {"host": platform.node(), "cpus": os.cpu_count(), "cores": cores(), **record}
    print(json.dumps(record), flush=True)
    return record


def goal(name, value, target, at_least=True, **details):
    """One of issue 8's goals as this run reads it: a JSON line `{"bench": "goal", "goal": name, "value": ...,
    "target": ..., "met": ...}` (`value >= target`, or `<=` with `at_least=False`); `details` say which rows it
    was read from."""
    met = value >= target if at_least else value <= target
    return emit({"bench": "goal", "goal": name, "value": significant(value), "target": target,
                 "at_least": at_least, "met": bool(met), **details})


def goal_text(record):
    """A `goal` record as one line: "goal: 1.34 (>= 1.25) met", then its `other_readings` if it has them."""
    sign = ">=" if record["at_least"] else "<="
    text = f"{record['goal']}: {record['value']:.2f} ({sign} {record['target']}) {'met' if record['met'] else 'MISSED'}"
    others = record.get("other_readings")
    return text + "; " + ", ".join(f"{k} {v:.2f}" for k, v in others.items()) if others else text


def print_goals(records, heading):
    """`heading`, then each `goal` record among `records` as a "- " line (`goal_text`)."""
    print(heading)
    for r in records:
        if r["bench"] == "goal":
            print(f"- {goal_text(r)}")


LIMIT_DTYPES = ("float32", "bfloat16")


def limit_size(smoke):
    """The matmul limits' size: 2048^3, or 256^3 in a smoke run."""
    return 256 if smoke else 2048


def matmul_limit_calls(size=2048, calls=3):
    """`{"matmul limit float32": fn, "matmul limit bfloat16": fn}` to time among a benchmark's systems in
    `interleaved`: each runs `calls` `size`^3 matmuls (2 * size^3 FLOPs each) on the process's threads, so the
    machine's limit is measured in the same rounds, i.e. the same minutes, as the systems it is compared with
    (these VMs' speed drifts between minutes). `matmul_limits` turns their times into GFLOP/s."""
    fns = {}
    for dtype in LIMIT_DTYPES:
        a = tf.constant(np.random.default_rng(0).normal(size=(size, size)), dtype)
        fn = tf.function(lambda x: tf.matmul(x, x))
        fn(a).numpy()  # trace
        fns[f"matmul limit {dtype}"] = timed(lambda fn=fn, a=a: [fn(a).numpy() for _ in range(calls)])
    return fns


def matmul_limits(times, size=2048, calls=3):
    """`{dtype: GFLOP/s}` from the median time of `matmul_limit_calls`' callables; removes them from `times`."""
    return {dtype: calls * 2 * size**3 / median(times.pop(f"matmul limit {dtype}")) / 1e9 for dtype in LIMIT_DTYPES}


def matmul_limits_now(size=2048, repeats=5):
    """`{dtype: GFLOP/s}` of `matmul_limit_calls`, measured now: `repeats` interleaved rounds after a warm-up."""
    return matmul_limits(interleaved(matmul_limit_calls(size), repeats=repeats, self_timed=True), size)


def with_matmul_limits(run, size=2048):
    """`run()`'s row (a dict) with `matmul_limit_gflops`: `{dtype: [before, after]}`, the limits measured right
    before and right after it. For the benchmarks whose systems train one after another for a wall-clock budget
    each: a drift of the machine's speed between systems, which changes what a budget buys, shows there."""
    before = matmul_limits_now(size)
    row = run()
    after = matmul_limits_now(size)
    return dict(row, matmul_limit_gflops={dtype: [round(before[dtype], 1), round(after[dtype], 1)]
                                          for dtype in LIMIT_DTYPES})


def add_systems_option(parser):
    """`--systems` (`benchmarks.SYSTEMS`) on the parser of a workload with PyTorch rows; `check_systems` after
    parsing."""
    parser.add_argument("--systems", choices=SYSTEMS, default="all",
                        help="peers: time only the PyTorch rows and the rows they are read against, no goals "
                             "(smoke runs only: the runner's smoke test with stand-in peers); default: all")


def check_systems(parser, args):
    """A usage error naming `--systems` when it narrows a run that is not a smoke run (`args.smoke`)."""
    if args.systems != "all" and not args.smoke:
        parser.error(f"argument --systems: {args.systems!r} needs --smoke (its rows alone are no benchmark)")


def table(rows, columns):
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(str(row.get(c, "")) for c in columns) + " |")
    return "\n".join(lines)
