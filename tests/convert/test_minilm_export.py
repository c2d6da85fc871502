"""all-MiniLM-L6-v2 exported: SavedModel (loaded like TF Serving does) and TFLite agree with Keras.

Exported once per module through `tfformer export all-minilm-l6-v2 --format all`, so the CLI path is the one
tested. The SavedModel runs in a fresh process that imports only tensorflow and tensorflow_text
(tests/export/fresh_process.py); the TFLite files run with `ai_edge_litert`.
"""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from ai_edge_litert.interpreter import Interpreter

from tfformer import cli, export, models

FIXTURE = pathlib.Path(__file__).parents[1] / "fixtures" / "minilm_reference.npz"
FRESH = pathlib.Path(__file__).parents[1] / "export" / "fresh_process.py"


def _cosine(a, b):
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def _run_tflite(path, inputs):
    runner = Interpreter(model_path=str(path)).get_signature_runner("predict_ids")
    return runner(**inputs)


@pytest.fixture(scope="module")
def sentences():
    return json.loads(np.load(FIXTURE)["sentences_json"].tobytes())


@pytest.fixture(scope="module")
def minilm():
    return models.from_preset("all-minilm-l6-v2")


@pytest.fixture(scope="module")
def keras_embeddings(minilm, sentences):
    return minilm.encode(sentences)


@pytest.fixture(scope="module")
def tokens(minilm, sentences):
    return minilm.tokenize(sentences)  # one padded batch (the long sentence makes it 256 wide)


@pytest.fixture(scope="module")
def exported(tmp_path_factory, minilm):
    out = tmp_path_factory.mktemp("export") / "minilm"
    with pytest.MonkeyPatch.context() as patch:  # the CLI gets the already loaded preset (saves a load)
        patch.setattr(models, "from_preset", lambda name: minilm if name == "all-minilm-l6-v2" else None)
        assert cli.main(["export", "all-minilm-l6-v2", "--format", "all", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def fresh_process(exported, sentences, tokens, tmp_path_factory):
    """Starts the SavedModel's fresh process at once; it runs while the TFLite tests do."""
    tmp = tmp_path_factory.mktemp("fresh")
    request = {
        # fresh_process.py encodes "bytes" values with latin-1: send the UTF-8 bytes that way.
        "serving_default": {"text": [[s.encode("utf-8").decode("latin-1") for s in sentences], "bytes"]},
        "predict_ids": {name: [value.tolist(), "int32"] for name, value in tokens.items()},
    }
    (tmp / "request.json").write_text(json.dumps(request))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    with open(tmp / "stderr.txt", "w") as stderr:  # a file, not a pipe: a full pipe would block the child
        proc = subprocess.Popen(
            [sys.executable, str(FRESH), str(exported / "1"), str(tmp / "request.json"), str(tmp / "out.npz")],
            stdout=subprocess.DEVNULL, stderr=stderr, env=env,
        )
    yield proc, tmp
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def fresh_outputs(fresh_process):
    proc, tmp = fresh_process
    assert proc.wait(timeout=300) == 0, (tmp / "stderr.txt").read_text()[-3000:]
    return dict(np.load(tmp / "out.npz"))


def test_cli_export_writes_a_servable_version_and_a_tflite_file(exported, fresh_process):
    assert sorted(os.listdir(exported)) == ["1", "model.tflite"]
    assert os.path.exists(exported / "1" / "saved_model.pb")
    details = Interpreter(model_path=str(exported / "model.tflite")).get_signature_list()
    assert details == {"predict_ids": {"inputs": ["padding_mask", "token_ids"], "outputs": ["embedding"]}}


@pytest.fixture(scope="module")
def tflite_float32(exported, tokens):
    return _run_tflite(exported / "model.tflite", tokens)["embedding"]


def test_tflite_float32_matches_keras(exported, tflite_float32, keras_embeddings, tokens):
    # Measured: 3.7e-07 (one padded batch of every fixture sentence).
    assert np.abs(tflite_float32 - keras_embeddings).max() < 1e-4
    # Batch 1 without padding, as on a device: the same vectors.
    runner = Interpreter(model_path=str(exported / "model.tflite")).get_signature_runner("predict_ids")
    for i in (0, 5):
        length = int(tokens["padding_mask"][i].sum())
        single = runner(**{name: value[i : i + 1, :length] for name, value in tokens.items()})["embedding"]
        assert np.abs(single[0] - keras_embeddings[i]).max() < 1e-4


def test_dynamic_range_tflite_keeps_cosine_to_float32(tmp_path_factory, minilm, exported, tokens, tflite_float32):
    path = export.tflite(minilm, str(tmp_path_factory.mktemp("dynamic") / "dynamic.tflite"), quantize="dynamic")
    assert os.path.getsize(path) < 0.3 * os.path.getsize(exported / "model.tflite")  # measured 23.7 MB vs 90.4 MB
    quantized = _run_tflite(path, tokens)["embedding"]
    cosine = _cosine(quantized, tflite_float32)
    # Measured: min 0.9926 (the empty sentence, [CLS] [SEP]); most are above 0.996.
    assert cosine.min() >= 0.99, cosine


def test_saved_model_text_signature_matches_keras_in_a_fresh_process(fresh_outputs, keras_embeddings):
    served = fresh_outputs["serving_default/embedding"]
    assert served.shape == keras_embeddings.shape == (len(keras_embeddings), 384)
    # Measured: 2.5e-07 (tokenizer and model inside the graph, no tfformer import).
    assert np.abs(served - keras_embeddings).max() < 1e-5


def test_saved_model_ids_signature_matches_keras(fresh_outputs, keras_embeddings):
    # Measured: 2.5e-07.
    assert np.abs(fresh_outputs["predict_ids/embedding"] - keras_embeddings).max() < 1e-5
