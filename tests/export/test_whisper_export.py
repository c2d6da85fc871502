"""Whisper tiny.en exported: a SavedModel (waveform + lengths in, transcripts or timestamped segments out, loaded
without tfformer) and a TFLite encoder + KV-cached decode step (float32 and dynamic-range int8) run by
`tfformer.edge.Transcriber`.

Against independent numbers: the fixture manifest's transcripts, token ids and word error rate, recorded from
faster-whisper/CTranslate2 in float32 (tools/make_whisper_fixture.py); the Keras model's own greedy ids
(`models.whisper_decode.transcribe_ids`) for the float32 file; the in-graph TensorFlow front end
(`data.audio.log_mel_spectrogram`) for the host's numpy features; faster-whisper's segments recorded on the same
weights (tests/fixtures/speech/segments.json, tools/make_whisper_segments_fixture.py) and the Keras path's
`transcribe(..., timestamps=True)` for the `segments` signature. The TFLite files hold a cache of `MAX_LENGTH`
positions (every fixture transcript fits), converted once per module. The SavedModel and the float32 file are the
ones `tfformer export whisper-tiny-en --format all` writes: the command is what users run, and exporting the same
model again through the API would only repeat a minute of tracing and converting.
"""

import contextlib
import io
import json
import os

import numpy as np
import pytest

from tests.harness import ONE_AT_A_TIME, saved_model_in_fresh_process
from tests.speech import SPEECH, needs_wheel
from tfformer.training.metrics import word_error_rate

pytestmark = [needs_wheel, ONE_AT_A_TIME]
MAX_LENGTH = 128  # cache positions of the TFLite files: the prompt plus up to 126 new ids


@pytest.fixture(scope="module")
def command(tmp_path_factory):
    """`tfformer export whisper-tiny-en --format all --max-length MAX_LENGTH`: its directory and what it printed."""
    from tfformer import cli

    out = tmp_path_factory.mktemp("whisper") / "asr"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = cli.main(["export", "whisper-tiny-en", "--format", "all", "--out", str(out),
                         "--max-length", str(MAX_LENGTH)])
    assert code == 0, printed.getvalue()
    return out, printed.getvalue()


@pytest.fixture(scope="module")
def exported(command):
    return str(command[0] / "1")


@pytest.fixture(scope="module")
def loaded(exported):
    import tensorflow as tf

    return tf.saved_model.load(exported)


@pytest.fixture(scope="module")
def reference():
    return json.loads((SPEECH / "segments.json").read_text())


@pytest.fixture(scope="module")
def tflite_files(asr, command, tmp_path_factory):
    from tfformer import export

    path = str(tmp_path_factory.mktemp("whisper_tflite") / "dynamic.tflite")
    return {"float32": str(command[0] / "model.tflite"),
            "dynamic": export.tflite_decoder(asr, path, max_length=MAX_LENGTH, quantize="dynamic")}


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


def _segments(loaded, waveforms):
    """The `segments` signature on `waveforms` in one batch: `[(start, end, text)]` per row, and the outputs (the
    padding past each row's `num_segments` checked)."""
    import tensorflow as tf

    batch, lengths = _batch(waveforms)
    out = {key: value.numpy() for key, value in loaded.signatures["segments"](
        waveform=tf.constant(batch), lengths=tf.constant(lengths, tf.int32)).items()}
    counts = out["num_segments"]
    assert out["segment_text"].shape == out["segment_start"].shape == out["segment_end"].shape == (
        len(waveforms), counts.max())
    assert out["avg_logprob"].shape == out["no_speech_prob"].shape == counts.shape == (len(waveforms),)
    rows = []
    for text, start, end, count in zip(out["segment_text"], out["segment_start"], out["segment_end"], counts):
        assert set(text[count:]) <= {b""} and not start[count:].any() and not end[count:].any()
        rows.append([(float(a), float(b), x.decode("utf-8")) for a, b, x in zip(start[:count], end[:count],
                                                                                  text[:count])])
    return rows, out


def _assert_keras_segments(found, expected):
    """`found` `[(start, end, text)]` are the Keras path's `Segment`s: the same texts, the same times, on the
    0.02-s grid of the timestamp tokens."""
    assert [text for _, _, text in found] == [segment.text for segment in expected]
    times = np.array([(start, end) for start, end, _ in found], np.float64).reshape(-1, 2)
    np.testing.assert_allclose(times, np.array([(s.start, s.end) for s in expected]).reshape(-1, 2), atol=1e-5)
    np.testing.assert_allclose(times, np.round(times / 0.02) * 0.02, atol=1e-5)


def _hits(found, expected, tolerance=0.5):
    """How many of faster-whisper's segments `[start, end, text]` have one in `found` whose start and end are both
    within `tolerance` seconds of theirs."""
    return sum(any(abs(start - e[0]) <= tolerance and abs(end - e[1]) <= tolerance for start, end, _ in found)
               for e in expected)


# === SavedModel ===
def test_saved_model_transcribes_waveforms_without_tfformer(exported, manifest, waveforms, asr, reference, tmp_path):
    """Three clips of different lengths in one batch plus an empty row: the manifest's (CTranslate2's)
    transcripts and ids, and faster-whisper's segment texts, from a process that imports only tensorflow and
    tensorflow_text."""
    from tfformer.data import audio

    clips = [0, 5, 11]
    batch, lengths = _batch([waveforms[i] for i in clips] + [waveforms[0][:0]])
    features, _ = audio.log_mel_spectrogram(batch[:1, :lengths[0]])  # (1, 3000, 80)
    request = {
        "serving_default": {"waveform": [batch.tolist(), "float32"], "lengths": [lengths, "int32"]},
        "segments": {"waveform": [batch.tolist(), "float32"], "lengths": [lengths, "int32"]},
        "generate_ids": {"input_features": [features.numpy().tolist(), "float32"]},
    }
    out = saved_model_in_fresh_process(exported, request, tmp_path)
    texts = [t.decode("utf-8") for t in out["serving_default/text"]]
    assert texts == [manifest["clips"][i]["transcript"] for i in clips] + [""]
    segments = [[text.decode("utf-8") for text in row[:count]] for row, count in zip(
        out["segments/segment_text"], out["segments/num_segments"])]
    assert segments == [[e[2] for e in reference["clips"][manifest["clips"][i]["file"]]["segments"]]
                        for i in clips] + [[]]
    ids = out["generate_ids/token_ids"]
    assert ids.shape == (1, asr.config.max_sequence_length - len(asr.prompt))
    assert _until_end(ids[0], asr.end_id) == manifest["clips"][0]["token_ids"]
    assert set(ids[0, len(manifest["clips"][0]["token_ids"]):].tolist()) == {asr.end_id}


def test_saved_model_segments_are_the_keras_paths(loaded, asr, manifest, waveforms, reference):
    """Six fixture clips in one batch (clip 4 among them: with timestamps the model reads "coffee please", without
    "coffee, please", as CTranslate2 does): the `segments` signature gives `transcribe(..., timestamps=True)`'s
    segments (texts, and times on the 0.02-s grid), within 0.5 s of faster-whisper's. Joined, their text is
    `serving_default`'s transcript (CTranslate2's without timestamps), or, where decoding with timestamps reads
    other words, faster-whisper's timestamped text."""
    import tensorflow as tf

    clips = list(range(0, len(waveforms), 4))  # each row costs about 2 s per signature on 2 cores
    found, out = _segments(loaded, [waveforms[i] for i in clips])
    files = [manifest["clips"][i]["file"] for i in clips]
    for got, expected in zip(found, asr.transcribe([str(SPEECH / name) for name in files], timestamps=True)):
        _assert_keras_segments(got, expected)
    faster = [reference["clips"][name]["segments"] for name in files]
    assert sum(_hits(got, expected) for got, expected in zip(found, faster)) == sum(map(len, faster))
    assert (out["no_speech_prob"] >= 0).all() and (out["no_speech_prob"] <= 1).all() and (out["avg_logprob"] < 0).all()
    batch, lengths = _batch([waveforms[i] for i in clips])
    texts = [text.decode("utf-8") for text in loaded.signatures["serving_default"](
        waveform=tf.constant(batch), lengths=tf.constant(lengths, tf.int32))["text"].numpy()]
    assert texts == [manifest["clips"][i]["transcript"] for i in clips]
    joined = [" ".join(text for _, _, text in row) for row in found]
    other = [(i, a, b) for i, a, b in zip(clips, joined, texts) if a != b]
    print(f"\njoined segments != serving_default on {len(other)} of {len(clips)} clips: {other}")
    for i, text, _ in other:
        assert text == " ".join(e[2] for e in reference["clips"][manifest["clips"][i]["file"]]["segments"])


def test_saved_model_segments_of_rows_of_different_lengths(loaded, asr, manifest, waveforms, reference):
    """One batch: the first 24.5 s of the fixture recording (several sentences and pauses: several segments), a
    2-s clip and an empty row. The long row's segments are the Keras path's and within 0.5 s of faster-whisper's
    (those that end inside the row); the empty row has none."""
    from tests.models.test_transcript import recording

    seconds = 24.5
    long = recording(reference, waveforms, manifest)[0][:int(seconds * 16000)]
    found, out = _segments(loaded, [long, waveforms[9], waveforms[0][:0]])
    for got, expected in zip(found, asr.transcribe([long, waveforms[9]], sample_rate=16000, timestamps=True)):
        _assert_keras_segments(got, expected)
    assert out["num_segments"].tolist() == [len(found[0]), 1, 0] and len(found[0]) >= 4
    faster = [e for e in reference["long"]["segments"] if e[1] <= seconds]
    print(f"\n{found[0]}\nfaster-whisper: {faster}")
    assert _hits(found[0], faster) == len(faster)
    assert all(a[1] <= b[0] for a, b in zip(found[0], found[0][1:]))  # in order, not overlapping


def test_saved_model_is_served_over_rest_and_grpc(exported, loaded, manifest, waveforms):
    """`tfformer serve` (the embedded TF-Serving-compatible server) transcribes rows of samples over REST and
    columns over gRPC; the `segments` signature by name, both ways, as the SavedModel gives them in process."""
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
        segments = {"signature_name": "segments", **rows}
        status, _, body = http_request(server.rest_url, "POST", "/v1/models/asr:predict",
                                       json.dumps(segments).encode())
        assert status == 200, body[:500]
        found, out = _segments(loaded, [waveforms[i] for i in clips])
        predictions = json.loads(body)["predictions"]
        assert [sorted(row) for row in predictions] == [sorted(out)] * len(clips)
        assert [[(a, b, x) for a, b, x in zip(row["segment_start"], row["segment_end"], row["segment_text"])]
                for row in predictions] == [[(pytest.approx(a), pytest.approx(b), x) for a, b, x in row]
                                            for row in found]
        assert [row["num_segments"] for row in predictions] == out["num_segments"].tolist()
        with serving.Client(server.grpc_url) as client:
            got = client.predict("asr", {"waveform": batch, "lengths": np.array(lengths, np.int32)},
                                 signature_name="segments")
        assert sorted(got) == sorted(out)
        for key, value in out.items():
            np.testing.assert_array_equal(got[key], value, err_msg=key)
        bad = {"inputs": {"waveform": batch.tolist(), "lengths": lengths[:1]}}
        status, _, body = http_request(server.rest_url, "POST", "/v1/models/asr:predict", json.dumps(bad).encode())
        assert status == 400 and "`lengths` must hold one sample count" in json.loads(body)["error"], body[:500]


def test_saved_model_rejects_bad_waveforms(loaded, waveforms):
    import tensorflow as tf

    for name in ("serving_default", "segments"):
        serve = loaded.signatures[name]
        batch, lengths = _batch(waveforms[:2])
        with pytest.raises(tf.errors.InvalidArgumentError, match="`lengths` must hold one sample count per"):
            serve(waveform=tf.constant(batch), lengths=tf.constant(lengths[:1], tf.int32))
        with pytest.raises(tf.errors.InvalidArgumentError, match="`lengths` must be <= the `waveform` width"):
            serve(waveform=tf.constant(batch), lengths=tf.constant([lengths[0], batch.shape[1] + 1], tf.int32))
        with pytest.raises(tf.errors.InvalidArgumentError, match="`lengths` must be >= 0"):
            serve(waveform=tf.constant(batch), lengths=tf.constant([lengths[0], -1], tf.int32))
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


def test_export_command_writes_what_serve_and_the_transcriber_run(command, transcribers, edge_ids, manifest, asr):
    """`tfformer export whisper-tiny-en --format all` says where it wrote the SavedModel and the TFLite file (the
    files this module serves and runs), `--max-length` reached the file (the default is 446), and the file reads a
    clip with CTranslate2's ids (the fixture manifest's)."""
    out, printed = command
    assert f"SavedModel: {out / '1'}" in printed and f"TFLite: {out / 'model.tflite'}" in printed, printed
    assert transcribers["float32"].max_length == MAX_LENGTH
    assert edge_ids["float32"][4] == manifest["clips"][4]["token_ids"] + [asr.end_id]


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
    """Greedy ids of one window through the file's signature runners in an `Interpreter`, every input passed at
    every call from the host: the cross-attention keys/values each step, and each layer's cache halves taken back
    from the step's outputs of the same names; the suppression from the ids the Transcriber read."""
    from ai_edge_litert.interpreter import Interpreter

    interpreter = Interpreter(model_path=path, num_threads=2)
    encode, step = interpreter.get_signature_runner("encode"), interpreter.get_signature_runner("decode_step")
    cross = encode(input_features=features)  # cross_keys_i (1, K, S_src, H), cross_values_i (1, K, H, S_src)
    inputs = step.get_input_details()
    caches = {name: np.zeros(detail["shape"], np.float32) for name, detail in inputs.items()
              if name.startswith("cache_")}  # (K, S, H) each
    assert set(cross) == {name.replace("cache", "cross") for name in caches}
    bias = np.zeros(step.get_output_details()["logits"]["shape"][-1], np.float32)
    bias[edge_asr.suppress_ids] = -np.inf
    first = bias.copy()
    first[edge_asr.suppress_ids_begin] = -np.inf
    tokens, new = list(edge_asr.prompt), []
    for index in range(caches["cache_keys_0"].shape[1]):
        out = step(token_ids=np.array([[tokens[index]]], np.int32), index=np.array(index, np.int32), **caches,
                   **cross)
        caches = {name: out[name] for name in caches}
        if index + 1 < len(edge_asr.prompt):
            continue
        new.append(int(np.argmax(out["logits"][0, -1] + (bias if new else first))))
        tokens.append(new[-1])
        if new[-1] == edge_asr.end_id:
            return new
    return new


def test_transcriber_keeps_caches_in_the_runtime(transcribers, tflite_files, manifest, waveforms):
    """The Transcriber's CompiledModel reads each window's cross-attention keys/values where `encode` wrote them and
    writes each step's slot into the cache buffers it binds as the step's inputs and outputs; an `Interpreter` fed
    every input at every call from the host gives the same ids. Two clips in a row on
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
    before `new_cache`), or takes one stacked cache and returns the slot it wrote as `new_cache` (36b9357 to the
    per-layer caches), or has the `options` signature and encode's per-layer cross outputs but one stacked cache,
    gets a clear error, not a KeyError or a wrong transcript: tiny stand-ins with those signatures."""
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

    class NewCache(tf.Module):  # the layout of 36b9357: `new_cache`, the options in `encode`
        @tf.function(input_signature=[tf.TensorSpec([1, 4, 2], tf.float32, name="input_features")])
        def encode(self, input_features):
            return {"cross_cache": input_features * 2.0, "end_id": tf.constant(3)}

        @tf.function(input_signature=[tf.TensorSpec([1, 1], tf.int32, name="token_ids"),
                                      tf.TensorSpec([1, 1, 2, 2, 3, 8], tf.float32, name="cache"),
                                      tf.TensorSpec([1, 2, 5, 8], tf.float32, name="cross_keys_0"),
                                      tf.TensorSpec([1, 2, 5, 8], tf.float32, name="cross_values_0")])
        def decode_step(self, token_ids, cache, cross_keys_0, cross_values_0):
            step = tf.reduce_sum(cross_keys_0 + cross_values_0) + tf.cast(token_ids[0, 0], tf.float32)
            return {"logits": tf.fill([1, 1, 4], step), "new_cache": cache[..., :1, :] * 2.0}

    class StackedCache(tf.Module):  # an `options` signature and encode's cross outputs, but one stacked cache
        @tf.function(input_signature=[])
        def options(self):
            return {"end_id": tf.constant(3)}

        @tf.function(input_signature=[tf.TensorSpec([1, 4, 2], tf.float32, name="input_features")])
        def encode(self, input_features):
            return {"cross_keys_0": input_features * 2.0, "cross_values_0": input_features * 3.0}

        @tf.function(input_signature=[tf.TensorSpec([1, 1], tf.int32, name="token_ids"),
                                      tf.TensorSpec([1, 1, 2, 2, 3, 8], tf.float32, name="cache"),
                                      tf.TensorSpec([1, 4, 2], tf.float32, name="cross_keys_0"),
                                      tf.TensorSpec([1, 4, 2], tf.float32, name="cross_values_0")])
        def decode_step(self, token_ids, cache, cross_keys_0, cross_values_0):
            step = tf.reduce_sum(cross_keys_0 + cross_values_0) + tf.cast(token_ids[0, 0], tf.float32)
            return {"logits": tf.fill([1, 1, 4], step), "cache": cache * 2.0}

    for i, module in enumerate((OldLayout(), NewCache(), StackedCache())):
        saved = str(tmp_path / f"old{i}")
        signatures = {name: getattr(module, name) for name in ("options", "encode", "decode_step")
                      if hasattr(module, name)}
        tf.saved_model.save(module, saved, signatures=signatures)
        content = tf.lite.TFLiteConverter.from_saved_model(saved, signature_keys=list(signatures)).convert()
        path = tmp_path / f"old{i}.tflite"
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
