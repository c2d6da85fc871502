import os
import warnings

import keras
import numpy as np
import pytest
from ai_edge_litert.interpreter import Interpreter

from tfformer import edge, export, generation, models, training
from tfformer.tokens import START_ID

from tests.export.conftest import CFG, spread


def _run(path, inputs):
    runner = Interpreter(model_path=path).get_signature_runner("predict_ids")
    return runner(**inputs)


def _inputs(model, rng, batch=2, length=9):
    ids = rng.integers(4, model.config.vocabulary_size, size=(batch, length)).astype("int32")
    ids[0, -3:] = 0
    if model.config.architecture == "seq2seq":
        return {"encoder_token_ids": ids, "decoder_token_ids": ids[:, :6].copy()}
    return {"token_ids": ids}


@pytest.mark.parametrize("architecture", ["seq2seq", "causal_lm", "encoder"])
def test_float32_tflite_matches_keras(tmp_path, rng, architecture):
    model = spread(models.build_model(models.TransformerConfig(architecture=architecture, vocabulary_size=50, **CFG)))
    path = export.tflite(model, str(tmp_path / "m.tflite"))
    inputs = _inputs(model, rng)
    got = _run(path, inputs)
    expected = model(inputs)
    expected = expected if isinstance(expected, dict) else {"logits": expected}
    for key, value in expected.items():
        np.testing.assert_allclose(got[key], np.asarray(value), atol=1e-4)



@pytest.mark.parametrize("activation", ["gelu", "gelu_approximate"])
def test_gelu_tflite_matches_keras_with_builtin_ops(tmp_path, rng, activation):
    """Both GELUs convert to LiteRT's GELU builtin (no Flex/select-TF ops) and match Keras."""
    config = models.TransformerConfig(architecture="causal_lm", vocabulary_size=50, **dict(CFG, activation=activation))
    model = spread(models.build_causal_lm(config))
    path = export.tflite(model, str(tmp_path / "m.tflite"))
    inputs = _inputs(model, rng)
    np.testing.assert_allclose(_run(path, inputs)["logits"], np.asarray(model(inputs)), atol=1e-4)
    ops = {op["op_name"] for op in Interpreter(model_path=path)._get_ops_details()}
    assert "GELU" in ops and not any(name.startswith("Flex") for name in ops), ops


@pytest.mark.parametrize("architecture", ["seq2seq", "causal_lm"])
def test_static_shape_tflite_matches_keras_without_shape_ops(tmp_path, rng, architecture):
    model = spread(models.build_model(models.TransformerConfig(architecture=architecture, vocabulary_size=50, **CFG)))
    inputs = _inputs(model, rng, batch=1, length=6)
    length = 6 if architecture == "causal_lm" else None  # seq2seq: both inputs' lengths stay free
    path = export.tflite(model, str(tmp_path / "m.tflite"), sequence_length=length, batch_size=1)
    np.testing.assert_allclose(_run(path, inputs)["logits"], np.asarray(model(inputs)), atol=1e-4)
    if architecture == "causal_lm":  # every shape static: no run-time shape arithmetic left in the graph
        ops = {op["op_name"] for op in Interpreter(model_path=path)._get_ops_details()}
        assert not ops & {"SHAPE", "PACK", "REDUCE_PROD"}, ops  # (GATHER stays: the embedding lookup)
    with pytest.raises(ValueError, match="batch_size"):
        export.tflite(model, str(tmp_path / "x.tflite"), batch_size=0)
    learned = models.build_model(models.TransformerConfig(architecture=architecture, vocabulary_size=50,
                                                          **dict(CFG, position="learned")))
    limit = learned.config.max_sequence_length  # its positions end there: refused by name, not by Keras inside
    with pytest.raises(ValueError, match=rf"`sequence_length` must be an integer in \[1, {limit}\] \(the model"):
        export.tflite(learned, str(tmp_path / "x.tflite"), sequence_length=limit + 1)

@pytest.fixture(scope="module")
def trained_lm():
    """A tiny LM trained on a structured token stream, so top-1 agreement is measured on real predictions."""
    keras.utils.set_random_seed(0)
    config = models.TransformerConfig(architecture="causal_lm", vocabulary_size=40, **dict(CFG, hidden_dim=32,
                                                                                          intermediate_dim=64))
    model = models.build_causal_lm(config)
    rng = np.random.default_rng(0)
    starts = rng.integers(0, 30, size=(600, 1))
    seqs = (4 + (starts + np.arange(17)[None, :] * rng.integers(1, 3, size=(600, 1))) % 36).astype("int32")
    model.compile(optimizer=keras.optimizers.Adam(3e-3), loss=training.MaskedSparseCrossEntropy(0.0))
    model.fit({"token_ids": seqs[:500, :-1]}, seqs[:500, 1:], batch_size=50, epochs=8, verbose=0)
    return model, seqs[500:]


@pytest.mark.parametrize("quantize, check", [("float16", "close"), ("dynamic", "top1")])
def test_quantized_tflite(tmp_path, trained_lm, quantize, check):
    model, held_out = trained_lm
    f32 = export.tflite(model, str(tmp_path / "f32.tflite"))
    q = export.tflite(model, str(tmp_path / f"{quantize}.tflite"), quantize=quantize)
    assert os.path.getsize(q) < os.path.getsize(f32)
    inputs = {"token_ids": held_out[:, :-1]}
    expected = np.asarray(model(inputs))
    got = _run(q, inputs)["logits"]
    if check == "close":
        np.testing.assert_allclose(got, expected, atol=1e-2)
    else:
        agreement = (got.argmax(-1) == expected.argmax(-1)).mean()
        assert agreement >= 0.98, agreement
        assert (expected.argmax(-1) == held_out[:, 1:]).mean() > 0.5  # the model did learn something


def test_full_int8_with_representative_data(tmp_path, trained_lm):
    model, held_out = trained_lm
    rep = [{"token_ids": held_out[i : i + 1, :-1]} for i in range(20)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = export.tflite(model, str(tmp_path / "int8.tflite"), quantize="int8", representative_data=rep,
                             sequence_length=16)
    # The calibration's internal tf.lite.Interpreter deprecation notice is not passed on to the caller.
    assert not [w for w in caught if "tf.lite.Interpreter is deprecated" in str(w.message)]
    got = _run(path, {"token_ids": held_out[:1, :-1]})["logits"]
    assert got.shape == (1, 16, 40) and np.all(np.isfinite(got))
    with pytest.raises(ValueError, match="representative_data"):
        export.tflite(model, str(tmp_path / "x.tflite"), quantize="int8")
    with pytest.raises(ValueError, match="quantize"):
        export.tflite(model, str(tmp_path / "x.tflite"), quantize="int4")


def test_edge_generator_equals_cached_keras_decoding(tmp_path, causal_lm, seq2seq, tokenizer):
    lm_path = export.tflite_decoder(causal_lm, str(tmp_path / "lm.tflite"), max_length=24)
    gen = edge.Generator(lm_path)
    expected = generation.generate_ids(causal_lm, np.array([[5, 6, 7]], "int32"), 10).numpy()[0].tolist()
    got = gen.generate([5, 6, 7], max_new_tokens=10)
    assert got == expected[: len(got)] and len(set(got)) > 2 and len(got) >= 5
    assert int(np.argmax(gen.next_logits([5, 6, 7] + got[:4]))) == got[4]  # the step greedy decoding took
    with pytest.raises(ValueError, match="needs a seq2seq .* use `generate`"):
        gen.translate([5, 6, 7])
    with pytest.raises(ValueError, match="`source_ids` is required for a seq2seq file and refused"):
        gen.next_logits([5], source_ids=[4])
    for ids, shape in (([5.7, 6.0], r"shape \(2,\), dtype float64"), ([[5, 6, 7]], r"shape \(1, 3\), dtype int")):
        with pytest.raises(ValueError, match=r"`prompt_ids` must be one sequence of integer token ids.*" + shape):
            gen.generate(ids)  # not silently 5, nor a TypeError from deep inside

    s2s_path = export.tflite_decoder(seq2seq, str(tmp_path / "s2s.tflite"), max_length=16, source_length=12,
                                     tokenizer=tokenizer)
    gen = edge.Generator(s2s_path)
    source = tokenizer.tokenize(["open the file"]).to_list()[0]
    expected = generation.generate_ids(seq2seq, np.array([source], "int32"), 10).numpy()[0].tolist()
    got = gen.translate(source, max_new_tokens=10)
    assert got == expected[: len(got)] and len(got) >= 2
    assert int(np.argmax(gen.next_logits([START_ID] + got[:1], source_ids=source))) == got[1]
    # Tokenizer ops inside the same file (TF-Text registrar custom ops).
    assert gen.tokenize("open the file") == source
    assert gen.detokenize(source) == "open the file"
    with pytest.raises(ValueError, match="holds at most 12"):
        gen.translate(list(range(4, 20)))
    # More than the file's 16 decoder positions: it returned 16 tokens, no error.
    with pytest.raises(ValueError, match=r"`max_new_tokens` must be at most 16, the file's decoder positions"):
        gen.translate(source, max_new_tokens=20)
    assert gen.translate(source) == gen.translate(source, max_new_tokens=16)  # the default: all 16
    with pytest.raises(ValueError, match="seq2seq .* use `translate`"):  # encode's buffers would be read unset
        gen.generate([5, 6, 7])


@pytest.mark.parametrize("quantize", [None, "dynamic"])
@pytest.mark.parametrize("architecture", ["seq2seq", "causal_lm"])
def test_decoder_step_writes_its_caches_in_place_without_copying_them(tmp_path, causal_lm, seq2seq, architecture,
                                                                       quantize):
    """TFLite runs STRIDED_SLICE, GATHER and SELECT with reference kernels, element by element. A step that cut one
    stacked cache with them (`cache[i]`, `[:, 0]`) and wrote its slot with a select over the cache spent most of
    its time there (2.0 of 2.2 ms a step for `transformer-tiny` at 36b9357); cut by UNPACK, stacked back by PACK,
    and with grouped-query heads repeated by TILE, the caches were still copied three times a step (85% of a
    SmolLM2-135M step at the default 8,192 positions, 61bbb8d). Now each layer's keys and values are inputs of
    their own, each step output of the same name is the DYNAMIC_UPDATE_SLICE of that input, and no other op writes
    a tensor as large as one cache half. Both models here have grouped-query heads (4 query heads on 2): their
    cross-attention keys and values are not repeated either."""
    from tests.export.test_litertlm import _graph_ops, _read_tflite
    from tfformer.export.tflite import cache_names

    grouped = {**CFG, "num_heads": 4, "num_key_value_heads": 2}
    if architecture == "seq2seq":
        config = models.TransformerConfig(vocabulary_size=seq2seq.config.vocabulary_size, **grouped)
        model = spread(models.build_seq2seq(config), seed=4)
    else:
        config = models.TransformerConfig(architecture="causal_lm", vocabulary_size=causal_lm.config.vocabulary_size,
                                          **grouped)
        model = spread(models.build_causal_lm(config), seed=3)
    # A source of 8 keeps every tensor but the caches below a cache half's size (`half`).
    path = export.tflite_decoder(model, str(tmp_path / "m.tflite"), max_length=16, quantize=quantize,
                                 source_length=8 if architecture == "seq2seq" else None)
    flat, names = _read_tflite(path)
    (signature,) = [s for s in flat.signatureDefs if s.signatureKey == b"decode_step"]
    graph = flat.subgraphs[signature.subgraphIndex]
    ops = _graph_ops(flat, names, graph)
    config = model.config
    half = config.key_value_heads * 16 * config.head_dim  # one layer's keys (K, S, H)
    inputs, outputs = ({item.name.decode(): item.tensorIndex for item in items if item.name.startswith(b"cache_")}
                       for items in (signature.inputs, signature.outputs))
    assert sorted(inputs) == sorted(outputs) == sorted(cache_names(config.num_decoder_layers))
    writes = {op.outputs[0]: op.inputs[0] for name, op in ops if name == "DYNAMIC_UPDATE_SLICE"}
    assert {name: writes.get(index) for name, index in outputs.items()} == inputs
    readers = {}  # tensor -> names of the ops that read it
    for name, op in ops:
        for tensor in op.inputs:
            readers.setdefault(tensor, []).append(name)
    # Each cache input is read by its write alone; the written cache, and each cross-attention input, by the
    # attention's products alone (no TILE, PACK, UNPACK or slice of them).
    assert all(readers.get(index) == ["DYNAMIC_UPDATE_SLICE"] for index in inputs.values()), readers
    cross = [item.tensorIndex for item in signature.inputs if item.name.startswith(b"cross_")]
    assert len(cross) == (2 * config.num_decoder_layers if architecture == "seq2seq" else 0)
    assert all(set(readers.get(index, ())) == {"BATCH_MATMUL"} for index in list(outputs.values()) + cross), readers
    large = [(name, int(np.prod(graph.tensors[op.outputs[0]].shape))) for name, op in ops
             if name != "DYNAMIC_UPDATE_SLICE" and np.prod(graph.tensors[op.outputs[0]].shape) >= half]
    assert not large, large  # no op makes a tensor of a cache's size but the writes
    if quantize:
        return  # int8 weights: the float32 file's numbers are checked below
    gen = edge.Generator(path)
    if architecture == "causal_lm":  # the grouped products give the Keras model's logits (uncached, at once)
        ids = [5, 6, 7, 9, 2, 11, 30]
        want = np.asarray(model({"token_ids": np.array([ids], "int32")}))[0, -1]
        np.testing.assert_allclose(gen.next_logits(ids), want, rtol=1e-4, atol=1e-4)
        assert np.abs(want).max() > 0.1  # not a degenerate model
    else:  # the encoder's and the decoder's logits after three target tokens
        source, target = [9, 4, 11, 3], [START_ID, 7, 12]
        inputs = {"encoder_token_ids": np.array([source], "int32"), "decoder_token_ids": np.array([target], "int32")}
        want = np.asarray(model(inputs))[0, -1]
        np.testing.assert_allclose(gen.next_logits(target, source_ids=source), want, rtol=1e-4, atol=1e-4)
        assert np.abs(want).max() > 0.1


def test_generator_refuses_files_of_the_older_layout(tmp_path):
    """A decoder file of one stacked `cache` (before per-layer caches) gets a clear error, not a KeyError: a tiny
    stand-in with that signature."""
    import tensorflow as tf

    class Stacked(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([1, 1], tf.int32, name="token_ids"),
                                      tf.TensorSpec([1, 1, 2, 2, 4, 8], tf.float32, name="cache"),
                                      tf.TensorSpec([], tf.int32, name="index")])
        def decode_step(self, token_ids, cache, index):
            step = tf.reduce_sum(cache) + tf.cast(token_ids[0, 0] + index, tf.float32)
            return {"logits": tf.fill([1, 1, 5], step), "cache": cache * 2.0}

    module = Stacked()
    saved = str(tmp_path / "old")
    tf.saved_model.save(module, saved, signatures={"decode_step": module.decode_step})
    path = tmp_path / "old.tflite"
    path.write_bytes(tf.lite.TFLiteConverter.from_saved_model(saved, signature_keys=["decode_step"]).convert())
    with pytest.raises(ValueError, match="older layout .*write it again with tfformer.export.tflite_decoder"):
        edge.Generator(str(path))


def test_edge_loops_name_a_path_that_is_not_a_tflite_file(tmp_path):
    """A missing path, a directory and a file of another kind get errors that name it (LiteRT's own, "Failed to
    build flatbuffer model", does not)."""
    (tmp_path / "notes.tflite").write_text("not a model")
    for cls in (edge.Generator, edge.Transcriber):
        for path in (tmp_path / "missing.tflite", tmp_path):
            with pytest.raises(FileNotFoundError, match=f"`path` must be a .tflite file. Received: path='{path}'"):
                cls(str(path))
        with pytest.raises(ValueError, match=f"`path` '{tmp_path / 'notes.tflite'}' is not a TFLite file LiteRT"):
            cls(str(tmp_path / "notes.tflite"))
