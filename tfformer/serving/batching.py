"""TF Serving's request batching (`tfformer serve --enable_batching [--batching_parameters_file FILE]`).

Concurrent Predict requests (REST and gRPC) to the same model version, signature and outputs are merged into
one call of the signature's function, padded to an allowed batch size, and split back: each request gets its
own rows, in order. The pieces are TF Serving's:

- `BatchingOptions`: the `BatchingParameters` text proto (session_bundle_config.proto), with TF Serving's
  defaults (`SharedBatchScheduler::QueueOptions`: `max_batch_size` 1000, `batch_timeout_micros` 0,
  `max_enqueued_batches` 10; `num_batch_threads` = the cores this process may use) and its checks.
- `SharedBatchScheduler` (tensorflow/core/kernels/batching_util/shared_batch_scheduler.h): one pool of
  `num_batch_threads` threads for the whole server; one queue per kind of task. A queue is a deque of batches,
  the back one open. A task joins the open batch; if it does not fit, the open batch closes and a new one opens,
  unless `max_enqueued_batches` batches are already there: then the request gets UNAVAILABLE "The batch
  scheduling queue to which this task was submitted is full". A free thread takes a closed batch, or the open
  one once it is full or its oldest task has waited `batch_timeout_micros` (0: at once), going round the
  queues in turn.
- `BatchingServable` (batching_session.cc): a queue per (signature, requested outputs) of a loaded version.
  A batch's inputs are concatenated along dim 0; with `allowed_batch_sizes`, padded up to the next allowed
  size with copies of the last task's first row; with `pad_variable_length_inputs`, every input is first
  padded along its other dimensions to the batch's largest, with the input's own first element (as
  batching_util.cc does; the output rows keep the padded lengths, as TF Serving's do). Outputs are split
  along dim 0; the padding rows are dropped.

Requests that cannot be merged run alone, at once, in the request's worker thread: a signature whose inputs or
requested outputs lack an unknown leading (batch) dimension in its SignatureDef, a request whose inputs do not
all have the same, non-zero dim 0 (TF Serving refuses those with "Batching Run() input tensors must have equal
0th-dimension size"), or an input with a zero-size dimension. Within a batch, requests whose inputs differ in a
dimension other than dim 0 (without `pad_variable_length_inputs`) go into separate model calls; TF Serving
fails the whole batch with FAILED_PRECONDITION there. A request larger than `max_batch_size` gets TF Serving's
INVALID_ARGUMENT "Task size N is larger than maximum input batch size M" (it does not split requests:
`enable_large_batch_splitting` is refused). Classify and Regress are not batched.
"""

import collections
import concurrent.futures
import dataclasses
import functools
import logging
import threading
import time
import weakref

import numpy as np

from tfformer.checks import check_int
from tfformer.cpu import cpu_cores
from tfformer.serving import monitoring
from tfformer.serving.servable import Servable, completed
from tfformer.serving.status import Code, ServingError, failed_precondition, internal, invalid_argument

log = logging.getLogger("tfformer.serving")

QUEUE_FULL_MESSAGE = "The batch scheduling queue to which this task was submitted is full"
DEFAULT_THREAD_POOL_NAME = "model_server_batch_threads"  # server.cc, when no --batching_parameters_file


def _at_least(name, value, minimum, wording):
    check_int(name, value, minimum=None)
    if value < minimum:
        raise ValueError(f"{name} must be {wording}; was {value}")


@dataclasses.dataclass(frozen=True)
class BatchingOptions:
    """The batching parameters of a server (TF Serving's `BatchingParameters`, defaults filled in).

    Args:
        max_batch_size: int. Rows per model call at most (a request's rows are its dim 0). Defaults to 1000.
        batch_timeout_micros: int. How long the oldest request of an underfull batch may wait for more before a
            free thread takes the batch anyway. Defaults to 0 (a free thread takes whatever is there).
        max_enqueued_batches: int. Batches a queue holds (the open one included) before it turns requests away
            with UNAVAILABLE. Defaults to 10; 0 means 1, as in TF Serving.
        num_batch_threads: int. Batches computed at the same time, for the whole server. Defaults to the cores
            this process may use.
        thread_pool_name: str. The batch threads' name (and the queuing latency metric's label).
        allowed_batch_sizes: increasing ints ending at `max_batch_size`: batches are padded up to the next one.
            Empty: any size.
        pad_variable_length_inputs: bool. Pad inputs along their other dimensions to the batch's largest.

    Raises:
        ValueError: a value TF Serving refuses, with its wording (the field's name first).
    """

    max_batch_size: int = 1000
    batch_timeout_micros: int = 0
    max_enqueued_batches: int = 10
    num_batch_threads: int = dataclasses.field(default_factory=cpu_cores)  # port::MaxParallelism()
    thread_pool_name: str = DEFAULT_THREAD_POOL_NAME
    allowed_batch_sizes: tuple = ()
    pad_variable_length_inputs: bool = False

    def __post_init__(self):
        _at_least("max_batch_size", self.max_batch_size, 1, "positive")
        _at_least("batch_timeout_micros", self.batch_timeout_micros, 0, "non-negative")
        _at_least("max_enqueued_batches", self.max_enqueued_batches, 0, "non-negative")
        if self.max_enqueued_batches == 0:
            object.__setattr__(self, "max_enqueued_batches", 1)  # SharedBatchScheduler::AddQueue's rewrite
        _at_least("num_batch_threads", self.num_batch_threads, 1, "positive")
        sizes = tuple(self.allowed_batch_sizes)
        object.__setattr__(self, "allowed_batch_sizes", sizes)
        for size in sizes:
            _at_least("allowed_batch_sizes", size, 1, "positive")
        if any(later <= earlier for earlier, later in zip(sizes, sizes[1:])):
            raise ValueError(f"allowed_batch_sizes entries must be monotonically increasing; was {list(sizes)}")
        if sizes and sizes[-1] != self.max_batch_size:
            raise ValueError(f"Last entry in allowed_batch_sizes must match max_batch_size; last entry was "
                             f"{sizes[-1]}; expected {self.max_batch_size}")

    @classmethod
    def from_proto(cls, message, default_thread_pool_name="batch_threads"):
        """From a `BatchingParameters` message; fields it does not set keep TF Serving's defaults."""
        if message.HasField("enable_large_batch_splitting") and message.enable_large_batch_splitting.value:
            raise ValueError("enable_large_batch_splitting: tfformer serve does not split requests across batches; "
                             "leave it out (a request larger than max_batch_size is refused, as TF Serving refuses "
                             "it without splitting).")
        fields = {}
        for name in ("max_batch_size", "batch_timeout_micros", "max_enqueued_batches", "num_batch_threads",
                     "thread_pool_name"):
            if message.HasField(name):
                fields[name] = getattr(message, name).value
        fields.setdefault("thread_pool_name", default_thread_pool_name)
        return cls(allowed_batch_sizes=tuple(message.allowed_batch_sizes),
                   pad_variable_length_inputs=message.pad_variable_length_inputs, **fields)

    def padded_size(self, rows):
        """`RoundToLowestAllowedBatchSize`: the smallest allowed size >= `rows` (`rows` when none is set)."""
        return next((size for size in self.allowed_batch_sizes if size >= rows), rows)

    def describe(self):
        return ", ".join(f"{field.name} {getattr(self, field.name)!r}" for field in dataclasses.fields(self))


class _Task:
    """One request's validated inputs, its row count (dim 0) and the future its rows go to."""

    __slots__ = ("inputs", "size", "future", "enqueued")

    def __init__(self, inputs, size):
        self.inputs, self.size = inputs, size
        self.future = concurrent.futures.Future()
        self.enqueued = time.monotonic()


class _Queue:
    """One kind of task's batches (deque; the back one open). Guarded by the scheduler's lock."""

    def __init__(self, process, labels):
        self.process = process  # callable(tasks), run on a batch thread
        self.labels = labels  # model, version, signature (metrics)
        self.batches = collections.deque([[]])
        self.rows = collections.deque([0])
        self.open_since = 0.0
        self.closed = False
        self.in_process = 0

    def tasks(self):
        return sum(len(batch) for batch in self.batches)

    def empty(self):
        return self.in_process == 0 and len(self.batches) == 1 and not self.batches[0]

    def start_new_batch(self):
        self.batches.append([])
        self.rows.append(0)

    def take(self, now, options):
        """`ScheduleBatch`: a closed batch, or the open one if it is due; else None."""
        if len(self.batches) == 1 and self.rows[0] and (
                self.closed or self.rows[0] >= options.max_batch_size
                or now >= self.open_since + options.batch_timeout_micros / 1e6):
            self.start_new_batch()
        if len(self.batches) >= 2:
            self.rows.popleft()
            return self.batches.popleft()
        return None

    def due(self, options):
        """When the open batch becomes due by its timeout (None if it is empty)."""
        return self.open_since + options.batch_timeout_micros / 1e6 if self.rows[-1] else None


class SharedBatchScheduler:
    """`num_batch_threads` threads shared by every batching queue of a server, taking batches round robin.

    Args:
        options: `BatchingOptions`.
        metrics: `monitoring.Metrics` (queue depth, queuing latency, batch sizes).
    """

    def __init__(self, options, metrics):
        self.options, self.metrics = options, metrics
        self._changed = threading.Condition()
        self._queues = []
        self._next = 0
        self._threads = []
        self._stopping = False

    def start(self):
        log.info("Batching: %s", self.options.describe())
        for index in range(self.options.num_batch_threads):
            thread = threading.Thread(target=self._work, name=f"{self.options.thread_pool_name}_{index}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self):
        """Closes every queue, lets the batch threads finish what is queued, then joins them."""
        with self._changed:
            self._stopping = True
            for queue in self._queues:
                queue.closed = True
            self._changed.notify_all()
        for thread in self._threads:
            thread.join()

    def add_queue(self, process, labels):
        queue = _Queue(process, labels)
        with self._changed:
            queue.closed = self._stopping
            self._queues.append(queue)
        return queue

    def close_queues(self, queues):
        """Closes `queues` (a dict's values): their batches are still processed, then they are dropped."""
        with self._changed:
            for queue in list(queues.values()):
                queue.closed = True
            self._changed.notify_all()

    def schedule(self, queue, task):
        """`Queue::Schedule`: adds `task` to `queue`'s open batch, or to a new one.

        Raises:
            ServingError: INVALID_ARGUMENT for a task larger than `max_batch_size`; UNAVAILABLE when the queue is
                full (or closed).
        """
        options = self.options
        if task.size > options.max_batch_size:
            raise invalid_argument(f"Task size {task.size} is larger than maximum input batch size "
                                   f"{options.max_batch_size}")
        with self._changed:
            if queue.closed:
                raise ServingError(Code.UNAVAILABLE, "The batch scheduling queue was closed (the servable is "
                                                     "being unloaded)")
            if queue.rows[-1] + task.size > options.max_batch_size:
                if len(queue.batches) >= options.max_enqueued_batches:
                    self.metrics.increment(monitoring.REJECTED_TASKS, **queue.labels)
                    raise ServingError(Code.UNAVAILABLE, f"{QUEUE_FULL_MESSAGE}; currently {len(queue.batches)} "
                                                         f"batches enqueued and max_enqueued_batches is "
                                                         f"{options.max_enqueued_batches}")
                queue.start_new_batch()
            if not queue.rows[-1]:
                queue.open_since = time.monotonic()
            queue.batches[-1].append(task)
            queue.rows[-1] += task.size
            self.metrics.set_gauge(monitoring.ENQUEUED_TASKS, queue.tasks(), **queue.labels)
            self._changed.notify()

    def _next_batch(self):
        """(queue, batch) from the next queue round robin that has one; (None, None) if none has. Lock held."""
        now = time.monotonic()
        for _ in range(len(self._queues)):
            self._next %= len(self._queues)
            queue = self._queues[self._next]
            batch = queue.take(now, self.options)
            if batch is None and queue.closed and queue.empty():
                del self._queues[self._next]  # a closed queue with nothing left: dropped
                continue
            self._next += 1
            if batch is not None:
                self.metrics.set_gauge(monitoring.ENQUEUED_TASKS, queue.tasks(), **queue.labels)
                return queue, batch
        return None, None

    def _wait_seconds(self):
        dues = [due for due in (queue.due(self.options) for queue in self._queues) if due is not None]
        return max(min(dues) - time.monotonic(), 0.0) if dues else None

    def _work(self):
        while True:
            with self._changed:
                queue, batch = self._next_batch()
                while batch is None:
                    if self._stopping and not self._queues:
                        return
                    self._changed.wait(self._wait_seconds())
                    queue, batch = self._next_batch()
                queue.in_process += 1
            try:
                queue.process(batch)
            finally:
                with self._changed:
                    queue.in_process -= 1
                    self._changed.notify_all()
            if self.metrics.summary_due():
                line = self.metrics.summary()
                if line:
                    log.info("%s", line)


def batch_dimensions(signature_def):
    """`(inputs_batched, {output aliases with a batch dim})`: whether every input, and which outputs, have a known
    rank >= 1 and an unknown dim 0 in the SignatureDef (only such signatures are batched)."""

    def batched(info):
        shape = info.tensor_shape
        return not shape.unknown_rank and len(shape.dim) >= 1 and shape.dim[0].size == -1

    return (all(batched(info) for info in signature_def.inputs.values()),
            {alias for alias, info in signature_def.outputs.items() if batched(info)})


def request_rows(inputs):
    """The dim 0 every input shares (the request's rows), or None when the request cannot be merged."""
    sizes = {array.shape[0] if array.ndim else 0 for array in inputs.values()}
    if len(sizes) != 1 or 0 in sizes or any(array.size == 0 for array in inputs.values()):
        return None
    return sizes.pop()


def _shape_key(task, pad):
    """Tasks with equal keys are merged into one call: equal shapes but dim 0 (or equal ranks, with padding)."""
    return tuple((alias, array.ndim if pad else array.shape[1:]) for alias, array in sorted(task.inputs.items()))


def _pad_to(array, shape):
    """`AddPadding`: `array` padded at the end of each dimension but 0 to `shape`, with its own first element."""
    if array.shape[1:] == tuple(shape[1:]):
        return array
    padded = np.full((array.shape[0], *shape[1:]), array.flat[0], dtype=array.dtype)
    padded[tuple(slice(0, size) for size in array.shape)] = array
    return padded


def _merge(arrays, pad, extra_rows):
    """One input of a batch: the tasks' arrays (padded with `pad`), then `extra_rows` copies of the last's first row."""
    if pad:
        shape = np.max([array.shape for array in arrays], axis=0)
        arrays = [_pad_to(array, shape) for array in arrays]
    if extra_rows:
        arrays = [*arrays, np.repeat(arrays[-1][:1], extra_rows, axis=0)]
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=0)


def _split(outputs, sizes, padded_size):
    """`SplitOutputTensors`: each task's rows of every output (the padding rows dropped)."""
    for array in outputs.values():
        if array.ndim == 0:
            raise failed_precondition("Batched output tensor has 0 dimensions")
        if array.shape[0] != padded_size:
            raise failed_precondition("Batched output tensor's 0th dimension does not equal the sum of the 0th "
                                      "dimension sizes of the input tensors")
    ends = np.cumsum(sizes)
    return [{alias: array[end - size:end] for alias, array in outputs.items()} for size, end in zip(sizes, ends)]


def _run_group(servable, key, selected, options, metrics, tasks):
    """One model call for `tasks` (mergeable): merge, run, split, and settle every task's future."""
    rows = sum(task.size for task in tasks)
    padded_size = options.padded_size(rows)
    for task in tasks:
        metrics.observe(monitoring.INPUT_BATCH_SIZE, task.size)
    metrics.observe(monitoring.PROCESSED_BATCH_SIZE, padded_size)
    metrics.observe(monitoring.PADDING_SIZE, padded_size - rows, execution_batch_size=padded_size)
    metrics.increment(monitoring.WRAPPED_RUN_COUNT)
    metrics.batch_done(rows, padded_size)
    try:
        inputs = {alias: _merge([task.inputs[alias] for task in tasks], options.pad_variable_length_inputs,
                                padded_size - rows) for alias in tasks[0].inputs}
        pieces = _split(servable.run_predict(key, inputs, selected), [task.size for task in tasks], padded_size)
    except ServingError as error:
        for task in tasks:
            task.future.set_exception(error)
        return
    except Exception as error:  # every request of the batch must get an answer
        log.exception("Batch of %d requests to %s version %d failed", len(tasks), servable.name, servable.version)
        for task in tasks:
            task.future.set_exception(internal(f"{type(error).__name__}: {error}"))
        return
    for task, piece in zip(tasks, pieces):
        task.future.set_result((key, piece))


def _process_batch(servable, key, selected, options, metrics, tasks):
    """A batch thread's work on one batch: the tasks still wanted, grouped by shape, one model call per group."""
    now = time.monotonic()
    groups = {}
    for task in tasks:
        if not task.future.set_running_or_notify_cancel():
            continue  # the client gave up (its deadline passed) while the task was queued
        metrics.observe(monitoring.QUEUING_LATENCY, (now - task.enqueued) * 1e6,
                        thread_pool_name=options.thread_pool_name)
        groups.setdefault(_shape_key(task, options.pad_variable_length_inputs), []).append(task)
    for group in groups.values():
        _run_group(servable, key, selected, options, metrics, group)


class BatchingServable:
    """A loaded version whose Predict requests are batched: the servable `tfformer serve --enable_batching` loads.

    `submit` validates a request as the servable does, then queues it (or runs it at once when it cannot be
    merged). Everything else (metadata, classify, regress, ...) is the wrapped servable's. Its queues close when
    it is garbage collected, i.e. once the manager has unloaded it and its last request has finished.

    Args:
        servable: `Servable`.
        scheduler: `SharedBatchScheduler`.
    """

    def __init__(self, servable, scheduler):
        self.servable = servable
        self.name, self.version, self.path = servable.name, servable.version, servable.path
        self.signature_defs = servable.signature_defs
        self._scheduler = scheduler
        self._batch_dimensions = {key: batch_dimensions(signature) for key, signature in self.signature_defs.items()}
        self._queues = {}  # (signature key, output aliases) -> _Queue
        self._lock = threading.Lock()
        weakref.finalize(self, scheduler.close_queues, self._queues)

    def __getattr__(self, name):
        servable = self.__dict__.get("servable")
        if servable is None:
            raise AttributeError(name)
        return getattr(servable, name)

    def predict(self, signature_name, inputs, output_filter=()):
        """As `Servable.predict`, through the batcher (blocks until the request's batch has run)."""
        return self.submit(signature_name, inputs, output_filter).result()

    def submit(self, signature_name, inputs, output_filter=()):
        """Queues a Predict request; returns a `Future` of `(resolved signature name, {alias: rows})`.

        Raises:
            ServingError: the request is invalid (as `Servable.predict` raises it), or the queue refuses it.
        """
        key, arrays, selected = self.servable.check_predict(signature_name, inputs, output_filter)
        inputs_batched, outputs_batched = self._batch_dimensions[key]
        rows = request_rows(arrays) if inputs_batched and set(selected) <= outputs_batched else None
        if rows is None:  # runs alone, now
            return completed(lambda: (key, self.servable.run_predict(key, arrays, selected)))
        task = _Task(arrays, rows)
        self._scheduler.schedule(self._queue(key, tuple(selected)), task)
        return task.future

    def _queue(self, key, selected):
        with self._lock:
            queue = self._queues.get((key, selected))
            if queue is None:
                process = functools.partial(_process_batch, self.servable, key, selected, self._scheduler.options,
                                            self._scheduler.metrics)
                labels = {"model": self.name, "version": str(self.version), "signature": key}
                queue = self._queues[(key, selected)] = self._scheduler.add_queue(process, labels)
            return queue


def loader(scheduler, load=Servable):
    """The manager's `loader` with batching: each version `load(name, version, path)` loads, in a `BatchingServable`."""
    return lambda name, version, path: BatchingServable(load(name, version, path), scheduler)
