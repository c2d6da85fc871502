"""Load test: 2,000 predict requests at concurrency 16 against `tfformer serve` (loopback only), with a new
version published into the base path halfway through.

The model is a tiny translation Transformer exported with `tfformer.export.saved_model` (raw text in, text
out, SentencePiece and the decode loop inside the graph); each request translates 4 sentences. Version 1 is
forced to emit one piece and version 2 another (zero output kernel, one-hot output bias), so every answer
says which version computed it. Version 2 is exported next to the base path before the run (with a TF
Serving warmup record) and moved in with one `os.rename` when request 1,000 is sent: the atomic publish
the exporter itself ends with (exporting it only then would need longer than the remaining requests take).

Requirements: no failed request, and once a request has been answered by version 2, every request started
after it is answered by version 2. Requests/second and p50/p99 latency are printed and written to
`load_results.json` in the test's temporary directory.
"""

import http.client
import json
import os
import threading
import time
import urllib.parse

import numpy as np
import tensorflow as tf
from tensorflow_serving.apis import prediction_log_pb2

from tests.serving.conftest import spawn_cli_server, wait_for_cli_server

REQUESTS = 2000
CONCURRENCY = 16
TEXTS = ["hello world", "open the file", "save the world", "close the window"]  # one request: 4 sentences
MAX_NEW_TOKENS = 12
CORPUS = ["hello world", "open the file", "close the window", "the file is open", "save the world"] * 20


def _translators():
    """(tokenizer, make_version(n)): tiny translators; version n always emits its own piece."""
    import keras

    from tfformer.data import SubwordTokenizer
    from tfformer.models import TransformerConfig, build_seq2seq

    tokenizer = SubwordTokenizer.train(CORPUS, vocabulary_size=40)
    pieces = [int(tokenizer.tokenize(tf.constant([word])).flat_values[-1]) for word in ("hello", "world")]
    assert pieces[0] != pieces[1]

    def make_version(version):
        config = TransformerConfig(vocabulary_size=tokenizer.vocabulary_size, hidden_dim=16, num_heads=2,
                                   intermediate_dim=32, num_encoder_layers=1, num_decoder_layers=1, dropout=0.0,
                                   max_sequence_length=32, tie_embeddings=False)
        keras.utils.set_random_seed(version)
        model = build_seq2seq(config)
        projection = model.get_layer("output_projection")
        kernel, bias = projection.get_weights()
        bias = np.full_like(bias, -10.0)
        bias[pieces[version - 1]] = 10.0
        projection.set_weights([np.zeros_like(kernel), bias])
        return model

    return tokenizer, make_version


def _write_warmup(version_dir):
    """`assets.extra/tf_serving_warmup_requests`: one Predict request, replayed when the version loads."""
    os.makedirs(os.path.join(version_dir, "assets.extra"), exist_ok=True)
    record = prediction_log_pb2.PredictionLog()
    request = record.predict_log.request
    request.model_spec.name = "translator"
    request.inputs["text"].CopyFrom(tf.make_tensor_proto(TEXTS))
    with tf.io.TFRecordWriter(os.path.join(version_dir, "assets.extra", "tf_serving_warmup_requests")) as writer:
        writer.write(record.SerializeToString())


def _post(url, path, body, timeout=120):
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    try:
        connection.request("POST", path, body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def test_load_with_a_new_version_halfway(tmp_path):
    from tfformer import export

    tokenizer, make_version = _translators()
    base, staging = tmp_path / "translator", tmp_path / "staging"
    export.saved_model(make_version(1), str(base), version=1, tokenizer=tokenizer, max_new_tokens=MAX_NEW_TOKENS)
    staged = export.saved_model(make_version(2), str(staging), version=2, tokenizer=tokenizer,
                                max_new_tokens=MAX_NEW_TOKENS)
    _write_warmup(staged)
    config = tmp_path / "models.config"
    config.write_text(f"model_config_list {{ config {{ name: 'translator' base_path: '{base}' "
                      "model_platform: 'tensorflow' } }")
    log_path = tmp_path / "serve.log"
    process = spawn_cli_server(config, log_path, "--file_system_poll_wait_seconds", "0.1", "--access_log", "")
    try:
        _, rest_url = wait_for_cli_server(process, log_path)
        url = urllib.parse.urlsplit(rest_url)
        path, body = "/v1/models/translator:predict", json.dumps({"instances": TEXTS}).encode()
        status, reply = _post(url, path, body)  # the first call of a function is slow: not measured
        assert status == 200
        answers = {tuple(reply["predictions"]): 1}
        results, published = [None] * REQUESTS, {}
        counter, lock = iter(range(REQUESTS)), threading.Lock()

        def worker():
            connection = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
            while True:
                with lock:
                    index = next(counter, None)
                if index is None:
                    break
                if index == REQUESTS // 2:
                    published["time"] = time.perf_counter()
                    os.rename(staged, base / "2")  # the publish: one atomic rename into the base path
                start = time.perf_counter()
                try:
                    connection.request("POST", path, body, {"Content-Type": "application/json"})
                    response = connection.getresponse()
                    reply = json.loads(response.read())
                    answer = tuple(reply["predictions"]) if response.status == 200 else None
                except Exception as error:  # recorded as a failure
                    answer, reply = None, repr(error)
                    connection.close()
                    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
                results[index] = (start, time.perf_counter(), answer, reply)
            connection.close()

        began = time.perf_counter()
        threads = [threading.Thread(target=worker) for _ in range(CONCURRENCY)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.perf_counter() - began
        status, reply = _post(url, "/v1/models/translator/versions/2:predict", body)
        assert status == 200, reply
        answers[tuple(reply["predictions"])] = 2
    finally:
        process.terminate()
        process.wait(timeout=60)

    assert len(answers) == 2, "the two versions must answer differently"
    versions = [answers.get(answer) for _, _, answer, _ in results]
    failures = [result for result, version in zip(results, versions) if version is None]
    latencies = np.array([end - start for start, end, _, _ in results]) * 1000
    first_v2 = min((end for (_, end, _, _), version in zip(results, versions) if version == 2), default=None)
    after_switch = [version for (start, _, _, _), version in zip(results, versions)
                    if first_v2 is not None and start > first_v2]
    summary = {
        "requests": REQUESTS, "concurrency": CONCURRENCY, "sentences_per_request": len(TEXTS),
        "max_new_tokens": MAX_NEW_TOKENS, "seconds": round(elapsed, 3),
        "requests_per_second": round(REQUESTS / elapsed, 1),
        "p50_ms": round(float(np.percentile(latencies, 50)), 2),
        "p99_ms": round(float(np.percentile(latencies, 99)), 2),
        "failures": len(failures),
        "answered_by_version_1": versions.count(1), "answered_by_version_2": versions.count(2),
        "seconds_from_publish_to_first_version_2_answer": round(first_v2 - published["time"], 3) if first_v2 else None,
    }
    (tmp_path / "load_results.json").write_text(json.dumps(summary, indent=2))
    print("\nload test:", json.dumps(summary))
    assert not failures, failures[:3]
    assert summary["answered_by_version_2"] > 0 and after_switch, log_path.read_text()[-2000:]
    assert set(after_switch) == {2}, "a request started after the switch was answered by version 1"
    assert all(start >= published["time"] for (start, _, _, _), version in zip(results, versions) if version == 2)
