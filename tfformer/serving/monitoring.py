"""The server's metrics, served as TF Serving's Prometheus exporter serves them (`--monitoring_config_file`).

    prometheus_config { enable: true, path: "/monitoring/prometheus/metrics" }

`Metrics` holds one server's histograms, counters and gauges (no module state: two servers in one process
keep their own). `render()` writes them as `tensorflow_serving/util/prometheus_exporter.cc` does: a
`# TYPE` line per metric, the metric name with every character outside `[a-zA-Z0-9_]` turned into `:`
(`/tensorflow/serving/batching_session/queuing_latency` is `:tensorflow:serving:batching_session:queuing_latency`),
cumulative `_bucket{le="..."}` lines ending in `le="+Inf"`, then `_sum` and `_count`.

The batching metrics are TF Serving's (batching_session.cc, batching_util.h), with its bucket limits: input
and processed batch sizes and padding (1, 2, 4, ..., 8192), queuing latency in microseconds (100 * 1.2^i,
52 buckets, about 1 s), the count of batched model calls. tfformer adds the queue depth of each batching
queue (`/tfformer/serving/batching/enqueued_tasks`, a gauge) and the tasks a full queue turned away
(`/tfformer/serving/batching/rejected_tasks`).

`Metrics.summary()` is the same figures as one log line (what happened since the previous summary), which
the batch threads log every `log_every_seconds` while they work.
"""

import bisect
import re
import threading
import time

import numpy as np

PROMETHEUS_PATH = "/monitoring/prometheus/metrics"  # PrometheusExporter::kPrometheusPath


def exponential_buckets(scale, growth, count):
    """`monitoring::Buckets::Exponential(scale, growth, count)`'s finite limits: scale * growth^i, i < count."""
    return tuple(scale * growth**i for i in range(count))


SIZE_BUCKETS = exponential_buckets(1, 2, 14)
LATENCY_BUCKETS = exponential_buckets(100, 1.2, 52)

INPUT_BATCH_SIZE = "/tensorflow/serving/batching_session/input_batch_size"
PROCESSED_BATCH_SIZE = "/tensorflow/serving/batching_session/processed_batch_size"
PADDING_SIZE = "/tensorflow/serving/batching_session/padding_size"
QUEUING_LATENCY = "/tensorflow/serving/batching_session/queuing_latency"
WRAPPED_RUN_COUNT = "/tensorflow/serving/batching_session/wrapped_run_count"
ENQUEUED_TASKS = "/tfformer/serving/batching/enqueued_tasks"
REJECTED_TASKS = "/tfformer/serving/batching/rejected_tasks"

# name -> (kind, bucket limits or None)
METRICS = {
    INPUT_BATCH_SIZE: ("histogram", SIZE_BUCKETS),
    PROCESSED_BATCH_SIZE: ("histogram", SIZE_BUCKETS),
    PADDING_SIZE: ("histogram", SIZE_BUCKETS),
    QUEUING_LATENCY: ("histogram", LATENCY_BUCKETS),
    WRAPPED_RUN_COUNT: ("counter", None),
    ENQUEUED_TASKS: ("gauge", None),
    REJECTED_TASKS: ("counter", None),
}


def prometheus_name(name):
    """`GetPrometheusMetricName`: every character outside `[a-zA-Z0-9_]` becomes `:`; a leading digit gets `_`."""
    name = re.sub(r"[^a-zA-Z0-9_]", ":", name)
    return "_" + name if name[:1].isdigit() else name


def _label_name(name):
    name = re.sub(r"[^a-zA-Z0-9]", "_", name)
    return "_" + name if name[:1].isdigit() else name


def _label_value(value):
    return str(value).replace("\\", "\\\\").replace('"', '\\"')


def _number(value):
    """absl::StrCat of a double: %.6g (whole numbers without a decimal point)."""
    return f"{value:.6g}"


class _Histogram:
    def __init__(self, limits):
        self.limits = limits
        self.counts = [0] * (len(limits) + 1)
        self.sum = 0.0

    def add(self, value):
        self.counts[bisect.bisect_left(self.limits, value)] += 1  # Prometheus' `le`: value <= limit
        self.sum += value


class _Window:
    """What the batch threads did since the last summary line."""

    def __init__(self):
        self.start = time.monotonic()
        self.requests = self.batches = self.rows = self.padding = self.rejected = self.max_batch = 0
        self.max_depth = 0
        self.latencies_us = []


class Metrics:
    """One server's metrics (thread-safe).

    Args:
        log_every_seconds: float. `summary_due()` is true this long after the previous summary.
    """

    def __init__(self, log_every_seconds=30.0):
        self.log_every_seconds = log_every_seconds
        self._lock = threading.Lock()
        self._values = {name: {} for name in METRICS}  # name -> {labels (tuple of pairs): value or _Histogram}
        self._window = _Window()

    def observe(self, name, value, **labels):
        """Adds `value` to histogram `name` (its series for `labels`)."""
        key = tuple(labels.items())
        with self._lock:
            series = self._values[name]
            if key not in series:
                series[key] = _Histogram(METRICS[name][1])
            series[key].add(value)
            if name == QUEUING_LATENCY:
                self._window.requests += 1
                self._window.latencies_us.append(value)

    def increment(self, name, amount=1, **labels):
        key = tuple(labels.items())
        with self._lock:
            self._values[name][key] = self._values[name].get(key, 0) + amount
            if name == REJECTED_TASKS:
                self._window.rejected += amount

    def set_gauge(self, name, value, **labels):
        with self._lock:
            self._values[name][tuple(labels.items())] = value
            if name == ENQUEUED_TASKS:
                self._window.max_depth = max(self._window.max_depth, value)

    def batch_done(self, rows, padded_size):
        """Records one model call of `rows` requested rows padded to `padded_size` (for the summary line)."""
        with self._lock:
            window = self._window
            window.batches += 1
            window.rows += rows
            window.padding += padded_size - rows
            window.max_batch = max(window.max_batch, padded_size)

    def value(self, name, **labels):
        """A counter's or gauge's value, or a histogram's `(count, sum)` (0 / (0, 0.0) when never set)."""
        with self._lock:
            item = self._values[name].get(tuple(labels.items()))
        if isinstance(item, _Histogram):
            return sum(item.counts), item.sum
        return item if item is not None else ((0, 0.0) if METRICS[name][0] == "histogram" else 0)

    def render(self):
        """The Prometheus text page (`PrometheusExporter::GeneratePage`)."""
        lines = []
        with self._lock:
            for name, series in sorted(self._values.items()):
                if not series:
                    continue
                kind, _ = METRICS[name]
                metric = prometheus_name(name)
                lines.append(f"# TYPE {metric} {kind}")
                for key, item in series.items():
                    labels = [f'{_label_name(k)}="{_label_value(v)}"' for k, v in key]
                    if kind != "histogram":
                        lines.append(f"{metric}{{{','.join(labels)}}} {item}")
                        continue
                    total = 0
                    for index, count in enumerate(item.counts):
                        total += count
                        limit = _number(item.limits[index]) if index < len(item.limits) else "+Inf"
                        lines.append(f'{metric}_bucket{{{"".join(label + "," for label in labels)}le="{limit}"}} '
                                     f"{total}")
                    lines.append(f"{metric}_sum{{{','.join(labels)}}} {_number(item.sum)}")
                    lines.append(f"{metric}_count{{{','.join(labels)}}} {total}")
        return "\n".join(lines) + "\n"

    def summary_due(self):
        return time.monotonic() - self._window.start >= self.log_every_seconds

    def summary(self):
        """One line on the batching since the previous summary (and starts a new period); None if nothing ran."""
        with self._lock:
            window, self._window = self._window, _Window()
        if not window.batches and not window.rejected:
            return None
        seconds = time.monotonic() - window.start
        latency = (np.percentile(window.latencies_us, [50, 90, 100]) / 1000 if window.latencies_us
                   else np.zeros(3))
        mean = window.rows / window.batches if window.batches else 0.0
        padding = 100 * window.padding / max(window.rows + window.padding, 1)
        return (f"Batching in the last {seconds:.1f} s: {window.requests} requests in {window.batches} model calls "
                f"(batch size mean {mean:.1f}, max {window.max_batch}; padding {padding:.1f}%), queue depth max "
                f"{window.max_depth}, queuing latency p50 {latency[0]:.1f} ms, p90 {latency[1]:.1f} ms, max "
                f"{latency[2]:.1f} ms, {window.rejected} rejected (queue full)")
