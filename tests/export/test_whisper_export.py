"""Whisper tiny.en exported: a SavedModel (waveform + lengths in, transcripts out, loaded without tfformer) and a
TFLite encoder + KV-cached decode step (float32 and dynamic-range int8) run by `tfformer.edge.Transcriber`.

Against independent numbers: the fixture manifest's transcripts, token ids and word error rate, recorded from
faster-whisper/CTranslate2 in float32 (tools/make_whisper_fixture.py); the Keras model's own greedy ids
(`models.whisper_decode.transcribe_ids`) for the float32 file; the in-graph TensorFlow front end
(`data.audio.log_mel_spectrogram`) for the host's numpy features. The TFLite files hold a cache of `MAX_LENGTH`
positions (every fixture transcript fits), converted once per module.
"""

import json
import os

import numpy as np
import pytest

from tests.harness import saved_model_in_fresh_process
from tests.speech import SPEECH, needs_wheel
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
    from tfformer.models import whisper_decode as speech

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


def _runner_ids(path, features, edge_asr):
    """Greedy ids of one window through the file's signature runners, every input passed at every call: the
    cross-attention keys/values each step and the cache from the host (its slot `index` written from
    `new_cache`), the suppression from the ids the Transcriber read."""
    from ai_edge_litert.interpreter import Interpreter

    interpreter = Interpreter(model_path=path, num_threads=2)
    encode, step = interpreter.get_signature_runner("encode"), interpreter.get_signature_runner("decode_step")
    cross_cache = encode(input_features=features)["cross_cache"]  # (L, 1, 2, K, S_src, H)
    cross = {f"cross_{half}_{i}": np.ascontiguousarray(cross_cache[i, :, h])
             for i in range(cross_cache.shape[0]) for h, half in enumerate(("keys", "values"))}
    cache = np.zeros(step.get_input_details()["cache"]["shape"], np.float32)  # (L, 1, 2, K, S, H)
    bias = np.zeros(step.get_output_details()["logits"]["shape"][-1], np.float32)
    bias[edge_asr.suppress_ids] = -np.inf
    first = bias.copy()
    first[edge_asr.suppress_ids_begin] = -np.inf
    tokens, new = list(edge_asr.prompt), []
    for index in range(cache.shape[4]):
        out = step(token_ids=np.array([[tokens[index]]], np.int32), cache=cache, index=np.array(index, np.int32),
                   **cross)
        cache[..., index, :] = out["new_cache"][..., 0, :]
        if index + 1 < len(edge_asr.prompt):
            continue
        new.append(int(np.argmax(out["logits"][0, -1] + (bias if new else first))))
        tokens.append(new[-1])
        if new[-1] == edge_asr.end_id:
            return new
    return new


def test_transcriber_keeps_caches_in_the_interpreter(transcribers, tflite_files, manifest, waveforms):
    """The Transcriber sets each window's cross-attention keys/values once and writes each step's slot into the
    cache inside the interpreter; passing every input at every call gives the same ids. Two clips in a row on
    one Transcriber (the second window must not see the first's caches), float32 and int8; float32's are the
    manifest's (CTranslate2's) ids."""
    for name in ("float32", "dynamic"):
        edge_asr = transcribers[name]
        for i in (7, 12):
            features = edge_asr.features(waveforms[i])
            got = edge_asr.transcribe_ids(features)
            assert got == _runner_ids(tflite_files[name], features, edge_asr), (name, i)
            if name == "float32":
                assert got == manifest["clips"][i]["token_ids"] + [edge_asr.end_id], i


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


def test_transcriber_refuses_files_of_the_older_layout(tmp_path):
    """A Whisper file whose `decode_step` takes one stacked `cross_cache` and returns the whole cache (the layout
    before `new_cache`) gets a clear error, not a KeyError: a tiny stand-in with those signatures."""
    import tensorflow as tf

    from tfformer import edge

    class OldLayout(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([1, 4, 2], tf.float32, name="input_features")])
        def encode(self, input_features):
            return {"cross_cache": input_features * 2.0, "end_id": tf.constant(3)}

        @tf.function(input_signature=[tf.TensorSpec([1, 1], tf.int32, name="token_ids"),
                                      tf.TensorSpec([1, 4, 2], tf.float32, name="cache"),
                                      tf.TensorSpec([1, 4, 2], tf.float32, name="cross_cache")])
        def decode_step(self, token_ids, cache, cross_cache):
            return {"logits": cache + cross_cache + tf.cast(token_ids[0, 0], tf.float32), "cache": cache * 2.0}

    module = OldLayout()
    saved = str(tmp_path / "old")
    tf.saved_model.save(module, saved, signatures={"encode": module.encode, "decode_step": module.decode_step})
    content = tf.lite.TFLiteConverter.from_saved_model(saved, signature_keys=["encode", "decode_step"]).convert()
    path = tmp_path / "old.tflite"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="older layout .*write it again with tfformer.export.tflite_decoder"):
        edge.Transcriber(str(path))


def test_tflite_decoder_argument_errors(asr, tmp_path):
    import keras

    from tfformer import export

    with pytest.raises(ValueError, match="pass neither `source_length` nor `tokenizer`"):
        export.tflite_decoder(asr, str(tmp_path / "w.tflite"), source_length=100)
    with pytest.raises(ValueError, match="`model` must be a tfformer CausalLM, Seq2SeqTransformer or WhisperModel"):
        export.tflite_decoder(keras.Sequential([keras.layers.Dense(2)]), str(tmp_path / "w.tflite"))
    assert not os.path.exists(tmp_path / "w.tflite")
