"""benchmarks.common: per-round ratios cancel a drift of machine speed between rounds; each round shuffles its
order; matmul limits are timed among the systems; peak memory is the process's own."""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from benchmarks import common

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_paired_ratio_cancels_drift_between_rounds():
    # The machine slows down 2x per round; within each round `a` takes 1/3 of `b`'s time.
    a = [1.0, 2.0, 4.0, 8.0, 16.0]
    b = [3.0, 6.0, 12.0, 24.0, 48.0]
    assert common.paired_ratio(a, b) == (3.0, 3.0, 3.0)


def test_paired_ratio_reports_the_spread():
    median, low, high = common.paired_ratio([1.0, 1.0, 1.0], [1.2, 1.5, 0.9])
    assert (median, low, high) == pytest.approx((1.2, 0.9, 1.5))
    assert common.ratio_text((median, low, high)) == "1.20 (0.90-1.50 over rounds)"


def test_paired_ratio_needs_paired_rounds():
    with pytest.raises(ValueError, match="same, non-zero number of rounds"):
        common.paired_ratio([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="same, non-zero number of rounds"):
        common.paired_ratio([], [])


def test_interleaved_shuffles_the_order_of_each_round():
    names = [f"system {i}" for i in range(8)]
    calls = []
    callables = {name: (lambda name=name: calls.append(name) or 0.5) for name in names}
    times = common.interleaved(callables, repeats=10, warmup=1, self_timed=True, warm_seconds=0)
    assert calls[:8] == names  # warm-up in the given order
    rounds = [calls[8 + 8 * r: 16 + 8 * r] for r in range(10)]
    assert all(sorted(r) == sorted(names) for r in rounds)  # every system once per round
    assert len({tuple(r) for r in rounds}) == 10  # each round its own order
    # No system always follows the same other one (a fixed or rotated order would: a rotation keeps each
    # system's predecessor within the round).
    for name in names:
        predecessors = {r[r.index(name) - 1] for r in rounds if r.index(name) > 0}
        assert len(predecessors) >= 3, (name, predecessors)
    assert times == {name: [0.5] * 10 for name in names}  # each callable's own rounds, in the callables' order
    # The same seed each call: two runs of a benchmark order their rounds alike.
    again = []
    common.interleaved({name: (lambda name=name: again.append(name) or 0.5) for name in names}, repeats=10,
                       warmup=1, self_timed=True, warm_seconds=0)
    assert again == calls


def test_interleaved_warms_the_cores_before_each_timed_call(monkeypatch):
    events = []
    monkeypatch.setattr(common, "warm_cores", lambda seconds: events.append(("warm", seconds)))
    callables = {name: (lambda name=name: events.append(name) or 0.5) for name in ("a", "b")}
    times = common.interleaved(callables, repeats=3, warmup=1, self_timed=True, warm_seconds=0.02)
    assert events[:2] == ["a", "b"]  # warm-up round: nothing timed, no warming
    timed = events[2:]
    assert len(timed) == 12 and timed[0::2] == [("warm", 0.02)] * 6 and sorted(timed[1::2]) == ["a"] * 3 + ["b"] * 3
    assert times == {"a": [0.5] * 3, "b": [0.5] * 3}
    # The default is `WARM_SECONDS`.
    events.clear()
    common.interleaved({"a": callables["a"]}, repeats=1, warmup=0, self_timed=True)
    assert events == [("warm", common.WARM_SECONDS), "a"]


def test_warm_cores_keeps_every_core_busy():
    # Threads that ran during the call, from each thread's own CPU time (robust to other processes on the
    # cores, e.g. pytest-xdist's other worker: a busy thread still gets a share of a core).
    def cpu_seconds_per_thread():
        ticks = os.sysconf("SC_CLK_TCK")
        seconds = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except FileNotFoundError:  # a thread that ended meanwhile
                continue
            seconds[tid] = (int(fields[11]) + int(fields[12])) / ticks  # utime + stime
        return seconds

    common.warm_cores(0.01)  # traces the matmul
    before, start = cpu_seconds_per_thread(), time.perf_counter()
    common.warm_cores(0.4)
    wall = time.perf_counter() - start
    after = cpu_seconds_per_thread()
    assert 0.4 <= wall < 0.8
    # Busy: at least half the CPU time of the busiest thread, which had to run: relative, since on cores shared
    # with other processes (another worker, another suite) every thread gets a smaller share of the 0.4 s.
    used = {tid: seconds - before.get(tid, 0.0) for tid, seconds in after.items()}
    busy = [tid for tid, seconds in used.items() if seconds >= 0.5 * max(used.values())]
    assert max(used.values()) >= 0.05 and len(busy) >= min(common.cores(), 2), used
    start = time.perf_counter()
    common.warm_cores(0)  # nothing
    assert time.perf_counter() - start < 0.01


def test_matmul_limits_come_from_the_interleaved_calls():
    fns = common.matmul_limit_calls(size=64, calls=2)
    assert set(fns) == {"matmul limit float32", "matmul limit bfloat16"}
    times = common.interleaved({"system": lambda: 1.0, **fns}, repeats=3, self_timed=True)
    expected = {dtype: 2 * 2 * 64**3 / common.median(times[f"matmul limit {dtype}"]) / 1e9
                for dtype in ("float32", "bfloat16")}
    assert common.matmul_limits(times, size=64, calls=2) == pytest.approx(expected)
    assert set(times) == {"system"}  # the limits' times are taken out, the systems' left


def test_peak_rss_is_the_process_own_not_its_parent():
    # `ru_maxrss` survives fork + exec: a small child of a large process would report the parent's peak.
    ballast = np.ones(3 * 2**30 // 8)  # 3 GB, touched
    code = "from benchmarks import common; print(common.peak_rss_mb())"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    child = float(subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env,
                                 check=True).stdout)
    assert ballast.sum() == ballast.size and common.peak_rss_mb() > 3 * 1024
    assert 1 < child < 2 * 1024, child  # an interpreter that imported TensorFlow: ~0.6 GB


def test_set_tf_threads_sets_them_in_a_fresh_process_and_reports_a_runtime_that_has_others():
    code = """if True:
        import json
        import tensorflow as tf
        from benchmarks import common
        fresh = common.set_tf_threads(1, inter=1)
        tf.constant(1.0) + 1  # the runtime starts with those counts
        print(json.dumps({"fresh": fresh,
                          "counts": [tf.config.threading.get_intra_op_parallelism_threads(),
                                     tf.config.threading.get_inter_op_parallelism_threads()],
                          "same": common.set_tf_threads(1, inter=1), "same_intra": common.set_tf_threads(1),
                          "other_intra": common.set_tf_threads(2), "other_inter": common.set_tf_threads(1, inter=2)}))
    """
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"fresh": True, "counts": [1, 1], "same": True, "same_intra": True, "other_intra": False,
                      "other_inter": False}


def test_set_tf_threads_takes_the_default_count_as_the_cores():
    import tensorflow as tf

    tf.constant(1.0) + 1  # this process's runtime is up
    current = tf.config.threading.get_intra_op_parallelism_threads()
    assert common.set_tf_threads(current or common.cores())
    assert not common.set_tf_threads((current or common.cores()) + 1)


def test_goal_says_whether_the_value_meets_its_target(capsys):
    met = common.goal("training lm float32 >= 1.25x keras-hub float32", 1.2503, 1.25, rows=["a", "b"])
    missed = common.goal("per-token time at 500 <= 1.5x at 50", 1.5212, 1.5, at_least=False)
    edge = common.goal("per-token time at 500 <= 1.5x at 50", 1.5, 1.5, at_least=False)
    assert (met["met"], missed["met"], edge["met"]) == (True, False, True)
    assert met["bench"] == "goal" and met["rows"] == ["a", "b"] and missed["value"] == 1.521
    assert common.goal_text(met) == "training lm float32 >= 1.25x keras-hub float32: 1.25 (>= 1.25) met"
    assert common.goal_text(missed) == "per-token time at 500 <= 1.5x at 50: 1.52 (<= 1.5) MISSED"
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["met"] for r in lines] == [True, False, True]
    # Other readings follow the goal's own; `print_goals` prints the goal records among others under a heading.
    other = common.goal("training lm bfloat16 >= 2x keras-hub float32", 2.104, 2,
                        other_readings={"strict": 1.891, "+cpu_threads": 2.0})
    assert common.goal_text(other) == ("training lm bfloat16 >= 2x keras-hub float32: 2.10 (>= 2) met; "
                                       "strict 1.89, +cpu_threads 2.00")
    capsys.readouterr()
    common.print_goals([{"bench": "train_lm"}, met, other], "Goals:")
    printed = capsys.readouterr().out.splitlines()
    assert printed == ["Goals:", f"- {common.goal_text(met)}", f"- {common.goal_text(other)}"]
