"""Request batching (`tfformer serve --enable_batching`): parameters, the scheduler, and servers under load.

What is checked against what:
- parameters: TF Serving's defaults and its error messages (copied from its sources: shared_batch_scheduler.h,
  bundle_factory_util.cc, batching_session.cc, server.cc);
- the scheduler, on a servable whose model is numpy (every call recorded): which rows went into which call,
  the padding rows, the queue bound, cancelled requests;
- servers under load: every answer against numpy / Python string functions of that request's own input.
"""

import concurrent.futures
import json
import os
import shutil
import threading
import time

import grpc
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import meta_graph_pb2
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

from tests.serving import models
from tests.serving.conftest import http_request
from tfformer import cli, serving
from tfformer.export import warmup
from tfformer.serving import batching, monitoring
from tfformer.serving.batching import BatchingOptions
from tfformer.serving.servable import completed
from tfformer.serving.status import Code, ServingError

QUEUE_FULL = "The batch scheduling queue to which this task was submitted is full"


# ---------------------------------------------------------------------------------------------------------------
# Parameters


def test_defaults_are_tf_servings():
    options = BatchingOptions()
    assert (options.max_batch_size, options.batch_timeout_micros, options.max_enqueued_batches) == (1000, 0, 10)
    assert options.num_batch_threads == len(os.sched_getaffinity(0))  # port::MaxParallelism()
    assert options.thread_pool_name == "model_server_batch_threads"  # server.cc, without a file
    assert options.allowed_batch_sizes == () and options.pad_variable_length_inputs is False
    assert serving.server.batching_options(False) is None
    assert serving.server.batching_options(True) == options


def test_parameters_file(tmp_path):
    path = tmp_path / "batching.config"
    path.write_text("max_batch_size { value: 16 }\nbatch_timeout_micros { value: 2500 }\n"
                    "max_enqueued_batches { value: 3 }\nnum_batch_threads { value: 1 }\n"
                    "thread_pool_name { value: 'pool' }\nallowed_batch_sizes: 4\nallowed_batch_sizes: 16\n"
                    "pad_variable_length_inputs: true\nmax_execution_batch_size { value: 8 }  # ignored, as in TF\n")
    options = serving.server.batching_options(True, str(path))
    assert options == BatchingOptions(max_batch_size=16, batch_timeout_micros=2500, max_enqueued_batches=3,
                                      num_batch_threads=1, thread_pool_name="pool", allowed_batch_sizes=(4, 16),
                                      pad_variable_length_inputs=True)
    assert [options.padded_size(rows) for rows in (1, 4, 5, 16)] == [4, 4, 16, 16]
    path.write_text("")  # every field left out: TF's QueueOptions defaults, SharedBatchScheduler's pool name
    options = serving.server.batching_options(True, str(path))
    assert options == BatchingOptions(thread_pool_name="batch_threads")
    path.write_text("max_enqueued_batches { value: 0 }")  # rewritten to 1 (SharedBatchScheduler::AddQueue)
    assert serving.server.batching_options(True, str(path)).max_enqueued_batches == 1


BAD_PARAMETERS = [
    ("max_batch_size { value: -4 }", "max_batch_size must be positive; was -4"),
    ("max_batch_size { value: 0 }", "max_batch_size must be positive; was 0"),
    ("batch_timeout_micros { value: -1 }", "batch_timeout_micros must be non-negative; was -1"),
    ("max_enqueued_batches { value: -2 }", "max_enqueued_batches must be non-negative; was -2"),
    ("num_batch_threads { value: 0 }", "num_batch_threads must be positive; was 0"),
    ("max_batch_size { value: 32 } allowed_batch_sizes: 8 allowed_batch_sizes: 16",
     "Last entry in allowed_batch_sizes must match max_batch_size; last entry was 16; expected 32"),
    ("allowed_batch_sizes: 8",  # against the default max_batch_size
     "Last entry in allowed_batch_sizes must match max_batch_size; last entry was 8; expected 1000"),
    ("max_batch_size { value: 32 } allowed_batch_sizes: 16 allowed_batch_sizes: 8 allowed_batch_sizes: 32",
     "allowed_batch_sizes entries must be monotonically increasing; was [16, 8, 32]"),
    ("max_batch_size { value: 8 } allowed_batch_sizes: -8 allowed_batch_sizes: 8",
     "allowed_batch_sizes must be positive; was -8"),
    ("enable_large_batch_splitting { value: true }", "enable_large_batch_splitting: tfformer serve does not split"),
    ("max_batch { value: 8 }", 'Message type "tensorflow.serving.BatchingParameters" has no field named "max_batch"'),
    ("max_batch_size: 8", "Expected \"{\""),  # a wrapper field needs { value: ... }, as in TF Serving
]


@pytest.mark.parametrize("text, message", BAD_PARAMETERS)
def test_bad_parameters_stop_the_server_at_start_up(tmp_path, text, message):
    path = tmp_path / "batching.config"
    path.write_text(text)
    with pytest.raises(ValueError) as caught:
        serving.Server(model_name="m", model_base_path=str(tmp_path), enable_batching=True,
                       batching_parameters_file=str(path))
    assert message in str(caught.value) and str(path) in str(caught.value)


def test_bad_parameters_stop_tfformer_serve(tmp_path, capsys):
    path = tmp_path / "batching.config"
    path.write_text("max_batch_size { value: 32 } allowed_batch_sizes: 8")
    code = cli.main(["serve", "--model_base_path", str(tmp_path), "--port", "0", "--rest_api_port", "0",
                     "--enable_batching", "--batching_parameters_file", str(path)])
    assert code == 2
    assert ("Last entry in allowed_batch_sizes must match max_batch_size; last entry was 8; expected 32"
            in capsys.readouterr().err)
    code = cli.main(["serve", "--model_base_path", str(tmp_path), "--enable_batching=false",
                     "--batching_parameters_file", str(path)])
    assert code == 2
    assert ("server_options.batching_parameters_file is set without setting server_options.enable_batching to "
            "true." in capsys.readouterr().err)


def test_a_parameters_file_needs_enable_batching(tmp_path):
    with pytest.raises(ValueError, match="batching_parameters_file is set without setting server_options."
                                         "enable_batching to true"):
        serving.Server(model_name="m", model_base_path=str(tmp_path), batching_parameters_file="x")


# ---------------------------------------------------------------------------------------------------------------
# The scheduler, on a numpy servable


def _signature(inputs, outputs):
    signature = meta_graph_pb2.SignatureDef(method_name="tensorflow/serving/predict")
    for group, shapes in ((signature.inputs, inputs), (signature.outputs, outputs)):
        for alias, shape in shapes.items():
            group[alias].dtype = tf.float32.as_datatype_enum
            for size in shape:
                group[alias].tensor_shape.dim.add().size = size
    return signature


class NumpyServable:
    """`x` (B, 3) -> `y` = x @ [1, 10, 100] (B,): each row's answer says which row it was. `gate` holds calls."""

    name, version, path = "numpy", 1, "-"

    def __init__(self):
        self.signature_defs = {"serving_default": _signature({"x": [-1, 3]}, {"y": [-1]}),
                               "fixed": _signature({"x": [2, 3]}, {"y": [2]})}
        self.calls = []
        self.gate = threading.Event()
        self.gate.set()

    def check_predict(self, signature_name, inputs, output_filter=()):
        return signature_name or "serving_default", {k: np.asarray(v, np.float32) for k, v in inputs.items()}, ["y"]

    def run_predict(self, key, arrays, selected):
        self.calls.append(arrays["x"].copy())
        self.gate.wait(30)
        return {"y": arrays["x"] @ np.array([1, 10, 100], np.float32)}

    def submit(self, signature_name, inputs, output_filter=()):
        key, arrays, selected = self.check_predict(signature_name, inputs)
        return completed(lambda: (key, self.run_predict(key, arrays, selected)))


@pytest.fixture
def scheduled():
    """`make(**options)` -> (BatchingServable over a NumpyServable, its scheduler); schedulers stop afterwards."""
    schedulers = []

    def make(**options):
        options.setdefault("num_batch_threads", 1)
        scheduler = batching.SharedBatchScheduler(BatchingOptions(**options), monitoring.Metrics())
        scheduler.start()
        schedulers.append(scheduler)
        return batching.BatchingServable(NumpyServable(), scheduler), scheduler

    yield make
    for scheduler in schedulers:
        scheduler.stop()


def rows(first, count):
    """`count` rows [i, 0, 0], i = first, first + 1, ...: row i's answer is i."""
    return np.stack([np.arange(first, first + count), np.zeros(count), np.zeros(count)], axis=1)


def wait_until(condition, timeout=30):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_a_full_queue_answers_unavailable_and_loses_nothing(scheduled):
    servable, _ = scheduled(max_batch_size=4, max_enqueued_batches=2)
    model = servable.servable
    model.gate.clear()
    first = servable.submit("", {"x": rows(0, 1)})
    wait_until(lambda: model.calls)  # the only batch thread is busy with it
    accepted, refused = [], []
    for index in range(1, 12):  # 8 rows fit: the open batch and one more, 4 rows each
        try:
            accepted.append((index, servable.submit("", {"x": rows(index, 1)})))
        except ServingError as error:
            refused.append(index)
            assert error.code == Code.UNAVAILABLE
            assert error.message == f"{QUEUE_FULL}; currently 2 batches enqueued and max_enqueued_batches is 2"
    assert [index for index, _ in accepted] == list(range(1, 9)) and refused == [9, 10, 11]
    model.gate.set()
    assert first.result(30)[1]["y"].tolist() == [0]
    for index, future in accepted:
        key, outputs = future.result(30)
        assert key == "serving_default" and outputs["y"].tolist() == [index]
    assert [call[:, 0].tolist() for call in model.calls] == [[0], [1, 2, 3, 4], [5, 6, 7, 8]]


def test_rows_go_back_to_their_requests_in_order(scheduled):
    servable, _ = scheduled(max_batch_size=8, allowed_batch_sizes=(4, 8))
    model = servable.servable
    model.gate.clear()
    blocker = servable.submit("", {"x": rows(100, 1)})
    wait_until(lambda: model.calls)
    futures = [servable.submit("", {"x": rows(start, count)}) for start, count in ((0, 2), (2, 3), (5, 1))]
    model.gate.set()
    blocker.result(30)
    assert [future.result(30)[1]["y"].tolist() for future in futures] == [[0, 1], [2, 3, 4], [5]]
    # 6 rows, padded to 8 with copies of the last request's first row
    assert model.calls[1][:, 0].tolist() == [0, 1, 2, 3, 4, 5, 5, 5]


def test_batch_timeout_gathers_requests(scheduled):
    # A timeout long enough that "a full batch does not wait" stays clear of a loaded machine's scheduling delays.
    servable, _ = scheduled(max_batch_size=3, batch_timeout_micros=1_500_000)
    model = servable.servable
    started = time.monotonic()
    futures = [servable.submit("", {"x": rows(index, 1)}) for index in range(2)]
    assert [future.result(30)[1]["y"].tolist() for future in futures] == [[0], [1]]
    assert [call[:, 0].tolist() for call in model.calls] == [[0, 1]]  # waited for more, then ran the 2
    assert time.monotonic() - started >= 1.4  # the 1.5 s timeout, not a batch thread that happened to wake late
    started = time.monotonic()
    futures = [servable.submit("", {"x": rows(index, 1)}) for index in range(3)]  # a full batch does not wait
    [future.result(30) for future in futures]
    assert time.monotonic() - started < 0.75 and model.calls[-1][:, 0].tolist() == [0, 1, 2]


def test_requests_that_cannot_be_merged_run_alone(scheduled):
    servable, _ = scheduled(max_batch_size=8)
    model = servable.servable
    fixed = servable.submit("fixed", {"x": rows(0, 2)})  # no batch dimension in the signature
    assert fixed.done() and fixed.result()[1]["y"].tolist() == [0, 1]
    empty = servable.submit("", {"x": np.zeros((0, 3))})  # no rows
    assert empty.done() and empty.result()[1]["y"].shape == (0,)
    assert len(model.calls) == 2
    with pytest.raises(ServingError, match="Task size 9 is larger than maximum input batch size 8") as caught:
        servable.submit("", {"x": rows(0, 9)})
    assert caught.value.code == Code.INVALID_ARGUMENT


def test_a_cancelled_request_is_skipped(scheduled):
    servable, _ = scheduled(max_batch_size=8)
    model = servable.servable
    model.gate.clear()
    blocker = servable.submit("", {"x": rows(100, 1)})
    wait_until(lambda: model.calls)
    gone, kept = servable.submit("", {"x": rows(0, 1)}), servable.submit("", {"x": rows(1, 1)})
    assert gone.cancel()  # its client's deadline passed while it was queued
    model.gate.set()
    assert kept.result(30)[1]["y"].tolist() == [1] and blocker.result(30)
    assert [call[:, 0].tolist() for call in model.calls] == [[100], [1]]


def test_merge_pads_as_tf_serving():
    """batching_util.cc: other dimensions padded to the largest with the tensor's own first element; then copies
    of the last tensor's first row up to the allowed size."""
    a = np.array([[5, 1]], np.int32)
    b = np.array([[2, 3, 4], [7, 8, 9]], np.int32)
    merged = batching._merge([a, b], pad=True, extra_rows=1)
    np.testing.assert_array_equal(merged, [[5, 1, 5], [2, 3, 4], [7, 8, 9], [2, 3, 4]])
    strings = np.array([[b"x"]], object)
    np.testing.assert_array_equal(batching._merge([strings, np.array([[b"p", b"q"]], object)], True, 0),
                                  np.array([[b"x", b"x"], [b"p", b"q"]], object))


def test_metrics_page_is_tf_servings_format():
    metrics = monitoring.Metrics()
    metrics.observe(monitoring.PROCESSED_BATCH_SIZE, 3)
    metrics.increment(monitoring.REJECTED_TASKS, 2, model="m", version="1", signature='a"b')
    page = metrics.render().splitlines()
    name = ":tensorflow:serving:batching_session:processed_batch_size"
    assert page[0] == f"# TYPE {name} histogram"
    assert page[1:5] == [f'{name}_bucket{{le="1"}} 0', f'{name}_bucket{{le="2"}} 0', f'{name}_bucket{{le="4"}} 1',
                         f'{name}_bucket{{le="8"}} 1']
    assert page[14:18] == [f'{name}_bucket{{le="8192"}} 1', f'{name}_bucket{{le="+Inf"}} 1', f"{name}_sum{{}} 3",
                           f"{name}_count{{}} 1"]
    assert page[18:] == ["# TYPE :tfformer:serving:batching:rejected_tasks counter",
                         ':tfformer:serving:batching:rejected_tasks{model="m",version="1",signature="a\\"b"} 2']
    assert monitoring.LATENCY_BUCKETS[:3] == (100, 120, 144) and len(monitoring.LATENCY_BUCKETS) == 52


# ---------------------------------------------------------------------------------------------------------------
# Servers


REQUESTS, CLIENTS = 2000, 64
LOAD_OPTIONS = BatchingOptions(max_batch_size=16, batch_timeout_micros=2000, max_enqueued_batches=1000,
                               num_batch_threads=2, allowed_batch_sizes=(4, 8, 16))


@pytest.fixture(scope="module")
def batching_root(tmp_path_factory):
    """dense, multi, text (v1), seq and slow; `swap` (text v1) with text v2 (and its warm-up records) saved beside
    it, for a hot swap."""
    root = tmp_path_factory.mktemp("batching_models")
    models.save_dense(root / "dense" / "1")
    models.save_multi(root / "multi" / "1")
    models.save_text(root / "text" / "1", version=1)
    models.save_seq(root / "seq" / "1")
    models.save_slow(root / "slow" / "1")
    models.save_text(root / "swap" / "1", version=1)
    models.save_text(root / "swap-v2", version=2)
    # its warm-up records (1 and 8 rows) run through the batcher before version 2 takes requests
    warmup.write(root / "swap-v2", [warmup.predict_log("", {"text": np.array([b"warm up"] * rows)}) for rows in (1, 8)])
    return root


def models_config(root, *names):
    path = root / f"models-{'-'.join(names)}.config"
    path.write_text("model_config_list { " + " ".join(
        f"config {{ name: '{name}' base_path: '{root / name}' model_platform: 'tensorflow' }}" for name in names)
        + " }")
    return str(path)


def _dense(i, count):
    x = np.stack([np.full(count, float(i)), np.arange(count, dtype=float), np.ones(count)], axis=1)
    return {"x": x.astype(np.float32)}, {"output_0": np.repeat(x.sum(axis=1, keepdims=True), 2, axis=1)}


def _multi(i, count):
    x = np.full((count, 3), float(i), np.float32) + np.arange(count, dtype=np.float32)[:, None]
    ids = np.arange(4 * count, dtype=np.int32).reshape(count, 4) + i
    return {"x": x, "ids": ids}, {"total": np.repeat(x.sum(axis=1, keepdims=True), 2, axis=1),
                                  "idsum": ids.sum(axis=1, keepdims=True)}


def _texts(i, count):
    return [" ".join([f"w{i}"] * (row + 1) + ["é"] * (i % 2)) for row in range(count)]


def _text(i, count, version=1):
    texts = _texts(i, count)
    return texts, {"upper_bytes": [t.encode().upper() for t in texts], "words": [len(t.split()) for t in texts],
                   "version": [version] * count}


def _seq(i, count):
    ids = (np.arange(count * (1 + i % 5), dtype=np.int32).reshape(count, -1) + i)  # T = 1..5
    return {"ids": ids}, {"ids_out": ids, "total": ids.sum(axis=1)}


def _check(got, expected):
    assert sorted(got) == sorted(expected), (got, expected)
    for alias, value in expected.items():
        assert np.asarray(got[alias]).tolist() == np.asarray(value).tolist(), (alias, got[alias], value)


def _grpc_filtered(stub, i, count):
    """Text model, `output_filter: words` (its own queue), sent with TF Serving's stub."""
    texts, expected = _text(i, count)
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "text"
    request.inputs["text"].CopyFrom(tf.make_tensor_proto(texts))
    request.output_filter.append("words")
    response = stub.Predict(request, timeout=60)
    return {alias: tf.make_ndarray(proto) for alias, proto in response.outputs.items()}, {"words": expected["words"]}


def _one_request(clients, stub, i):
    """Request `i` (kind i % 8, 1-3 rows, inputs made from i): `(got, expected, version)`."""
    rest, remote = clients
    kind, count = i % 8, 1 + (i // 8) % 3
    client = rest if kind % 2 == 0 else remote
    if kind in (0, 1):
        inputs, expected = _dense(i, count)
        return client.predict("dense", inputs), expected, None
    if kind == 2:
        inputs, expected = _multi(i, count)
        return client.predict("multi", inputs), expected, None
    if kind == 3:
        texts, expected = _text(i, count)
        got = client.predict("text", texts, signature_name="lengths")
        return got, {"length": [len(t.encode()) for t in texts]}, None
    if kind == 4:
        texts, expected = _text(i, count)
        return client.predict("text", texts), expected, None
    if kind == 5:
        return (*_grpc_filtered(stub, i, count), None)
    if kind == 6:
        inputs, expected = _seq(i, count)
        return client.predict("seq", inputs), expected, None
    got = client.predict("swap", _texts(i, count))  # version 1, then 2 after the swap
    version = int(got["version"][0])
    return got, _text(i, count, version)[1], version


def test_correctness_under_load_with_a_hot_swap(batching_root):
    """2,000 requests from 64 clients (REST and gRPC, 6 signatures and output sets, 1-3 rows each, sequences of 5
    lengths), version 2 of `swap` published at request 500 (warmed up through the batcher, then swapped in while
    requests keep coming; from request 1,500 on they wait for it): each answer is its own input's, nothing is lost
    or duplicated."""
    config = models_config(batching_root, "dense", "multi", "text", "seq", "swap")
    swap_v2 = batching_root / "swap" / "2"
    with serving.Server(model_config_file=config, file_system_poll_wait_seconds=0.1, enable_batching=True,
                        batching_parameters=LOAD_OPTIONS, access_log=None) as server:
        clients = (serving.Client(server.rest_url, timeout=60), serving.Client(server.grpc_url, timeout=60))
        channel = grpc.insecure_channel(server.grpc_url.split("://")[1])
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        counter, lock, swapped = iter(range(REQUESTS)), threading.Lock(), threading.Event()
        results = [None] * REQUESTS

        def publish():  # at request 500; requests from 1,500 on wait until version 2 serves (it loads meanwhile)
            shutil.copytree(batching_root / "swap-v2", batching_root / "swap" / ".staging-2")
            os.rename(batching_root / "swap" / ".staging-2", swap_v2)
            server.manager.wait_for_version("swap", 2, timeout=120)
            swapped.set()

        def client_thread():
            while True:
                with lock:
                    i = next(counter, None)
                if i is None:
                    return
                if i == REQUESTS // 4:
                    threading.Thread(target=publish, daemon=True).start()
                if i >= 3 * REQUESTS // 4:
                    swapped.wait(120)
                try:
                    got, expected, version = _one_request(clients, stub, i)
                    _check(got, expected)
                    results[i] = ("ok", version, time.monotonic())
                except Exception as error:  # reported below, with its request
                    results[i] = ("failed", repr(error), time.monotonic())

        threads = [threading.Thread(target=client_thread) for _ in range(CLIENTS)]
        [thread.start() for thread in threads]
        [thread.join() for thread in threads]
        calls = server.metrics.value(monitoring.WRAPPED_RUN_COUNT)
        requests, _ = server.metrics.value(monitoring.INPUT_BATCH_SIZE)
        processed, rows = server.metrics.value(monitoring.PROCESSED_BATCH_SIZE)
        channel.close()
    failures = [(i, result) for i, result in enumerate(results) if result is None or result[0] != "ok"]
    assert not failures, failures[:5]
    assert requests == REQUESTS + 2  # every request queued once (all 8 kinds are batched), none twice; + warm-up
    assert processed == calls and rows / calls >= 3, (calls, rows)  # merged: 3+ rows per model call on average
    versions = [result[1] for result in results if result[1] is not None]
    assert set(versions) == {1, 2} and versions.count(2) > 10


def test_padding_variable_length_inputs(batching_root):
    """pad_variable_length_inputs: two requests of lengths 2 and 3 in one batch; the shorter one padded with its
    own first element, as TF Serving pads it (and the row keeps the padded length)."""
    options = BatchingOptions(max_batch_size=2, batch_timeout_micros=10_000_000, num_batch_threads=1,
                              pad_variable_length_inputs=True)
    with serving.Server(model_config_file=models_config(batching_root, "seq"), file_system_poll_wait_seconds=0,
                        enable_batching=True, batching_parameters=options, access_log=None) as server:
        client = serving.Client(server.rest_url)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            short = pool.submit(client.predict, "seq", {"ids": [[5, 1]]})
            long = pool.submit(client.predict, "seq", {"ids": [[2, 3, 4]]})
            _check(short.result(60), {"ids_out": [[5, 1, 5]], "total": [11]})
            _check(long.result(60), {"ids_out": [[2, 3, 4]], "total": [9]})
        assert server.metrics.value(monitoring.WRAPPED_RUN_COUNT) == 1


def test_a_full_queue_answers_503_and_unavailable(batching_root, tmp_path):
    """One batch thread busy for 1.5 s, a queue of one batch of 2: of 12 more requests (REST and gRPC) 2 are
    answered and 10 get TF Serving's UNAVAILABLE; no other error. The metrics page counts the 10."""
    options = BatchingOptions(max_batch_size=2, max_enqueued_batches=1, num_batch_threads=1)
    monitoring_config = tmp_path / "monitoring.config"
    monitoring_config.write_text("prometheus_config { enable: true }")
    with serving.Server(model_config_file=models_config(batching_root, "slow"), file_system_poll_wait_seconds=0,
                        enable_batching=True, batching_parameters=options, access_log=None,
                        monitoring_config_file=str(monitoring_config)) as server:
        rest, remote = serving.Client(server.rest_url, timeout=60), serving.Client(server.grpc_url, timeout=60)
        with concurrent.futures.ThreadPoolExecutor(13) as pool:
            busy = pool.submit(rest.predict, "slow", {"seconds": [1.5]})
            wait_until(lambda: server.metrics.value(monitoring.QUEUING_LATENCY,
                                                    thread_pool_name=options.thread_pool_name)[0] == 1)
            burst = [pool.submit(client.predict, "slow", {"seconds": [0.0]}) for client in (rest, remote) * 6]
            outcomes = [future.exception(60) for future in burst]
            assert busy.result(60)["iterations"].shape == (1,)
        answered = [error for error in outcomes if error is None]
        refused = [error for error in outcomes if error is not None]
        assert len(answered) == 2 and len(refused) == 10, outcomes
        for error in refused:
            assert error.code == Code.UNAVAILABLE, error
            assert error.message == f"{QUEUE_FULL}; currently 1 batches enqueued and max_enqueued_batches is 1"
        status, headers, body = http_request(server.rest_url, "POST", "/v1/models/slow:predict",
                                             json.dumps({"instances": [0.0]}).encode())
        assert status == 200, body  # the server goes on serving
        status, headers, page = http_request(server.rest_url, "GET", monitoring.PROMETHEUS_PATH)
        assert status == 200 and headers["content-type"].startswith("text/plain")
        page = page.decode()
        assert ':tfformer:serving:batching:rejected_tasks{model="slow",version="1",signature="serving_default"} 10' \
            in page.splitlines()
        assert ":tensorflow:serving:batching_session:wrapped_run_count{} 3" in page.splitlines()


def test_a_503_over_rest_is_tf_servings(batching_root):
    """The REST answer of a full queue: HTTP 503 with TF Serving's `{"error": ...}` body."""
    options = BatchingOptions(max_batch_size=1, max_enqueued_batches=1, num_batch_threads=1)
    with serving.Server(model_config_file=models_config(batching_root, "slow"), file_system_poll_wait_seconds=0,
                        enable_batching=True, batching_parameters=options, access_log=None) as server:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            busy = pool.submit(serving.Client(server.rest_url).predict, "slow", {"seconds": [1.0]})
            wait_until(lambda: server.metrics.value(monitoring.QUEUING_LATENCY,
                                                    thread_pool_name=options.thread_pool_name)[0] == 1)
            queued = pool.submit(http_request, server.rest_url, "POST", "/v1/models/slow:predict",
                                 json.dumps({"instances": [0.0]}).encode())
            wait_until(lambda: server.metrics.value(monitoring.ENQUEUED_TASKS, model="slow", version="1",
                                                    signature="serving_default") == 1)
            status, headers, body = http_request(server.rest_url, "POST", "/v1/models/slow:predict",
                                                 json.dumps({"instances": [0.0]}).encode())
            assert queued.result(60)[0] == 200 and busy.result(60)
        assert status == 503 and headers["content-type"] == "application/json"
        assert json.loads(body) == {"error": f"{QUEUE_FULL}; currently 1 batches enqueued and max_enqueued_batches "
                                             "is 1"}


def test_no_metrics_page_without_a_monitoring_config(batching_root):
    with serving.Server(model_config_file=models_config(batching_root, "seq"), file_system_poll_wait_seconds=0,
                        enable_batching=True, access_log=None) as server:
        status, headers, _ = http_request(server.rest_url, "GET", monitoring.PROMETHEUS_PATH)
        assert status == 404 and headers["content-type"].startswith("text/html")  # as any path outside /v1/
