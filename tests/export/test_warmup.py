"""`export.saved_model` writes TF Serving's warm-up file, `assets.extra/tf_serving_warmup_requests`: a TFRecord of
`tensorflow_serving.apis.prediction_log_pb2.PredictionLog` records, read back here with TensorFlow's TFRecord reader
and that proto (not tfformer's reader). Every exported signature gets a record per warm-up batch size, whose inputs
are the signature's own (names and dtypes from the loaded SavedModel) and run on it; a causal LM's `generate_text`
gets one per compiled decode length. `tfformer serve` replays them all before the version is AVAILABLE.
"""

import os

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_text  # noqa: F401  (the exported graphs use TF-Text ops)
from tensorflow.core.framework import tensor_shape_pb2, types_pb2
from tensorflow.core.protobuf import meta_graph_pb2
from tensorflow_serving.apis import get_model_status_pb2, prediction_log_pb2

from tfformer import convert, export, models
from tfformer.data import audio
from tfformer.export import warmup
from tfformer.export.saved_model import decode_sizes
from tfformer.serving import config as config_lib
from tfformer.serving.manager import ModelManager
from tfformer.serving.servable import Servable

WARMUP = os.path.join("assets.extra", "tf_serving_warmup_requests")


def parse_records(version_dir):
    """The warm-up file's records, parsed with TF Serving's `PredictionLog`."""
    raw = [record.numpy() for record in tf.data.TFRecordDataset(os.path.join(version_dir, WARMUP))]
    return [prediction_log_pb2.PredictionLog.FromString(record) for record in raw]


def _encoder():
    vocabulary = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "on", "mat", ".", "##s"]
    config = models.TransformerConfig(
        architecture="encoder", vocabulary_size=len(vocabulary), hidden_dim=16, num_heads=2, intermediate_dim=32,
        num_encoder_layers=1, num_decoder_layers=0, dropout=0.0, max_sequence_length=32, activation="gelu",
        position="learned", scale_embeddings=False, num_segments=2)
    return models.SentenceEncoder(models.build_encoder(config), tokenizer=convert.BertTokenizer(vocabulary,
                                                                                               max_length=16))


CAP = 20  # the causal LM's max_new_tokens: decode loops for 16 and 20 new tokens


@pytest.fixture(scope="module")
def exports(tmp_path_factory, seq2seq, causal_lm, tokenizer):
    root = tmp_path_factory.mktemp("warmup_exports")
    return {
        "seq2seq": (export.saved_model(seq2seq, str(root / "seq2seq"), tokenizer=tokenizer, max_new_tokens=12),
                    tokenizer.vocabulary_size),
        "causal_lm": (export.saved_model(causal_lm, str(root / "lm"), tokenizer=tokenizer, max_new_tokens=CAP),
                      tokenizer.vocabulary_size),
        "encoder": (export.saved_model(_encoder(), str(root / "encoder")), 12),
    }


@pytest.mark.parametrize("kind", ["seq2seq", "causal_lm", "encoder"])
def test_every_signature_has_a_record_per_batch_size_that_runs_on_it(exports, kind):
    path, vocabulary_size = exports[kind]
    records = parse_records(path)
    loaded = tf.saved_model.load(path)
    signatures = dict(loaded.signatures)
    assert 0 < len(records) <= 1000
    seen = {}
    for record in records:
        assert record.WhichOneof("log_type") == "predict_log"
        request = record.predict_log.request
        key = request.model_spec.signature_name
        function = signatures[key]
        specs = function.structured_input_signature[1]  # {alias: TensorSpec}
        inputs = {alias: tf.make_ndarray(proto) for alias, proto in request.inputs.items()}
        assert sorted(inputs) == sorted(specs)
        for alias, value in inputs.items():
            assert tf.as_dtype(request.inputs[alias].dtype) == specs[alias].dtype
            assert specs[alias].shape.is_compatible_with(value.shape)
            if value.dtype == np.int32 and value.ndim == 2 and alias != "padding_mask":
                assert 0 <= value.min() and value.max() < vocabulary_size  # token ids of the model
        rows = len(next(iter(inputs.values())))
        outputs = function(**{alias: tf.constant(value) for alias, value in inputs.items()})
        assert all(output.shape[0] == rows for output in outputs.values())
        seen.setdefault(key, []).append((rows, tuple(inputs.get("max_new_tokens", [])[:1])))
    assert set(seen) == set(signatures)  # every exported signature, nothing else
    for key, entries in seen.items():
        assert sorted({rows for rows, _ in entries}) == list(warmup.BATCH_SIZES)
    if kind == "causal_lm":  # every compiled decode length alone, the shortest at the larger batch
        assert seen["generate_text"] == [(1, (16,)), (1, (CAP,)), (8, (16,))]
        assert decode_sizes(CAP) == [16, CAP]


def test_warmup_batch_sizes_argument(tmp_path):
    encoder = _encoder()
    path = export.saved_model(encoder, str(tmp_path / "none"), warmup_batch_sizes=())
    assert not os.path.exists(os.path.join(path, "assets.extra"))
    path = export.saved_model(encoder, str(tmp_path / "three"), warmup_batch_sizes=(1, 2, 3))
    records = parse_records(path)
    assert [(r.predict_log.request.model_spec.signature_name,
             tf.make_ndarray(next(iter(r.predict_log.request.inputs.values()))).shape[0]) for r in records] == [
        (key, rows) for rows in (1, 2, 3) for key in ("serving_default", "predict_ids")]
    for bad in ((0,), (1, "8"), (1.5,), 8):
        with pytest.raises(ValueError, match="warmup_batch_sizes"):
            export.saved_model(encoder, str(tmp_path / "bad"), warmup_batch_sizes=bad)
        assert not os.path.exists(tmp_path / "bad" / "1")


def _signature(inputs):
    signature = meta_graph_pb2.SignatureDef(method_name="tensorflow/serving/predict")
    for alias, (dtype, dims) in inputs.items():
        info = signature.inputs[alias]
        info.dtype = dtype
        info.tensor_shape.CopyFrom(tensor_shape_pb2.TensorShapeProto(
            dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=size) for size in dims]))
    return signature


def test_speech_records_hold_a_waveform_and_its_log_mel_features():
    """Whisper's signatures (as `_speech_endpoints` declares them): the features record holds the log-mel features
    of the waveform record's tone, computed with the in-graph front end."""
    signatures = {
        "serving_default": _signature({"waveform": (types_pb2.DT_FLOAT, [-1, -1]), "lengths": (types_pb2.DT_INT32,
                                                                                               [-1])}),
        "generate_ids": _signature({"input_features": (types_pb2.DT_FLOAT, [-1, 3000, 80])}),
        "predict_ids": _signature({"input_features": (types_pb2.DT_FLOAT, [-1, 3000, 80]),
                                   "decoder_token_ids": (types_pb2.DT_INT32, [-1, -1])}),
    }
    records = warmup.requests(signatures, vocabulary_size=51864, batch_sizes=(1, 3))
    inputs = [(r.predict_log.request.model_spec.signature_name,
               {alias: tf.make_ndarray(proto) for alias, proto in r.predict_log.request.inputs.items()})
              for r in records]
    assert [(key, len(next(iter(values.values())))) for key, values in inputs] == [
        (key, rows) for rows in (1, 3) for key in ("serving_default", "generate_ids", "predict_ids")]
    waveform, lengths = inputs[3][1]["waveform"], inputs[3][1]["lengths"]
    assert waveform.shape == (3, audio.SAMPLE_RATE) and lengths.tolist() == [audio.SAMPLE_RATE] * 3
    assert 0.05 < np.abs(waveform).max() <= 1.0  # audible, in range
    features, _ = audio.log_mel_spectrogram(waveform, lengths)
    np.testing.assert_allclose(inputs[4][1]["input_features"], features.numpy(), atol=1e-6)
    assert inputs[5][1]["decoder_token_ids"].shape == (3, warmup.IDS_LENGTH)
    with pytest.raises(ValueError, match="TF Serving accepts at most 1000"):  # 3 signatures x 334 batch sizes
        warmup.requests(signatures, vocabulary_size=51864, batch_sizes=tuple(range(1, 335)))
    with pytest.raises(ValueError, match="No warm-up value for input 'image'"):
        warmup.requests({"serving_default": _signature({"image": (types_pb2.DT_UINT8, [-1, 4, 4, 3])})}, 10)


class RecordingServable(Servable):
    """A servable that records (signature, rows) of every predict call, in order."""

    calls = []

    def predict(self, signature_name, inputs, output_filter=()):
        RecordingServable.calls.append((signature_name, len(next(iter(inputs.values())))))
        return super().predict(signature_name, inputs, output_filter)


def test_the_server_replays_an_exports_records_before_it_serves(exports):
    path, _ = exports["seq2seq"]
    expected = [(r.predict_log.request.model_spec.signature_name,
                 tf.make_ndarray(next(iter(r.predict_log.request.inputs.values()))).shape[0])
                for r in parse_records(path)]
    RecordingServable.calls = []
    manager = ModelManager(poll_wait_seconds=0, loader=RecordingServable)
    try:
        manager.start(config_lib.single_model_config("translator", os.path.dirname(path)))
        (entry,) = manager.model_status("translator").model_version_status
        assert entry.state == get_model_status_pb2.ModelVersionStatus.AVAILABLE
        assert RecordingServable.calls == expected  # every record ran, in file order, before AVAILABLE
        _, out = manager.get_servable("translator").predict("serving_default", {
            "text": np.array([b"open the file"], object)})
        assert out["translation"].shape == (1,)
    finally:
        manager.stop()
