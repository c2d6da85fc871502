"""Whisper tiny.en exported: a SavedModel (waveform + lengths in, transcripts out, loaded without tfformer) and a
TFLite encoder + KV-cached decode step (float32 and dynamic-range int8) run by `tfformer.edge.Transcriber`.

Against independent numbers: the fixture manifest's transcripts, token ids and word error rate, recorded from
faster-whisper/CTranslate2 in float32 (tools/make_whisper_fixture.py); the Keras model's own greedy ids
(`generation.speech.transcribe_ids`) for the float32 file; the in-graph TensorFlow front end
(`data.audio.log_mel_spectrogram`) for the host's numpy features. The TFLite files hold a cache of `MAX_LENGTH`
positions (every fixture transcript fits), converted once per module.
"""

import json
import os

import numpy as np
import pytest

from tests.harness import saved_model_in_fresh_process
from tests.speech import SPEECH, asr, manifest, needs_wheel, waveforms  # noqa: F401 (fixtures)
from tfformer.training.metrics import word_error_rate

pytestmark = needs_wheel
MAX_LENGTH = 128  # cache positions of the TFLite files: the prompt plus up to 126 new ids


@pytest.fixture(scope="module")
def exported(asr, tmp_path_factory):
    from tfformer import export

    return export.saved_model(asr, str(tmp_path_factory.mktemp("whisper") / "asr"))


@pytest.fixture(scope="module")
def tflite_files(asr, tmp_path_factory):
    from tfformer import export

    root = tmp_path_factory.mktemp("whisper_tflite")
    return {quantize or "float32": export.tflite_decoder(asr, str(root / f"{quantize or 'float32'}.tflite"),
                                                         max_length=MAX_LENGTH, quantize=quantize)
            for quantize in (None, "dynamic")}


@pytest.fixture(scope="module")
def transcribers(asr, tflite_files):
    from tfformer import edge

    return {name: edge.Transcriber(path, tokenizer=asr.preprocessor) for name, path in tflite_files.items()}


@pytest.fixture(scope="module")
def edge_ids(transcribers, waveforms):
    """{file: greedy ids of every fixture clip}, host features, end id included."""
    return {name: [t.transcribe_ids(t.features(w)) for w in waveforms] for name, t in transcribers.items()}


def _batch(waveforms):
    lengths = [len(w) for w in waveforms]
    batch = np.zeros((len(waveforms), max(lengths)), np.float32)  # (B, N), right-padded
    for row, waveform in zip(batch, waveforms):
        row[:len(waveform)] = waveform
    return batch, lengths


def _until_end(ids, end_id):
    ids = [int(i) for i in ids]
    return ids[:ids.index(end_id)] if end_id in ids else ids


# === SavedModel ===
def test_saved_model_transcribes_waveforms_without_tfformer(exported, manifest, waveforms, asr, tmp_path):
    """Three clips of different lengths in one batch plus an empty row: the manifest's (CTranslate2's)
    transcripts and ids, from a process that imports only tensorflow and tensorflow_text."""
    from tfformer.data import audio

    clips = [0, 5, 11]
    batch, lengths = _batch([waveforms[i] for i in clips] + [waveforms[0][:0]])
    features, _ = audio.log_mel_spectrogram(batch[:1, :lengths[0]])  # (1, 3000, 80)
    request = {
        "serving_default": {"waveform": [batch.tolist(), "float32"], "lengths": [lengths, "int32"]},
        "generate_ids": {"input_features": [features.numpy().tolist(), "float32"]},
    }
    out = saved_model_in_fresh_process(exported, request, tmp_path)
    texts = [t.decode("utf-8") for t in out["serving_default/text"]]
    assert texts == [manifest["clips"][i]["transcript"] for i in clips] + [""]
    ids = out["generate_ids/token_ids"]
    assert ids.shape == (1, asr.config.max_sequence_length - len(asr.prompt))
    assert _until_end(ids[0], asr.end_id) == manifest["clips"][0]["token_ids"]
    assert set(ids[0, len(manifest["clips"][0]["token_ids"]):].tolist()) == {asr.end_id}


def test_saved_model_is_served_over_rest_and_grpc(exported, manifest, waveforms):
    """`tfformer serve` (the embedded TF-Serving-compatible server) transcribes rows of samples over REST and
    columns over gRPC."""
    from tests.serving.conftest import http_request
    from tfformer import serving

    clips = [2, 9]
    batch, lengths = _batch([waveforms[i] for i in clips])
    expected = [manifest["clips"][i]["transcript"] for i in clips]
    with serving.Server(model_name="asr", model_base_path=os.path.dirname(exported),
                        file_system_poll_wait_seconds=0) as server:
        rows = {"instances": [{"waveform": row.tolist(), "lengths": n} for row, n in zip(batch, lengths)]}
        status, _, body = http_request(server.rest_url, "POST", "/v1/models/asr:predict", json.dumps(rows).encode())
        assert status == 200, body[:500]
        assert json.loads(body)["predictions"] == expected
        with serving.Client(server.grpc_url) as client:
            got = client.predict("asr", {"waveform": batch, "lengths": np.array(lengths, np.int32)})
        assert [t.decode("utf-8") for t in got["text"]] == expected
        bad = {"inputs": {"waveform": batch.tolist(), "lengths": lengths[:1]}}
        status, _, body = http_request(server.rest_url, "POST", "/v1/models/asr:predict", json.dumps(bad).encode())
        assert status == 400 and "`lengths` must hold one sample count" in json.loads(body)["error"], body[:500]


def test_saved_model_rejects_bad_waveforms(exported, waveforms):
    import tensorflow as tf

    serve = tf.saved_model.load(exported).signatures["serving_default"]
    batch, lengths = _batch(waveforms[:2])
    with pytest.raises(tf.errors.InvalidArgumentError, match="`lengths` must hold one sample count per"):
        serve(waveform=tf.constant(batch), lengths=tf.constant(lengths[:1], tf.int32))
    with pytest.raises(tf.errors.InvalidArgumentError, match="`lengths` must be <= the `waveform` width"):
        serve(waveform=tf.constant(batch), lengths=tf.constant([lengths[0], batch.shape[1] + 1], tf.int32))
    batch[1, 10] = np.nan
    with pytest.raises(tf.errors.InvalidArgumentError, match="`waveform` must hold finite samples"):
        serve(waveform=tf.constant(batch), lengths=tf.constant(lengths, tf.int32))


def test_saved_model_argument_errors(asr, tmp_path):
    import keras

    from tfformer import export

    with pytest.raises(ValueError, match="beam_size"):
        export.saved_model(asr, str(tmp_path / "a"), beam_size=4)
    with pytest.raises(ValueError, match="`max_new_tokens` must be at most 446"):
        export.saved_model(asr, str(tmp_path / "b"), max_new_tokens=447)
    with pytest.raises(ValueError, match="`model` must be a tfformer task"):
        export.saved_model(keras.Sequential([keras.layers.Dense(2)]), str(tmp_path / "c"))
    assert not any(name.isdigit() for name in os.listdir(tmp_path / "a"))  # nothing published


# === TFLite ===
def test_host_features_match_the_graph_front_end(waveforms):
    from tfformer import edge
    from tfformer.data import audio

    for waveform in (waveforms[0], waveforms[7]):
        expected, _ = audio.log_mel_spectrogram(waveform[None])  # (1, 3000, 80)
        np.testing.assert_allclose(edge.log_mel_features(waveform), expected.numpy()[0], atol=1e-4)


def test_float32_tflite_ids_equal_keras(asr, transcribers, edge_ids, waveforms):
    """Six clips: the file's greedy ids (host numpy features, one id per decode_step call) equal the Keras
    model's `transcribe_ids` (graph features, the prompt prefilled in one step), end id included."""
    from tfformer.data import audio
    from tfformer.generation import speech

    clips = range(6)
    batch, lengths = _batch([waveforms[i] for i in clips])
    features, _ = audio.log_mel_spectrogram(batch, lengths)
    expected = speech.transcribe_ids(asr, features, max_new_tokens=MAX_LENGTH - len(asr.prompt), prompt=asr.prompt,
                                     suppress_ids=asr.suppress_ids, suppress_ids_begin=asr.suppress_ids_begin,
                                     end_id=asr.end_id)
    edge_asr = transcribers["float32"]
    assert (edge_asr.prompt, edge_asr.end_id) == (list(asr.prompt), asr.end_id)
    assert (edge_asr.suppress_ids, edge_asr.suppress_ids_begin) == (list(asr.suppress_ids),
                                                                    list(asr.suppress_ids_begin))
    for row, i in zip(expected, clips):
        got = edge_ids["float32"][i]
        assert got[-1] == asr.end_id
        assert got == _until_end(row, asr.end_id) + [asr.end_id], i


def test_int8_wer_within_two_points_of_float32(transcribers, edge_ids, tflite_files, manifest):
    """All 24 clips: float32's WER is CTranslate2's; dynamic-range int8 is within 2 points of it and less than half
    the size."""
    references = [clip["text"] for clip in manifest["clips"]]
    texts = {name: [transcribers[name].ids_to_text(row) for row in rows] for name, rows in edge_ids.items()}
    wer = {name: word_error_rate(references, hypotheses) for name, hypotheses in texts.items()}
    sizes = {name: os.path.getsize(path) for name, path in tflite_files.items()}
    print(f"WER {wer}, sizes {sizes}")
    assert texts["float32"] == [clip["transcript"] for clip in manifest["clips"]]
    assert wer["float32"] == pytest.approx(manifest["reference"]["wer"])
    assert abs(wer["dynamic"] - wer["float32"]) <= 0.02
    assert sizes["dynamic"] < sizes["float32"] / 2


def test_transcriber_reads_wav_files(transcribers, manifest):
    clip = manifest["clips"][3]
    assert transcribers["float32"].transcribe(str(SPEECH / clip["file"])) == clip["transcript"]


def test_transcriber_bad_input(transcribers, tflite_files, waveforms, tmp_path):
    from tfformer import edge, export, models

    edge_asr = transcribers["float32"]
    with pytest.raises(ValueError, match="is empty"):
        edge_asr.transcribe(np.zeros(0, np.float32), sample_rate=16000)
    with pytest.raises(ValueError, match="NaN or infinite"):
        edge_asr.transcribe(np.full(1600, np.nan, np.float32), sample_rate=16000)
    with pytest.raises(ValueError, match="`sample_rate` is required"):
        edge_asr.transcribe(waveforms[0])
    with pytest.raises(ValueError, match="`audio` must be a path to a WAV file or a waveform array"):
        edge_asr.transcribe([0.0, 0.1])
    with pytest.raises(ValueError, match=r"`input_features` must have shape \(1, 3000, 80\)"):
        edge_asr.transcribe_ids(np.zeros((1, 1500, 80), np.float32))
    with pytest.raises(ValueError, match=r"`max_new_tokens` must be an integer in \[1, 126\]"):
        edge_asr.transcribe_ids(edge_asr.features(waveforms[0]), max_new_tokens=127)
    with pytest.raises(ValueError, match="pass `tokenizer=`"):
        edge.Transcriber(tflite_files["float32"]).ids_to_text([383, 2068])
    with pytest.raises(ValueError, match="is a Whisper \\(speech\\) decoder file"):
        edge.Generator(tflite_files["float32"])
    config = models.TransformerConfig(architecture="causal_lm", vocabulary_size=40, hidden_dim=8, num_heads=2,
                                      intermediate_dim=16, num_decoder_layers=1, max_sequence_length=8)
    text_file = export.tflite_decoder(models.build_causal_lm(config), str(tmp_path / "lm.tflite"))
    with pytest.raises(ValueError, match="`path` must be a Whisper decoder file"):
        edge.Transcriber(text_file)


def test_tflite_decoder_argument_errors(asr, tmp_path):
    import keras

    from tfformer import export

    with pytest.raises(ValueError, match="pass neither `source_length` nor `tokenizer`"):
        export.tflite_decoder(asr, str(tmp_path / "w.tflite"), source_length=100)
    with pytest.raises(ValueError, match="`model` must be a tfformer CausalLM, Seq2SeqTransformer or WhisperModel"):
        export.tflite_decoder(keras.Sequential([keras.layers.Dense(2)]), str(tmp_path / "w.tflite"))
    assert not os.path.exists(tmp_path / "w.tflite")
