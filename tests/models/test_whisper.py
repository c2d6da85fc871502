"""WhisperModel on its own (small random weights): the convolutional stem and encoder positions against numpy,
shapes, `.keras` round trip, the causal decoder, cached decoding, and the greedy and beam search loops with
suppression against full passes."""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.generation.test_decode import ctranslate2_beam_search
from tests.harness import count_ops
from tfformer import models
from tfformer.models import whisper_decode as speech
from tfformer.generation import samplers
from tfformer.generation.beam import BeamSampler
from tfformer.models.whisper import WhisperModel, WhisperPositionTable, whisper_sinusoids

TINY = dict(architecture="speech_seq2seq", vocabulary_size=50, hidden_dim=16, num_heads=2, intermediate_dim=32,
            num_encoder_layers=2, num_decoder_layers=2, dropout=0.0, max_sequence_length=16, activation="gelu",
            norm_first=True, position="learned", scale_embeddings=False, num_mel_bins=8, max_source_positions=10)
FRAMES = 20  # 2 * max_source_positions


@pytest.fixture(scope="module")
def model():
    keras.utils.set_random_seed(0)
    model = models.build_whisper(models.TransformerConfig(**TINY))
    # Larger random weights than the initializers', so that outputs differ visibly between positions.
    rng = np.random.default_rng(0)
    for weight in model.weights:
        weight.assign(weight.numpy() + rng.normal(scale=0.3, size=weight.shape).astype("float32"))
    return model


@pytest.fixture(scope="module")
def features():
    return np.random.default_rng(1).normal(size=(2, FRAMES, 8)).astype("float32")


def _gelu(x):
    return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))


def _conv1d(x, kernel, bias, stride):
    """Whisper's `nn.Conv1d(padding=1)` on `(T, C)`; `kernel` in Keras' `(k, in, out)` layout."""
    padded = np.pad(x, ((1, 1), (0, 0)))  # (T + 2, C)
    steps = (padded.shape[0] - 3) // stride + 1
    windows = np.stack([padded[i * stride:i * stride + 3] for i in range(steps)])  # (T', 3, C)
    return np.tensordot(windows, kernel, axes=([1, 2], [0, 1])) + bias  # (T', O)


def test_config_requires_the_speech_fields():
    fields = {k: v for k, v in TINY.items() if k != "num_mel_bins"}
    with pytest.raises(ValueError, match="`num_mel_bins` is required when architecture='speech_seq2seq'"):
        models.TransformerConfig(**fields)
    with pytest.raises(ValueError, match="`max_source_positions` must be a positive integer"):
        models.TransformerConfig(**dict(TINY, max_source_positions=0))
    # The new fields default to None and leave other architectures alone.
    assert models.TransformerConfig().num_mel_bins is None
    assert models.build_model(models.TransformerConfig(**TINY)).__class__ is WhisperModel


def test_whisper_sinusoids_formula():
    table = whisper_sinusoids(7, 6)
    for position in range(7):
        for k in range(3):
            angle = position / 10000 ** (k / 2)  # log-timescale increment log(10000) / (6 / 2 - 1)
            assert table[position, k] == pytest.approx(math.sin(angle), abs=1e-6)
            assert table[position, 3 + k] == pytest.approx(math.cos(angle), abs=1e-6)
    with pytest.raises(ValueError, match="even width"):
        whisper_sinusoids(4, 5)


def test_stem_and_positions_match_numpy(model, features):
    x = features
    for layer in model.stem:
        x = layer(x)
    x = np.asarray(x + model.encoder_position(x))
    _, conv1, _, conv2 = model.stem
    for row, mel in zip(x, features):
        h = _gelu(_conv1d(mel, conv1.kernel.numpy(), conv1.bias.numpy(), 1))  # (20, 16)
        h = _gelu(_conv1d(h, conv2.kernel.numpy(), conv2.bias.numpy(), 2))  # (10, 16)
        np.testing.assert_allclose(row, h + model.encoder_position.embeddings.numpy(), atol=1e-5)
    assert not model.encoder_position.trainable_weights  # a fixed table
    np.testing.assert_allclose(WhisperPositionTable(10)(np.zeros((1, 4, 16))).numpy()[0], whisper_sinusoids(4, 16),
                               atol=1e-7)


def test_shapes_and_bad_input(model, features):
    ids = np.array([[3, 4, 5, 6, 7], [8, 9, 10, 11, 0]], "int32")
    logits = model({"input_features": features, "decoder_token_ids": ids})
    assert logits.shape == (2, 5, 50) and logits.dtype == "float32"
    encoded, mask = model.encode(features)
    assert encoded.shape == (2, 10, 16) and mask is None
    assert model.cross_attention_caches(encoded).shape == (2, 2, 2, 2, 10, 8)  # (L, B, 2, K, S, H)
    with pytest.raises(ValueError, match=r"`input_features` must be \(batch, frames, num_mel_bins=8\)"):
        model.encode(np.zeros((1, FRAMES, 7), "float32"))
    with pytest.raises(ValueError, match="at most max_source_positions=10"):
        model.encode(np.zeros((1, 2 * FRAMES, 8), "float32"))


def test_tied_output_projection_without_scaling(model, features):
    ids = np.array([[3, 4, 5]], "int32")
    hidden = model._step_graphs.hidden.forward({"input_features": features[:1], "decoder_token_ids": ids})
    logits = model({"input_features": features[:1], "decoder_token_ids": ids})
    np.testing.assert_allclose(logits, np.asarray(hidden) @ model.token_embedding.embeddings.numpy().T, atol=1e-4)
    embedded = model.token_embedding(ids) + model.decoder_position(model.token_embedding(ids))
    table, positions = model.token_embedding.embeddings.numpy(), model.decoder_position.position_embeddings.numpy()
    np.testing.assert_allclose(embedded, table[ids] + positions[:3], atol=1e-6)  # no sqrt(d) scaling


def test_keras_round_trip_safe_mode(model, features, tmp_path):
    inputs = {"input_features": features, "decoder_token_ids": np.array([[3, 4, 5], [6, 7, 8]], "int32")}
    path = tmp_path / "whisper.keras"
    model.save(path)
    reloaded = keras.models.load_model(path, safe_mode=True)
    assert isinstance(reloaded, WhisperModel) and reloaded.config == model.config
    np.testing.assert_allclose(reloaded(inputs), model(inputs), atol=1e-5)
    np.testing.assert_array_equal(reloaded.encoder_position.embeddings.numpy(),
                                  model.encoder_position.embeddings.numpy())


def test_decoding_fields_are_config_and_survive_a_keras_round_trip(features, tmp_path):
    fields = dict(prompt=[1, 2], suppress_ids=[3, 7], suppress_ids_begin=[4], end_id=49)
    model = WhisperModel(models.TransformerConfig(**TINY), **fields)
    assert {name: model.get_config()[name] for name in fields} == fields
    # The defaults are English-only Whisper's prompt and end of text, without suppression.
    default = models.build_whisper(models.TransformerConfig(**TINY)).get_config()
    assert (default["prompt"], default["suppress_ids"], default["suppress_ids_begin"], default["end_id"]) == (
        [50257, 50362], [], [], 50256)
    path = tmp_path / "whisper.keras"
    model.save(path)
    reloaded = keras.models.load_model(path, safe_mode=True)
    assert (reloaded.prompt, reloaded.suppress_ids, reloaded.suppress_ids_begin, reloaded.end_id) == (
        (1, 2), (3, 7), (4,), 49)
    with pytest.raises(ValueError, match=r"`suppress_ids` must be a list of int ids. Received: suppress_ids='3'"):
        WhisperModel(models.TransformerConfig(**TINY), suppress_ids="3")
    with pytest.raises(ValueError, match=r"`prompt` must be a list of int ids. Received: prompt=\[1, 2.5\]"):
        WhisperModel(models.TransformerConfig(**TINY), prompt=[1, 2.5])
    with pytest.raises(ValueError, match=r"`end_id` must be an int. Received: end_id=None"):
        WhisperModel(models.TransformerConfig(**TINY), end_id=None)


def test_backbone_gives_the_decoder_hidden_states(model, features):
    ids = np.array([[3, 4, 5]], "int32")
    inputs = {"input_features": features[:1], "decoder_token_ids": ids}
    hidden = np.asarray(model.backbone(inputs))  # (1, 3, 16)
    np.testing.assert_allclose(np.asarray(model(inputs)), hidden @ model.token_embedding.embeddings.numpy().T,
                               atol=1e-4)


def test_ids_to_text_stops_at_the_end_and_drops_special_ids():
    class Bytes:  # a stand-in tokenizer: id i is the letter chr(97 + i)
        def detokenize(self, ids):
            return tf.constant([" ".join(chr(97 + i) for i in row).encode() + b" " for row in ids.to_list()])

    model = models.build_whisper(models.TransformerConfig(**TINY))
    model.end_id = 20
    model.preprocessor = Bytes()
    # Ids from end_id up are Whisper's special tokens; the text stops at the first end_id.
    assert model.ids_to_text(np.array([[0, 1, 25, 2, 20, 3], [20, 20, 20, 20, 20, 20], [4, 5, 6, 7, 8, 9]])) == [
        "a b c", "", "e f g h i j"]


def test_no_future_leakage(model, features):
    ids = np.array([[3, 4, 5, 6, 7, 8]], "int32")
    changed = ids.copy()
    changed[0, 4] = 20
    a = np.asarray(model({"input_features": features[:1], "decoder_token_ids": ids}))
    b = np.asarray(model({"input_features": features[:1], "decoder_token_ids": changed}))
    np.testing.assert_allclose(a[:, :4], b[:, :4], atol=1e-6)
    assert np.abs(a[:, 4:] - b[:, 4:]).max() > 1e-3
    # The encoder input reaches every decoder position.
    c = np.asarray(model({"input_features": features[1:], "decoder_token_ids": ids}))
    assert np.abs(a[:, 0] - c[:, 0]).max() > 1e-3


def test_encoder_in_query_chunks_equals_the_functional_models_encoder(model, features):
    # The functional model's encoder attends all 10 frames at once; `encode` by default in chunks of
    # ENCODER_QUERY_CHUNK (over 10 here: one piece), and in pieces of 4, 4 and 2 with query_chunk_size=4.
    full = keras.Model(model.inputs, model.get_layer("encoder_block_1").output)  # before the final norm
    blocks = full({"input_features": features, "decoder_token_ids": np.zeros((2, 1), "int32")})
    reference = np.asarray(model.encoder_norm(blocks))
    for size in (None, 4):
        encoded, _ = model.encode(features, query_chunk_size=size)
        np.testing.assert_allclose(encoded, reference, rtol=1e-5, atol=1e-5)
    encode = tf.function(lambda f: model.encode(f, query_chunk_size=4)[0])
    assert count_ops("Softmax", encode, features) == 3 * TINY["num_encoder_layers"]


def test_cached_decoding_equals_the_full_pass(model, features):
    ids = np.array([[3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]], "int32")
    full = np.asarray(model({"input_features": features, "decoder_token_ids": ids}))  # (B, 6, V)
    encoded, mask = model.encode(features)
    cross = model.cross_attention_caches(encoded)
    cache = model.empty_cache(2, 8)
    logits, cache = model.decode_step(ids[:, :2], cache, 0, cross, mask)  # a 2-token prompt in one step
    np.testing.assert_allclose(logits, full[:, :2], atol=1e-4)
    for t in range(2, 6):
        logits, cache = model.decode_step(ids[:, t:t + 1], cache, t, cross, mask)
        np.testing.assert_allclose(logits[:, 0], full[:, t], atol=1e-4)


def _greedy_by_full_passes(model, features, prompt, steps, suppress, suppress_begin, end_id):
    """Greedy decoding re-running the whole model at every step, no cache."""
    tokens = list(prompt)
    out = []
    for step in range(steps):
        logits = np.asarray(model({"input_features": features[None], "decoder_token_ids": np.array([tokens], "int32")}))
        last = logits[0, -1].copy()
        last[list(suppress)] = -np.inf
        if step == 0:
            last[list(suppress_begin)] = -np.inf
        token = int(np.argmax(last))
        out.append(token)
        if token == end_id:
            break
        tokens.append(token)
    return out


def test_greedy_loop_with_suppression_equals_full_passes(model, features):
    prompt, steps = (1, 2), 8
    plain = speech.transcribe_ids(model, features, max_new_tokens=steps, prompt=prompt, end_id=49)
    # Suppress what the unsuppressed loop picked first (at the first step) and second (at every step).
    suppress_begin, suppress = [int(plain[0, 0])], [int(plain[0, 1])]
    for end_id in (49, int(plain[1, 2])):
        ids = speech.transcribe_ids(model, features, max_new_tokens=steps, prompt=prompt, suppress_ids=suppress,
                                    suppress_ids_begin=suppress_begin, end_id=end_id)
        assert ids.shape == (2, steps) and ids.dtype == np.int32
        for row, mel in zip(ids, features):
            expected = _greedy_by_full_passes(model, mel, prompt, steps, suppress, suppress_begin, end_id)
            assert list(row[:len(expected)]) == expected
            assert all(token == end_id for token in row[len(expected):])  # filled after the end
            assert row[0] != suppress_begin[0] and suppress[0] not in row


def test_greedy_loop_errors(model, features):
    with pytest.raises(ValueError, match="must be at most max_sequence_length=16"):
        speech.transcribe_ids(model, features, max_new_tokens=15, prompt=(1, 2))
    with pytest.raises(ValueError, match=r"`suppress_ids` must be ids in \[0, vocabulary_size=50\)"):
        speech.speech_decode_fn(model, 4, prompt=(1,), suppress_ids=[50], end_id=49)
    with pytest.raises(ValueError, match="`prompt` must be a non-empty list of ids"):
        speech.speech_decode_fn(model, 4, prompt=(), end_id=49)
    with pytest.raises(ValueError, match=r"`end_id` must be an id in \[0, vocabulary_size=50\)\. Received: end_id=50"):
        speech.speech_decode_fn(model, 4, prompt=(1,))
    with pytest.raises(ValueError, match=r"`input_features` must be \(batch, frames, num_mel_bins=8\)"):
        speech.transcribe_ids(model, features[0], max_new_tokens=4, prompt=(1,), end_id=49)


def test_greedy_loop_under_xla_equals_the_graph_loop(model, features):
    options = dict(max_new_tokens=8, prompt=(1, 2), suppress_ids=[3], suppress_ids_begin=[4], end_id=49)
    np.testing.assert_array_equal(speech.transcribe_ids(model, features, jit_compile=True, **options),
                                  speech.transcribe_ids(model, features, **options))


def test_timestamp_kernels_are_the_weights_at_each_call(model):
    """The layout is traced once, and reads the weights at each call: a change of them shows in the next layout."""
    table = model.token_embedding.embeddings
    original = table.numpy()
    _, before = speech.timestamp_kernels(model, 1)
    table.assign(original + 1.0)
    try:
        _, after = speech.timestamp_kernels(model, 1)
    finally:
        table.assign(original)
    np.testing.assert_array_equal(before[id(table)][0].numpy(), original.T)  # (D, V)
    np.testing.assert_array_equal(after[id(table)][0].numpy(), original.T + 1.0)
    from tfformer.generation.decode import compiled_functions

    (layout,) = [f for key, f in compiled_functions(model).items() if key == ("timestamp_kernels", 1)]
    assert layout.function.experimental_get_tracing_count() == 1


@pytest.mark.parametrize("rows", [1, 2])
def test_timestamp_decoding_under_xla_equals_the_graph_runtime(model, features, rows):
    """`transcribe_timestamp_ids(jit_compile=True)`: the loop under XLA on a decode plan ("rows" kernels and split
    caches for one row, "halves" for two), the encoder and the prompt pass in the graph runtime. Greedy: the graph
    runtime's tokens, log-probability sums and <|nospeech|> probabilities, for prompts of three lengths, through XLA
    functions traced once for all three, with kernels laid out per call or once (`timestamp_kernels`). Sampled:
    XLA's own draws (TensorFlow's differ from the graph runtime's), the same for the same seed, and Whisper's rules
    kept."""
    from tfformer.generation.decode import compiled_functions

    ids = speech.TimestampIds(no_timestamps=40, timestamp_begin=41, no_speech=39)  # timestamps 41..49
    options = dict(suppress_ids=[3], suppress_ids_begin=[5], end_id=35, max_initial_timestamp=0.1)
    for prompt in ([38], [1, 2, 38], [7, 8, 9, 10, 11, 38]):
        prompts = np.array([prompt] * rows, np.int32)
        got = speech.transcribe_timestamp_ids(model, features[:rows], prompts, ids, 8, jit_compile=True, **options)
        expected = speech.transcribe_timestamp_ids(model, features[:rows], prompts, ids, 8, **options)
        np.testing.assert_array_equal(got[0], expected[0])
        assert (got[0] >= ids.timestamp_begin).any() and (got[0] < ids.timestamp_begin).any()
        np.testing.assert_allclose(got[1], expected[1], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got[2], expected[2], rtol=1e-5, atol=1e-6)
        # Kernels laid out once for many calls: the same outputs, through the same compiled loop.
        held = speech.transcribe_timestamp_ids(model, features[:rows], prompts, ids, 8, jit_compile=True,
                                               kernels=speech.timestamp_kernels(model, rows), **options)
        for a, b in zip(held, got):
            np.testing.assert_array_equal(a, b)
    for bad, jit in [(speech.timestamp_kernels(model, 3 - rows), True), (speech.timestamp_kernels(model, rows), False),
                     ({}, True)]:
        with pytest.raises(ValueError, match=f"`kernels` must be `timestamp_kernels\\(model, batch={rows}\\)`"):
            speech.transcribe_timestamp_ids(model, features[:rows], prompts, ids, 8, jit_compile=jit, kernels=bad,
                                            **options)
    (run,) = [f for key, f in compiled_functions(model).items() if key[0] == "speech_timestamps" and key[-1] == rows]
    assert {name: f.experimental_get_tracing_count() for name, f in run.functions.items()} == {
        "encode": 1, "prompt": 1, "loop": 1}
    prompts = np.array([[1, 2, 38]] * rows, np.int32)
    draws = [speech.transcribe_timestamp_ids(model, features[:rows], prompts, ids, 8, jit_compile=True, **options,
                                             sampler=samplers.TemperatureSampler(1.0, seed=seed))[0]
             for seed in (3, 3, 4)]
    np.testing.assert_array_equal(draws[0], draws[1])
    assert not np.array_equal(draws[0], draws[2])
    for bad in (0, 2.5):  # checked under XLA as in the graph runtime
        with pytest.raises(ValueError, match="max_new_tokens"):
            speech.transcribe_timestamp_ids(model, features[:rows], prompts, ids, bad, jit_compile=True, **options)
    for row in np.concatenate(draws):
        stamps = row[(row >= ids.timestamp_begin)]
        assert row[0] in (41, 42, 43, 44, 45, 46) and list(stamps) == sorted(stamps)  # max_initial_timestamp: 0.1 s


def _log_probs_by_full_passes(model, mel, prompt, suppress, suppress_begin):
    """`log_probs_of(tokens)`: the next-token log-probabilities after `prompt + tokens`, re-running the whole
    model (no cache), with Whisper's suppression."""
    seen = {}

    def log_probs_of(tokens):
        if tokens not in seen:
            ids = np.array([list(prompt) + list(tokens)], "int32")
            logits = np.asarray(model({"input_features": mel[None], "decoder_token_ids": ids}))[0, -1]
            logits = logits.astype(np.float64)
            logits[list(suppress)] = -np.inf
            if not tokens:
                logits[list(suppress_begin)] = -np.inf
            seen[tokens] = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
        return seen[tokens]

    return log_probs_of


@pytest.mark.parametrize("beam, length_penalty, patience", [(3, 1.0, 1.0), (4, 0.0, 1.0), (2, 1.0, 2.0)])
def test_beam_search_with_suppression_equals_full_passes(model, features, beam, length_penalty, patience):
    """CTranslate2's beam search (`speech.whisper_sampler`'s `BeamSampler`) over the cached loop equals the same
    search written out in Python over full passes of the model, with suppression and an end id that the
    beams reach."""
    prompt, steps, suppress, suppress_begin = (1, 2), 8, [5], [7]
    plain = speech.transcribe_ids(model, features, max_new_tokens=steps, prompt=prompt, end_id=49)
    end_id = int(plain[1, 2])  # a token greedy decoding produces: some hypotheses end
    sampler = speech.whisper_sampler(beam, length_penalty, patience)
    assert sampler.key() == ("beam", beam, length_penalty, "length", patience)
    ids = speech.transcribe_ids(model, features, max_new_tokens=steps, prompt=prompt, suppress_ids=suppress,
                                suppress_ids_begin=suppress_begin, end_id=end_id, sampler=sampler)
    assert ids.shape == (2, steps) and ids.dtype == np.int32
    ended = []
    for row, mel in zip(ids.tolist(), features):
        log_probs_of = _log_probs_by_full_passes(model, mel, prompt, suppress, suppress_begin)
        tokens, end = ctranslate2_beam_search(log_probs_of, 50, beam, end_id, steps, length_penalty, patience)
        assert row[:len(tokens)] == tokens and all(t == end_id for t in row[len(tokens):]), (row, tokens)
        ended.append(end)
    assert any(ended)


def test_beam_of_one_equals_greedy_and_whisper_sampler(model, features):
    options = dict(max_new_tokens=8, prompt=(1, 2), suppress_ids=[3], suppress_ids_begin=[4], end_id=49)
    greedy = speech.transcribe_ids(model, features, **options)
    np.testing.assert_array_equal(speech.transcribe_ids(
        model, features, sampler=BeamSampler(1, 1.0, normalization="length", patience=1.0), **options), greedy)
    np.testing.assert_array_equal(speech.transcribe_ids(model, features, sampler=speech.whisper_sampler(1),
                                                        **options), greedy)
    # Beam search under XLA gives the graph loop's ids.
    sampler = speech.whisper_sampler(3)
    np.testing.assert_array_equal(speech.transcribe_ids(model, features, sampler=sampler, jit_compile=True, **options),
                                  speech.transcribe_ids(model, features, sampler=sampler, **options))
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match=rf"`beam_size` must be a positive integer. Received: beam_size={bad!r}"):
            speech.whisper_sampler(bad)
