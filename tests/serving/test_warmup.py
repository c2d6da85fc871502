"""SavedModel warm-up on load, as TF Serving replays `assets.extra/tf_serving_warmup_requests`
(servables/tensorflow/saved_model_warmup{,_util}.cc): before the version is AVAILABLE, every record, each
`num_request_iterations` times; a failing record fails the load with its status; at most 1000 records; a hot swap
serves the old version until the new one is warm.

The model counts its own calls in TensorFlow variables (read by its `count` signature), so "the warm-up ran" is
what the graph saw, not what the server says. The warm-up files are written here with `tf.io.TFRecordWriter` and
`tensorflow_serving.apis` protos, as TF Serving's documentation does.
"""

import os
import shutil
import threading
import time

import numpy as np
import pytest
import tensorflow as tf
from tensorflow_serving.apis import (classification_pb2, get_model_status_pb2, inference_pb2, prediction_log_pb2,
                                     regression_pb2)

from tests.serving import models
from tfformer import serving
from tfformer.serving import config as config_lib
from tfformer.serving.manager import ModelManager
from tfformer.serving.servable import Servable
from tfformer.serving.status import Code, ServingError


class CountingModel(tf.Module):
    """`serving_default`: x float (B,) -> y = x * version, version, warmed (the `warm` calls finished so far);
    `warm`: busy-waits seconds[0] s, then counts itself; `count`: the calls of both so far (counts nothing)."""

    def __init__(self, version):
        super().__init__()
        self.version = tf.constant(version, tf.int32)
        self.calls = tf.Variable(0, dtype=tf.int32)
        self.warmed = tf.Variable(0, dtype=tf.int32)

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="x")])
    def serve(self, x):
        self.calls.assign_add(1)
        return {"y": x * tf.cast(self.version, tf.float32), "version": tf.fill(tf.shape(x), self.version),
                "warmed": tf.fill(tf.shape(x), self.warmed.read_value())}

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="seconds")])
    def warm(self, seconds):
        with tf.control_dependencies([models.spin(seconds)]):
            done = self.warmed.assign_add(1)
        return {"done": tf.fill(tf.shape(seconds), done)}

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="x")])
    def count(self, x):
        return {"calls": tf.fill(tf.shape(x), self.calls.read_value()),
                "warm_calls": tf.fill(tf.shape(x), self.warmed.read_value())}


def save_counting(path, version):
    module = CountingModel(version)
    tf.saved_model.save(module, os.fspath(path), signatures={"serving_default": module.serve, "warm": module.warm,
                                                             "count": module.count})


def predict_record(signature_name, **inputs):
    record = prediction_log_pb2.PredictionLog()
    request = record.predict_log.request
    request.model_spec.name = "m"
    request.model_spec.signature_name = signature_name
    for alias, value in inputs.items():
        request.inputs[alias].CopyFrom(tf.make_tensor_proto(value))
    return record


def write_warmup(version_dir, records):
    """`records` (protos, or raw bytes) into the version's TFRecord warm-up file."""
    os.makedirs(os.path.join(version_dir, "assets.extra"), exist_ok=True)
    with tf.io.TFRecordWriter(os.path.join(version_dir, "assets.extra", "tf_serving_warmup_requests")) as writer:
        for record in records:
            writer.write(record if isinstance(record, bytes) else record.SerializeToString())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Counting models (version 1, 2) to copy into base paths."""
    root = tmp_path_factory.mktemp("counting")
    for version in (1, 2):
        save_counting(root / str(version), version)
    return root


def publish(saved, base, version, records=None):
    """Copies a saved version beside `base`, adds its warm-up records, then renames it in (an atomic publish)."""
    staging = base.parent / f".staging-{version}"
    shutil.copytree(saved / str(version), staging)
    if records is not None:
        write_warmup(staging, records)
    os.makedirs(base, exist_ok=True)
    os.rename(staging, base / str(version))


class Loads:
    """A `ModelManager` loader that keeps every servable it made (a failed warm-up's too)."""

    def __init__(self):
        self.servables = []

    def __call__(self, name, version, path):
        self.servables.append(Servable(name, version, path))
        return self.servables[-1]


def counts(servable):
    _, out = servable.predict("count", {"x": np.zeros([1], np.float32)})
    return int(out["calls"][0]), int(out["warm_calls"][0])


def start_manager(base, **options):
    loads = Loads()
    manager = ModelManager(poll_wait_seconds=0, loader=loads, **options)
    try:
        manager.start(config_lib.single_model_config("m", str(base)))
    except ServingError:
        pass  # the model did not become available: its status says why
    return manager, loads


def get_state(name):
    return get_model_status_pb2.ModelVersionStatus.State.Value(name)


def status(manager, version):
    (entry,) = manager.model_status("m", version).model_version_status
    return entry.state, Code(entry.status.error_code), entry.status.error_message


RECORDS = [predict_record("serving_default", x=np.ones([1], np.float32)),
           predict_record("serving_default", x=np.ones([4], np.float32)),
           predict_record("warm", seconds=np.zeros([2], np.float32))]


@pytest.mark.parametrize("options, runs", [({}, 1), ({"num_request_iterations_for_warmup": 3}, 3),
                                           ({"enable_model_warmup": False}, 0)])
def test_every_record_runs_before_the_version_is_available(tmp_path, saved, options, runs):
    publish(saved, tmp_path / "m", 1, RECORDS)
    manager, loads = start_manager(tmp_path / "m", **options)
    try:
        assert status(manager, 1) == (get_state("AVAILABLE"), Code.OK, "")
        (servable,) = loads.servables
        assert manager.get_servable("m") is servable
        assert counts(servable) == (2 * runs, runs)  # serving_default twice, warm once, per run
    finally:
        manager.stop()


def test_a_thousand_records_load_and_a_thousand_and_one_fail_after_running(tmp_path, saved):
    one = predict_record("serving_default", x=np.ones([1], np.float32))
    publish(saved, tmp_path / "ok", 1, [one] * 1000)
    publish(saved, tmp_path / "over", 1, [one] * 1001)
    manager, loads = start_manager(tmp_path / "ok")
    try:
        assert status(manager, 1)[:2] == (get_state("AVAILABLE"), Code.OK)
        assert counts(loads.servables[0]) == (1000, 0)
    finally:
        manager.stop()
    manager, loads = start_manager(tmp_path / "over", max_num_load_retries=0)
    try:
        path = os.path.join(tmp_path, "over", "1", "assets.extra", "tf_serving_warmup_requests")
        assert status(manager, 1) == (get_state("END"), Code.INVALID_ARGUMENT,
                                      f"Number of warmup records exceeds the maximum (1000) at {path}")
        assert counts(loads.servables[0]) == (1001, 0)  # TF Serving counts a record after running it
    finally:
        manager.stop()


def _session_run_record():
    record = prediction_log_pb2.PredictionLog()
    record.session_run_log.SetInParent()
    return record


FAILURES = {
    "unknown signature": ([predict_record("nope", x=np.ones([1], np.float32))],
                          Code.FAILED_PRECONDITION, 'Serving signature key "nope" not found.'),
    "wrong dtype": ([predict_record("serving_default", x=np.ones([1], np.int32))],
                    Code.INVALID_ARGUMENT, "Expects arg[0] to be float but int32 is provided"),
    "not a PredictionLog": ([b"\xff\xff\xff"], Code.INVALID_ARGUMENT, "Failed to parse warmup record: "),
    "session_run_log": ([_session_run_record()], Code.UNIMPLEMENTED, "Unsupported log_type for warmup: 5"),
}


@pytest.mark.parametrize("case", sorted(FAILURES))
def test_a_failing_record_fails_the_load_with_its_status_and_is_retried(tmp_path, saved, case):
    records, code, message = FAILURES[case]
    ok = predict_record("serving_default", x=np.ones([1], np.float32))
    publish(saved, tmp_path / "m", 1, [ok] + records + [ok])
    manager, loads = start_manager(tmp_path / "m", max_num_load_retries=1, load_retry_interval_seconds=0)
    try:
        state, got_code, got_message = status(manager, 1)
        assert (state, got_code) == (get_state("END"), code) and got_message.startswith(message), got_message
        assert len(loads.servables) == 2  # the load, warm-up included, retried once
        assert all(counts(servable) == (1, 0) for servable in loads.servables)  # stopped at the failing record
        with pytest.raises(ServingError, match="Servable not found"):
            manager.get_servable("m")
    finally:
        manager.stop()


def test_a_file_that_is_not_a_tfrecord_is_data_loss(tmp_path, saved):
    publish(saved, tmp_path / "m", 1)
    os.makedirs(tmp_path / "m" / "1" / "assets.extra")
    (tmp_path / "m" / "1" / "assets.extra" / "tf_serving_warmup_requests").write_bytes(b"not a TFRecord file at all")
    manager, _ = start_manager(tmp_path / "m", max_num_load_retries=0)
    try:
        state, code, message = status(manager, 1)
        assert (state, code) == (get_state("END"), Code.DATA_LOSS)
        assert message.endswith(". Please verify your warmup data is in TFRecord format."), message
    finally:
        manager.stop()


def test_classify_regress_and_multi_inference_records_run(tmp_path):
    examples = [{"x": 0.25}, {"x": 0.5}]
    model_input = classification_pb2.ClassificationRequest().input
    for example in examples:
        model_input.example_list.examples.add().features.feature["x"].float_list.value.append(example["x"])
    classify, regress, multi, wrong = (prediction_log_pb2.PredictionLog() for _ in range(4))
    classify.classify_log.request.input.CopyFrom(model_input)
    regress.regress_log.request.model_spec.signature_name = "regress"
    regress.regress_log.request.input.CopyFrom(model_input)
    multi.multi_inference_log.request.input.CopyFrom(model_input)
    for signature, method in (("serving_default", "tensorflow/serving/classify"),
                              ("regress", "tensorflow/serving/regress")):
        task = multi.multi_inference_log.request.tasks.add()
        task.model_spec.signature_name, task.method_name = signature, method
    assert isinstance(multi.multi_inference_log.request, inference_pb2.MultiInferenceRequest)
    wrong.classify_log.request.CopyFrom(classification_pb2.ClassificationRequest(input=model_input))
    wrong.classify_log.request.model_spec.signature_name = "regress"
    assert isinstance(regress.regress_log.request, regression_pb2.RegressionRequest)

    models.save_classifier(tmp_path / "good" / "1")
    write_warmup(tmp_path / "good" / "1", [classify, regress, multi])
    models.save_classifier(tmp_path / "bad" / "1")
    write_warmup(tmp_path / "bad" / "1", [classify, wrong])
    manager, _ = start_manager(tmp_path / "good")
    try:
        assert status(manager, 1)[:2] == (get_state("AVAILABLE"), Code.OK)
    finally:
        manager.stop()
    manager, _ = start_manager(tmp_path / "bad", max_num_load_retries=0)
    try:
        assert status(manager, 1) == (get_state("END"), Code.INVALID_ARGUMENT,
                                      "Expected classification signature method_name to be "
                                      "tensorflow/serving/classify. Was: tensorflow/serving/regress")
    finally:
        manager.stop()


def _clients(url, stop, results, count=3):
    """`count` REST clients sending one request after another until `stop`; `results` gets
    (start, end, version or None, warmed or error) per request."""

    def client():
        rest = serving.Client(url, timeout=60)
        while not stop.is_set():
            start = time.monotonic()
            try:
                out = rest.predict("m", [1.0])
                results.append((start, time.monotonic(), int(out["version"][0]), int(out["warmed"][0])))
            except Exception as error:  # recorded: the test asserts there are none
                results.append((start, time.monotonic(), None, repr(error)))

    threads = [threading.Thread(target=client) for _ in range(count)]
    for thread in threads:
        thread.start()
    return threads


WARM_SECONDS = 2.0


def test_hot_swap_serves_the_old_version_until_the_new_one_is_warm(tmp_path, saved):
    base = tmp_path / "m"
    publish(saved, base, 1)
    # Version 2's warm-up takes WARM_SECONDS (a busy wait), then runs serving_default once.
    slow = [predict_record("warm", seconds=np.full([1], WARM_SECONDS, np.float32)),
            predict_record("serving_default", x=np.ones([2], np.float32))]
    with serving.Server(model_name="m", model_base_path=str(base), file_system_poll_wait_seconds=0.1,
                        access_log=None) as server:
        stop, results = threading.Event(), []
        threads = _clients(server.rest_url, stop, results)
        try:
            time.sleep(0.5)
            published = time.monotonic()
            publish(saved, base, 2, slow)
            deadline = published + 60
            while not any(version == 2 for _, _, version, _ in list(results)):
                assert time.monotonic() < deadline, "version 2 never answered"
                time.sleep(0.1)
            time.sleep(0.5)  # requests on version 2 for a while
        finally:
            stop.set()
            for thread in threads:
                thread.join()
        client = serving.Client(server.rest_url)
        states = {int(e["version"]): e["state"] for e in client.status("m")["model_version_status"]}
    assert states == {1: "END", 2: "AVAILABLE"}
    assert [r for r in results if r[2] is None] == []  # no request failed during the swap
    assert {r[2] for r in results} == {1, 2}
    # Version 2 answered only after its warm-up had finished: its `warm` signature had run, and not before the
    # warm-up's own duration had passed since the publish.
    on_two = [r for r in results if r[2] == 2]
    assert all(warmed == 1 for _, _, _, warmed in on_two)
    assert min(end for _, end, _, _ in on_two) >= published + WARM_SECONDS
    # Meanwhile version 1 kept answering; no request started after version 2's first answer went to version 1.
    assert any(start >= published + WARM_SECONDS / 2 for start, _, version, _ in results if version == 1)
    first_two = min(end for _, end, _, _ in on_two)
    assert all(version == 2 for start, _, version, _ in results if start > first_two)


def test_a_failed_warm_up_keeps_the_old_version_serving(tmp_path, saved):
    base = tmp_path / "m"
    publish(saved, base, 1)
    with serving.Server(model_name="m", model_base_path=str(base), file_system_poll_wait_seconds=0.1,
                        max_num_load_retries=0, access_log=None) as server:
        client = serving.Client(server.rest_url)
        publish(saved, base, 2, [predict_record("nope", x=np.ones([1], np.float32))])
        deadline = time.monotonic() + 60
        while not any(e["version"] == "2" and e["state"] == "END" for e in client.status("m")["model_version_status"]):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        entries = {int(e["version"]): e for e in client.status("m")["model_version_status"]}
        assert entries[1]["state"] == "AVAILABLE"
        assert entries[2]["status"] == {"error_code": "FAILED_PRECONDITION",
                                        "error_message": 'Serving signature key "nope" not found.'}
        assert client.predict("m", [1.0])["version"].tolist() == [1]


def test_warm_up_runs_through_the_batcher_when_batching_is_on(tmp_path, saved):
    publish(saved, tmp_path / "m", 1, RECORDS)
    with serving.Server(model_name="m", model_base_path=str(tmp_path / "m"), file_system_poll_wait_seconds=0,
                        enable_batching=True, access_log=None) as server:
        servable = server.manager.get_servable("m")
        assert type(servable).__name__ == "BatchingServable"
        assert counts(servable) == (2, 1)  # the records ran on the version before it served
        assert serving.Client(server.rest_url).predict("m", [2.0])["y"].tolist() == [2.0]


@pytest.mark.parametrize("flags, runs", [([], 1), (["--num_request_iterations_for_warmup", "3"], 3),
                                         (["--enable_model_warmup=false"], 0), (["--enable_model_warmup"], 1)])
def test_tfformer_serve_flags_reach_the_manager(tmp_path, saved, monkeypatch, flags, runs):
    from tfformer import cli

    publish(saved, tmp_path / "m", 1, RECORDS)
    seen = []

    def run_server(**options):  # the server `tfformer serve` would run, started and stopped here
        with serving.Server(**{**options, "port": 0, "rest_api_port": 0, "access_log": None}) as server:
            seen.append(counts(server.manager.get_servable("m")))
        return 0

    monkeypatch.setattr(serving, "run_server", run_server)
    assert cli.main(["serve", "--model_name", "m", "--model_base_path", str(tmp_path / "m"), *flags]) == 0
    assert seen == [(2 * runs, runs)]


def test_a_negative_warmup_iteration_count_stops_tfformer_serve(tmp_path, capsys):
    from tfformer import cli

    code = cli.main(["serve", "--model_base_path", str(tmp_path), "--num_request_iterations_for_warmup", "-1"])
    assert code == 2
    assert "num_request_iterations_for_warmup" in capsys.readouterr().err
