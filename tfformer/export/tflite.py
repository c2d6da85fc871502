"""TFLite / LiteRT files: the token-id model (builtin ops only) and a single-step decoder for devices.

Run them with `ai_edge_litert.interpreter.Interpreter` (`tf.lite.Interpreter`
is deprecated). Only builtin ops are used for the id models: Flex
(SELECT_TF_OPS) cannot run in Python here and bloats apps. The decoder file
holds fixed-shape signatures (batch 1, cache of `max_length` slots) so the host
app owns the loop, as the TFLite GPU delegate has no WHILE op:

- causal LM: `decode_step(token_ids (1,1), index (), cache_keys_i (K,S,H), cache_values_i (K,S,H) for each layer
  i) -> {logits, cache_keys_i, cache_values_i}` (`K` key/value heads): every cache is an input of its own, and the
  step returns each under its input's name as the DYNAMIC_UPDATE_SLICE that wrote its slot, so
  `tfformer.edge.Generator` binds one buffer as both and a step writes only its slot (TFLite copies a slice of a
  stacked tensor element by element, and UNPACK, PACK or TILE copy a whole cache: none touches one)
- seq2seq: `encode(encoder_token_ids (1,S_src)) -> {cross_keys_i (1,K,S_src,H), cross_values_i (1,K,H,S_src),
  encoder_padding_mask}` and `decode_step(token_ids, index, cache_keys_i, cache_values_i, cross_keys_i,
  cross_values_i, encoder_padding_mask) -> {logits, cache_keys_i, cache_values_i}` (the cross-attention values
  transposed, as Whisper's; encode's outputs are bound as the step's inputs)
- Whisper (speech_seq2seq): `options() -> {prompt_ids (1,P), end_id (), suppress_ids, suppress_ids_begin}`
  (the decoding options as constants; the id lists end with a -1 that is never an id), `encode(input_features
  (1,3000,80)) -> {cross_keys_i (1,K,1500,H), cross_values_i (1,K,H,1500)}` and `decode_step(token_ids, index,
  cache_keys_i (K,S,H), cache_values_i (K,S,H), cross_keys_i, cross_values_i for each layer i) -> {logits,
  cache_keys_i, cache_values_i}`: every cache is an input of its own (TFLite copies a slice of a stacked tensor
  element by element), each self-attention half goes out as the DYNAMIC_UPDATE_SLICE that wrote the step's slot
  under its input's name (`tfformer.edge.Transcriber` binds one buffer as both, and encode's outputs as the
  step's inputs: nothing but the token, the index and the logits crosses the host per step), and the
  cross-attention values come transposed (XNNPACK then repacks them for each step's product with its vectorized
  routine, where values `(S, H)` took a scalar one). The encoder takes
  log-mel features, not a waveform: the host computes them (`tfformer.edge.Transcriber` does, in numpy), so
  the file needs no FFT (TFLite's RFFT2D takes only power-of-two lengths, Whisper's n_fft is 400). The logits
  are raw: the host adds Whisper's suppression (`suppress_ids` every step, `suppress_ids_begin` at the first)
  before its argmax. `prompt_ids` is the plain transcript's prompt; `decode_step` takes any id at any index, so
  the host feeds other prompts the same way (for timestamps: `<|startofprev|>`, the previous text, and the prompt
  without `<|notimestamps|>`; `tfformer.edge.Transcriber.segments`).

With `tokenizer=`, the same file also gets `tokenize` (text -> ids) and
`detokenize` (ids -> text) signatures built only from ops of the TF-Text TFLite
registrar (FastSentencepieceTokenize/Detokenize, RaggedTensorToTensor); run it
with `InterpreterWithCustomOps(custom_op_registerers=tf_text.tflite_registrar.SELECT_TFTEXT_OPS)`.
"""

import os
import tempfile
import warnings

import keras
import tensorflow as tf

from tfformer.checks import check_int
from tfformer.export import exact_int8
from tfformer.export import signatures as sig
from tfformer.files import write_atomic
from tfformer.layers.decode_forms import DecodeForms
from tfformer.models.sentence_encoder import SentenceEncoder
from tfformer.models.whisper import WhisperModel

QUANTIZE = (None, "dynamic", "float16", "int8")


def _converter(saved_model_dir, signature_keys, quantize, representative_data, custom_ops=False):
    if quantize not in QUANTIZE:
        raise ValueError(f"`quantize` must be one of {QUANTIZE}. Received: quantize={quantize!r}")
    converter = tf.lite.TFLiteConverter.from_saved_model(saved_model_dir, signature_keys=signature_keys)
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS]
    converter.allow_custom_ops = custom_ops
    if quantize == "dynamic":
        converter.optimizations = [tf.lite.Optimize.DEFAULT]
    elif quantize == "float16":
        converter.optimizations = [tf.lite.Optimize.DEFAULT]
        converter.target_spec.supported_types = [tf.float16]
    elif quantize == "int8":
        if representative_data is None:
            raise ValueError("quantize='int8' needs `representative_data`: an iterable of input dicts for calibration.")
        converter.optimizations = [tf.lite.Optimize.DEFAULT]
        converter.representative_dataset = lambda: ({k: tf.constant(v) for k, v in d.items()}
                                                    for d in representative_data)
    return converter


def _write(converter, path):
    with warnings.catch_warnings():
        # int8 calibration runs TF's own tf.lite.Interpreter inside convert(); its deprecation notice is
        # about TF's code, not the caller's (our files run with ai_edge_litert).
        warnings.filterwarnings("ignore", message=r"\s*Warning: tf\.lite\.Interpreter is deprecated",
                                category=UserWarning)
        content = converter.convert()
    return write_atomic(path, content)


def _input_specs(model, sequence_length, batch_size=None):
    return [{inp.name: tf.TensorSpec([batch_size, sequence_length], tf.int32, name=inp.name) for inp in model.inputs}]


def tflite(model, path, quantize=None, representative_data=None, sequence_length=None, batch_size=None):
    """Convert the token-id model (`predict_ids`: ids -> logits/outputs) to a .tflite file with builtin ops only.

    A `SentenceEncoder` takes `token_ids` and `padding_mask` and returns `embedding` (tokenize on the host,
    e.g. with `model.tokenize`).

    Args:
        model: a tfformer Keras model.
        path: output file.
        quantize: `None` (float32), `"dynamic"` (int8 weights), `"float16"`, `"int8"` (full integer; needs
            `representative_data`, an iterable of input dicts), or `"gguf"`: for a model converted from a Q8_0 /
            Q4_1 GGUF (SmolLM2), its block weights stored exactly as int8 with float16 block scales
            (`tfformer.export.exact_int8`), so the logits equal the float32 file's to float rounding.
        sequence_length: fix the sequence length (static shapes convert to fewer ops); `None` keeps it dynamic.
        batch_size: fix the batch size too. With both fixed every shape is static: the converter folds the
            shape arithmetic away and XNNPACK takes the whole graph (docs/performance.md,
            "TFLite"). `None` keeps the batch dynamic (`resize_tensor_input`).
    """
    if quantize not in QUANTIZE + ("gguf",):
        raise ValueError(f"`quantize` must be one of {QUANTIZE + ('gguf',)}. Received: quantize={quantize!r}")
    config = getattr(model, "config", None)
    # Learned positions end at max_sequence_length (sinusoidal and rotary ones go on).
    limit = config.max_sequence_length if getattr(config, "position", None) == "learned" else None
    check_int("sequence_length", sequence_length, allow_none=True, maximum=limit,
              expected=None if limit is None else f"an integer in [1, {limit}] (the model's learned positions)")
    check_int("batch_size", batch_size, allow_none=True)
    with tempfile.TemporaryDirectory() as tmp:
        archive = keras.export.ExportArchive()
        # Not `track(model)`: that would also save a task's `preprocessor` (hash tables, not TFLite ops); the
        # endpoints track the variables they use.
        # A SentenceEncoder's output is `embedding`, as in its SavedModel's `predict_ids`.
        output_name = sig.EMBEDDING if isinstance(model, SentenceEncoder) else sig.LOGITS

        def predict(inputs):
            outputs = model(inputs)
            return outputs if isinstance(outputs, dict) else {output_name: outputs}

        archive.add_endpoint(sig.PREDICT_IDS, predict, input_signature=_input_specs(model, sequence_length, batch_size))
        archive.write_out(tmp, verbose=False)
        if quantize != "gguf":
            return _write(_converter(tmp, [sig.PREDICT_IDS], quantize, representative_data), path)
        return _requantized(_converter(tmp, [sig.PREDICT_IDS], None, None), model, tmp, path)


def _requantized(converter, model, tmp, path):
    """`quantize="gguf"`: the float32 file, written to `tmp`, with its GGUF block weights stored as int8 at `path`."""
    float_path = _write(converter, os.path.join(tmp, "float32.tflite"))
    # The norm scales the converter folds into the next matmul's weights: the rewrite takes them out again.
    scales = [keras.ops.convert_to_numpy(w) for w in model.weights if len(w.shape) == 1]
    summary = exact_int8.requantize_blocks(float_path, path, input_scales=scales)
    if not summary["q8_0"] and not summary["q4_1"]:
        os.remove(path)
        raise ValueError("quantize='gguf' found no Q8_0 / Q4_1 block weights in the model: it is for models "
                         "converted from a GGUF (e.g. models.from_preset('smollm2-135m-instruct')).")
    return path


class _StackedKeysValues:
    """A read-only cross-attention cache `(B, 2, K, S, H)` held as its keys and values `(B, K, S, H)`: the
    attention reads `cache[:, 0]` and `cache[:, 1]`, which here are the tensors themselves, not slices."""

    __slots__ = ("keys", "values")

    def __init__(self, keys, values):
        self.keys, self.values = keys, values

    def __getitem__(self, item):
        if not (isinstance(item, tuple) and len(item) == 2 and item[0] == slice(None) and item[1] in (0, 1)):
            raise IndexError(f"A stacked keys/values view takes [:, 0] or [:, 1]. Received: {item!r}")
        return self.keys if item[1] == 0 else self.values


def _speech_endpoints(model, step_specs):
    """Whisper's `options` (the decoding options, constants), `encode` (log-mel features -> per-layer
    cross-attention keys/values) and `decode_step`."""
    config = model.config
    num_frames = 2 * config.max_source_positions  # one 30-second window: 3000 frames
    features_spec = sig.features_spec(num_frames, config.num_mel_bins, batch=1)
    # The decoding options travel in the file; the -1 sentinel (never an id) keeps each list non-empty.
    options = {
        "prompt_ids": tf.constant([list(model.prompt)], tf.int32),  # (1, P)
        "end_id": tf.constant(model.end_id, tf.int32),
        "suppress_ids": tf.constant(list(model.suppress_ids) + [-1], tf.int32),
        "suppress_ids_begin": tf.constant(list(model.suppress_ids_begin) + [-1], tf.int32),
    }

    def encode(input_features):
        outputs, _ = model.encode(input_features)  # (1, 1500, D); Whisper has no encoder padding mask
        return _cross_outputs(model, outputs)

    step_specs = {**step_specs, **_cross_specs(config, config.max_source_positions)}

    def decode_step(inputs):
        logits, caches = model.decode_step(inputs[sig.TOKEN_IDS], _caches(inputs), inputs["index"], _cross(inputs),
                                           None, plan=_FileForms())
        return {sig.LOGITS: logits, **_cache_outputs(caches)}

    return {"options": (lambda: options, []), "encode": (encode, [features_spec]),
            "decode_step": (decode_step, [step_specs])}


def tflite_decoder(model, path, max_length=None, source_length=None, quantize=None, tokenizer=None):
    """Write the single-step decoder (see the module docstring) for `model` to `path`.

    Llama-style causal LMs (SmolLM2: RMSNorm, rotary positions at the cache index, grouped-query caches
    `(K, max_length, H)` per layer and half with `K` key/value heads, SwiGLU) convert with builtin ops like the
    others.

    Args:
        model: a tfformer `CausalLM`, `Seq2SeqTransformer` or `WhisperModel` (run it with
            `tfformer.edge.Transcriber`).
        path: output file.
        max_length: int. Cache positions (prompt + new tokens), at most `max_sequence_length` (the default).
            Every step reads the whole cache (and writes one slot), so keep it to what the app needs.
        source_length: int. Seq2seq: source positions of `encode` (default `max_sequence_length`). Not for
            Whisper, whose encoder always takes one 30-second window.
        quantize: `None` (float32), `"dynamic"` (int8 weights, `Optimize.DEFAULT`), `"float16"`, or
            `"gguf"`: for a model converted from a Q8_0 / Q4_1 GGUF (SmolLM2), its block weights stored exactly
            as int8 with float16 block scales (`tfformer.export.exact_int8`), so the logits equal the float32
            file's to float rounding; the weights are rebuilt at each step, so it decodes slower than float32.
        tokenizer: a `SubwordTokenizer`, whose TF-Text TFLite ops go into the file (`tokenize`/`detokenize`
            signatures). A `BytePairTokenizer`'s ops are not TFLite ops: keep it on the host
            (`tfformer.edge.Generator(path, tokenizer=...)`).
    """
    config = _check_decoder_arguments(model, max_length, source_length, quantize, tokenizer)
    max_length = max_length or config.max_sequence_length
    step_specs = {sig.TOKEN_IDS: tf.TensorSpec([1, 1], tf.int32, name=sig.TOKEN_IDS),
                  "index": tf.TensorSpec([], tf.int32, name="index")}
    for name in cache_names(config.num_decoder_layers):  # a split cache per layer and half
        step_specs[name] = tf.TensorSpec([config.key_value_heads, max_length, config.head_dim], tf.float32, name=name)
    if config.architecture == "causal_lm":
        endpoints = _causal_lm_endpoints(model, step_specs)
    elif config.architecture == "speech_seq2seq":
        if not isinstance(model, WhisperModel):
            raise ValueError(f"A speech_seq2seq decoder file needs a `tfformer.models.WhisperModel` (its prompt, "
                             f"suppression and end id). Received: model={type(model).__name__}")
        if source_length is not None or tokenizer is not None:
            raise ValueError("A Whisper decoder file takes 30-second windows of log-mel frames and keeps its "
                             "byte-level BPE on the host: pass neither `source_length` nor `tokenizer`. Received: "
                             f"source_length={source_length!r}, tokenizer={type(tokenizer).__name__}")
        endpoints = _speech_endpoints(model, step_specs)
    elif config.architecture == "seq2seq":
        source_length = source_length or config.max_sequence_length
        endpoints = _seq2seq_endpoints(model, source_length, step_specs)
    else:
        raise ValueError(f"A decoder file needs a seq2seq, speech_seq2seq or causal_lm model. Received "
                         f"architecture={config.architecture!r}")
    if tokenizer is not None:
        endpoints.update(_tokenizer_endpoints(tokenizer, source_length or max_length))
    with tempfile.TemporaryDirectory() as tmp:
        archive = keras.export.ExportArchive()
        # Not `track(model)`: that would also save a task's `preprocessor` (hash tables, not TFLite ops); the
        # endpoints track the variables they use.
        if tokenizer is not None:
            archive.track(tokenizer)
        for name, (fn, spec) in endpoints.items():
            archive.add_endpoint(name, fn, input_signature=spec)
        archive.write_out(tmp, verbose=False)
        converter = _converter(tmp, list(endpoints), None if quantize == "gguf" else quantize, None,
                               custom_ops=tokenizer is not None)
        if quantize != "gguf":
            return _write(converter, path)
        return _requantized(converter, model, tmp, path)


def _check_decoder_arguments(model, max_length, source_length, quantize, tokenizer):
    """`tflite_decoder`'s argument checks; returns `model.config`."""
    config = getattr(model, "config", None)
    if not isinstance(model, keras.Model) or config is None:
        raise ValueError(f"`model` must be a tfformer CausalLM, Seq2SeqTransformer or WhisperModel. Received: "
                         f"model={type(model).__name__}")
    limit = config.max_sequence_length
    for name, value in (("max_length", max_length), ("source_length", source_length)):
        check_int(name, value, maximum=limit, allow_none=True,
                  expected=f"an integer in [1, max_sequence_length={limit}]")
    if quantize not in (None, "dynamic", "float16", "gguf"):
        raise ValueError(f"`quantize` must be None, 'dynamic', 'float16' or 'gguf' for a decoder file (full int8 "
                         f"needs calibration data for the cache). Received: quantize={quantize!r}")
    if tokenizer is not None and not (hasattr(tokenizer, "tokenize_for_tflite")
                                      and hasattr(tokenizer, "detokenize_for_tflite")):
        raise ValueError(f"`tokenizer` ({type(tokenizer).__name__}) has no TFLite ops (`tokenize_for_tflite`); keep "
                         "it on the host with `tfformer.edge.Generator(path, tokenizer=tokenizer)` and pass "
                         "tokenizer=None here.")
    return config


class _FileForms(DecodeForms):
    """The forms of a decoder file's step (batch 1): per-layer split self-attention caches `(K, S, H)` read in place,
    each step's slot written with DYNAMIC_UPDATE_SLICE (`in_place_cache_writes`) instead of a select over the whole
    cache; cross-attention keys `(1, K, S, H)` and transposed values `(1, K, H, S)`. Each group of `N / K` query
    heads is one batched matmul against its key/value head: no repeated copy of a cache (TFLite's TILE, at every
    step)."""

    def __init__(self):
        super().__init__(in_place_cache_writes=True)

    def shared_heads(self, x, q, groups):
        return x  # `dot` and `mix` read each key/value head for its group of query heads

    def key_heads(self, k, q):
        # The keys repeated for each group of query heads (additive scores are not a product).
        k = k if len(k.shape) == 4 else k[None]  # (K, S, H) -> (1, K, S, H)
        return tf.repeat(tf.cast(k, q.dtype), q.shape[1] // k.shape[1], axis=1)  # (1, N, S, H)

    def dot(self, q, k):
        b, heads, t, head_dim = _one_row(q)  # (1, N, T, H)
        kv = k.shape[-3]
        q = tf.reshape(tf.cast(q, k.dtype), list(k.shape[:-3]) + [kv, heads // kv * t, head_dim])  # ([1,] K, G*T, H)
        scores = tf.matmul(q, k, transpose_b=True)  # ([1,] K, G*T, S)
        return tf.reshape(scores, [b, heads, t, k.shape[-2]])  # (1, N, T, S)

    def mix(self, weights, v, dtype):
        b, heads, t, slots = _one_row(weights)  # (1, N, T, S)
        kv = v.shape[-3]
        if v.shape[-1 if len(v.shape) == 4 else -2] != slots or heads % kv:
            raise ValueError(f"A decoder file's values are (K, S, H) per layer, or cross-attention's transposed "
                             f"(1, K, H, S), with K dividing {heads} heads. Received: {v.shape} for {slots} slots")
        weights = tf.reshape(tf.cast(weights, v.dtype), list(v.shape[:-3]) + [kv, heads // kv * t, slots])
        # Self-attention values (K, S, H); cross-attention values transposed, (1, K, H, S).
        x = tf.matmul(weights, v, transpose_b=len(v.shape) == 4)  # ([1,] K, G*T, H)
        return tf.cast(tf.reshape(x, [b, heads, t, x.shape[-1]]), dtype)  # (1, N, T, H)


def _one_row(x):
    if x.shape[0] != 1:
        raise ValueError(f"A decoder file's step decodes one row. Received a batch of {x.shape[0]}")
    return x.shape


HALVES = ("keys", "values")


def cache_names(layers):
    """The names of a decoder file's self-attention caches: `cache_keys_i`, `cache_values_i` for each layer `i`,
    each a split cache `(K, S, H)`, an input of `decode_step` and its output of the same name."""
    return [f"cache_{half}_{i}" for i in range(layers) for half in HALVES]


def _caches(inputs):
    """The step's per-layer caches as the model's split caches: `((keys, values), ...)`, each `(K, S, H)`."""
    layers = sum(name.startswith("cache_keys_") for name in inputs)
    return tuple((inputs[f"cache_keys_{i}"], inputs[f"cache_values_{i}"]) for i in range(layers))


def _cache_outputs(caches):
    """The split caches a step wrote, under their inputs' names: each the DYNAMIC_UPDATE_SLICE that wrote its slot."""
    return dict(zip(cache_names(len(caches)), (half for pair in caches for half in pair)))


def _cross_specs(config, source_length):
    """Per layer, the cross-attention keys `(1, K, S_src, H)` and values, transposed, `(1, K, H, S_src)`."""
    specs = {}
    for i in range(config.num_decoder_layers):
        for half, shape in zip(HALVES, ([source_length, config.head_dim], [config.head_dim, source_length])):
            specs[f"cross_{half}_{i}"] = tf.TensorSpec([1, config.key_value_heads] + shape, tf.float32,
                                                       name=f"cross_{half}_{i}")
    return specs


def _cross_outputs(model, encoder_outputs):
    """`encode`'s per-layer cross-attention keys `(1, K, S_src, H)` and values `(1, K, H, S_src)` (`_cross_specs`),
    computed once a source; the values transposed (XNNPACK then repacks them for each step's product with its
    vectorized routine, where values `(S, H)` took a scalar one)."""
    cross = {}
    for i, block in enumerate(model.decoder_blocks):
        # (1, 2, K, S_src, H) cut along axis 1 (UNPACK: whole rows)
        keys, values = tf.unstack(block.compute_cross_attention_cache(encoder_outputs), axis=1)
        cross[f"cross_keys_{i}"] = keys
        cross[f"cross_values_{i}"] = tf.transpose(values, [0, 1, 3, 2])  # (1, K, S_src, H) -> (1, K, H, S_src)
    return cross


def _cross(inputs):
    """The step's per-layer cross-attention inputs as the read-only caches the model reads (`_StackedKeysValues`)."""
    layers = sum(name.startswith("cross_keys_") for name in inputs)
    return [_StackedKeysValues(inputs[f"cross_keys_{i}"], inputs[f"cross_values_{i}"]) for i in range(layers)]


def _causal_lm_endpoints(model, step_specs):
    def decode_step(inputs):
        logits, caches = model.decode_step(inputs[sig.TOKEN_IDS], _caches(inputs), inputs["index"], plan=_FileForms())
        return {sig.LOGITS: logits, **_cache_outputs(caches)}

    return {"decode_step": (decode_step, [step_specs])}


def _seq2seq_endpoints(model, source_length, step_specs):
    config = model.config
    src_spec = tf.TensorSpec([1, source_length], tf.int32, name="encoder_token_ids")
    mask_spec = tf.TensorSpec([1, source_length], tf.int32, name="encoder_padding_mask")

    def encode(encoder_token_ids):
        outputs, mask = model.encode(encoder_token_ids)
        return {**_cross_outputs(model, outputs), "encoder_padding_mask": tf.cast(mask, tf.int32)}

    step_specs = {**step_specs, **_cross_specs(config, source_length), "encoder_padding_mask": mask_spec}

    def decode_step(inputs):
        logits, caches = model.decode_step(inputs[sig.TOKEN_IDS], _caches(inputs), inputs["index"], _cross(inputs),
                                           tf.cast(inputs["encoder_padding_mask"], tf.bool), plan=_FileForms())
        return {sig.LOGITS: logits, **_cache_outputs(caches)}

    return {"encode": (encode, [src_spec]), "decode_step": (decode_step, [step_specs])}


def _tokenizer_endpoints(tokenizer, text_length):
    def tokenize(text):
        ids = tokenizer.tokenize_for_tflite(text)  # FastSentencepieceTokenize only
        return {sig.TOKEN_IDS: ids.to_tensor(shape=[None, text_length])}

    def detokenize(token_ids):
        return {sig.TEXT: tokenizer.detokenize_for_tflite(token_ids)}

    return {"tokenize": (tokenize, [tf.TensorSpec([1], tf.string, name=sig.TEXT)]),
            "detokenize": (detokenize, [tf.TensorSpec([1, None], tf.int32, name=sig.TOKEN_IDS)])}
