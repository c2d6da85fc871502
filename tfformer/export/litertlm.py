"""LiteRT-LM bundles: a tfformer causal LM as one `.litertlm` file that Google's LiteRT-LM runtime runs.

LiteRT-LM (`pip install litert-lm-api`: `litert_lm.Engine`, the C++ runtime its Android, iOS and desktop APIs
share) loads a bundle of a TFLite model, a tokenizer and an `LlmMetadata` proto, and owns the whole loop: prompt
template, tokenizer, prefill, decode, sampling, stop tokens. The TFLite model follows the runtime's contract, in
one of two forms (`kv_cache`):

- `"dynamic"` (the default; LiteRT-LM's CPU backend): signatures `prefill` (any `T`) and `decode` (`T` = 1), whose
  caches have a dynamic slot axis `S`. The runtime sizes them to the tokens so far: a prefill grows them by the
  slots it needs, decoding by its `kv_increment_size` (16 in LiteRT-LM 0.18's CPU settings) when they are full,
  so a step attends over about the slots filled so far, never over the whole context. Each signature also takes
  the runtime's additive `mask` `(1, 1, T, S)` float32 (0 where a query may look, a large negative number
  elsewhere), which the runtime requires.
- `"static"` (what LiteRT-LM's GPU backend takes): signatures `prefill_<T>` (one per prefill length `T`; the
  runtime covers a prompt with the longest ones, then the shortest that holds the rest) and `decode`, with `S` =
  `context_length` slots that every step attends over. No `mask`.

Both: inputs `tokens` `(1, T)` int32, `input_pos` `(T,)` int32 (the positions `input_pos[0]...`; a static
runtime pads a short chunk with token 0 at position 0), and one cache tensor per layer and half: keys
`kv_cache_k_<i>` `(1, K, S, H)` and values `kv_cache_v_<i>` transposed, `(1, K, H, S)` (`K` key/value heads; the
runtime reads the context length from axis 2 of the keys: a 3-D `(K, S, H)` cache made it take `H`). Both are read
by batched matmuls as they are, `q k^T` and `w v_t^T`, one per group of query heads, with no transposed or repeated
copy of the cache. Outputs: the same cache tensors (the runtime binds each to one buffer, in and out), and from
`decode` `logits` `(1, 1, V)`.

A step writes its `T` keys and values at `input_pos[0]` and attends over the slots up to each query's position
(the model's own causal mask from `input_pos[0]`; a dynamic step adds the runtime's mask to it, clipped to
`MASK_VALUE` so that the sum stays finite). `decode`, and a dynamic `prefill` (whose `T` the runtime cuts to the
prompt), write with DYNAMIC_UPDATE_SLICE, in place in the bound buffer; a static prefill writes with a select over
the cache, which drops any padding past the last slot. (LiteRT-LM 0.18 never runs a prefill longer than the slots
left, but a DYNAMIC_UPDATE_SLICE would move such a window back over cached positions.)

Memory: TensorFlow's converter holds many copies of the constants it folds (6.5 GB for SmolLM2-135M's 0.54 GB of
float32 weights, one signature). So the matrices of the model's dense layers reach it as signature inputs `(units,
in)` (the `FULLY_CONNECTED` filter layout, read by `tf.matmul(..., transpose_b=True)`, which needs no transpose),
and so does the token embedding table `(V, D)` (`TABLE`: the lookup's `GATHER` rows, and the filter of a tied
logits' `FULLY_CONNECTED`); `bind_kernels` then turns those inputs into constant tensors of the written file, one
buffer per matrix shared by every signature. The converter keeps only the norms. (With the table a constant it
held about ten copies of it, and folded the final norm's scale into a second table for the logits: `tfformer
export smollm2-135m-instruct --format litertlm` peaked at 4.36 GB against 2.94 GB, AMD EPYC Zen 4.) Before the
converter runs, the signatures are saved as a SavedModel and the matrices as `.npy` files, which the binding maps
from disk; a model that `task()` returned is then free. `tfformer export` hands its model over so, with oneDNN off
(whose CPU allocator never gives memory back): 1.91 GB against 2.97 GB, Intel Xeon model 207, for 0.51 GB of
weights, the peak now while the model is traced.

The tokenizer goes in as the runtime reads it: a `BytePairTokenizer` (SmolLM2) as a Hugging Face `tokenizer.json`
(`tokenizer_json`), a `SubwordTokenizer` as its SentencePiece model with the tokenizer's escapes of tabs and line
breaks in its normalizer and denormalizer (`sentencepiece_model`). The metadata holds the stop tokens (the
preset's `end_ids` and the padding id), the chat template (as `jinja_prompt_template`, after `TEMPLATE_PREAMBLE`),
the context length and greedy sampling. No start token: SmolLM2's chat template begins with `<|im_start|>`, which
the runtime would then refuse in a prompt.
"""

import os
import tempfile

import keras
import numpy as np
import tensorflow as tf

from tfformer.checks import check_int
from tfformer.cpu import release_freed_memory
from tfformer.files import atomic_path, write_atomic
from tfformer.layers.decode_forms import DecodeForms
from tfformer.layers.layer_utils import SplitCache, dense, write_cache
from tfformer.layers.masks import MASK_VALUE
from tfformer.models.causal_lm import CausalLM
from tfformer.tokens import PAD_ID

QUANTIZE = ("none", "int8", "int4")
KV_CACHES = ("dynamic", "static")
INT4_BLOCK = 32  # int4 weights in blocks of 32 inputs, each with a float16 scale
# What a chat app ships (the acceptance measures at least this), cut to the model's max_sequence_length.
DEFAULT_CONTEXT_LENGTH = 2048
# A short chat turn takes prefill_32; a long prompt goes through prefill_128 in chunks.
DEFAULT_PREFILL_LENGTHS = (32, 128)


def litertlm(task, path, quantize="none", context_length=None, prefill_lengths=None, kv_cache="dynamic"):
    """Write `task` (a tfformer `CausalLM` with its preprocessor) as a `.litertlm` bundle for LiteRT-LM.

    Args:
        task: a `tfformer.models.CausalLM` with a `preprocessor` (`BytePairTokenizer` or `SubwordTokenizer`), e.g.
            `tfformer.models.from_preset("smollm2-135m-instruct")` or a trained `gpt-mini` run; or a function of no
            arguments that returns one (`tfformer export` passes one). Nothing refers to the model that function
            returns once it is traced and its weights are saved to a temporary directory, so its memory is free
            before TensorFlow's converter runs; a model the caller holds stays in memory through the conversion.
            (With oneDNN on, TensorFlow's CPU allocator keeps freed memory for its own reuse: `tfformer export`
            runs with `TF_ENABLE_ONEDNN_OPTS=0`, `tfformer_command.tensorflow_environment`.)
        path: the output file, e.g. `"model.litertlm"`.
        quantize: `"none"` (float32 weights), `"int8"` (every `FULLY_CONNECTED` filter per channel) or `"int4"`
            (in blocks of 32 inputs; `bind_kernels`), the output projection included, and the embedding table in
            int8 (an `EMBEDDING_LOOKUP`, which dequantizes the rows it reads). A tied table is stored once, for the
            lookup and the logits (the final norm's scale, which the converter folds into the logits' filter, goes
            back to a `MUL` of the hidden state). A matrix that holds GGUF Q4_1 values (SmolLM2's) keeps them
            exactly (`gguf_int4_blocks`): its int4 blocks plus a float32 offset a block, which a second, small
            `FULLY_CONNECTED` applies to each block's sum of inputs. `tfformer export --format litertlm` passes
            `default_quantize(task)` (int4) unless told otherwise; this function's default stays float32.
        context_length: int. The tokens of a conversation (prompt + reply, all turns), the runtime's
            `max_num_tokens`: the default is `DEFAULT_CONTEXT_LENGTH` (2048), or the model's `max_sequence_length`
            when that is shorter. With `kv_cache="static"` also the cache's slots, which every step attends over.
        prefill_lengths: ints, only with `kv_cache="static"` (default `DEFAULT_PREFILL_LENGTHS`): the
            `prefill_<T>` signatures, each at most `context_length`.
        kv_cache: `"dynamic"` (default: caches that the runtime grows with the conversation, each step attending
            over the slots filled so far; LiteRT-LM's CPU backend) or `"static"` (`context_length` slots from the
            start, what its GPU backend takes; faster near a full context, where the runtime's copies of a growing
            cache cost a dynamic one about a fifth of its speed on an AMD Zen 5). Module docstring.

    Returns:
        `path`.

    Example:
    ```python
    lm = tfformer.models.from_preset("smollm2-135m-instruct")
    tfformer.export.litertlm(lm, "smollm2.litertlm")
    # in any process, without TensorFlow:
    import litert_lm
    engine = litert_lm.Engine("smollm2.litertlm", backend=litert_lm.Backend.CPU(thread_count=2))
    engine.create_conversation().send_message("What is the capital of France?")
    ```
    """
    from litert_lm_builder import litertlm_builder

    loader = callable(task) and not isinstance(task, keras.Layer)
    with tempfile.TemporaryDirectory() as tmp:
        # A model `task()` returns is an argument only: nothing refers to it once `_save_bundle_parts` returns.
        names, tokenizer_file = _save_bundle_parts(task() if loader else task, tmp, quantize, context_length,
                                                   prefill_lengths, kv_cache)
        model_path = _convert_and_bind(tmp, names, quantize, os.path.join(tmp, "model.tflite"))
        builder = litertlm_builder.LitertLmFileBuilder()
        builder.add_tflite_model(model_path, litertlm_builder.TfLiteModelType.PREFILL_DECODE)
        if tokenizer_file.endswith(".model"):  # a SubwordTokenizer's SentencePiece model
            builder.add_sentencepiece_tokenizer(tokenizer_file)
        else:
            builder.add_hf_tokenizer(tokenizer_file)
        builder.add_llm_metadata(os.path.join(tmp, "llm_metadata.pb"))
        with atomic_path(path) as out, open(out, "wb") as stream:
            builder.build(stream)
    return path


def _save_bundle_parts(task, directory, quantize, context_length, prefill_lengths, kv_cache):
    """Everything of `task` that the bundle needs, checked and saved in `directory`: its steps and matrices
    (`_save_steps_and_matrices`), its tokenizer and `llm_metadata.pb`. Returns the signature names and the
    tokenizer's file."""
    context_length, prefill_lengths = _check_arguments(task, quantize, context_length, prefill_lengths, kv_cache)
    names = _save_steps_and_matrices(task, directory, context_length, prefill_lengths, quantize, kv_cache)
    tokenizer = task.preprocessor
    if hasattr(tokenizer, "model_proto"):  # a SubwordTokenizer: its SentencePiece model, escapes included
        path = write_atomic(os.path.join(directory, "tokenizer.model"), sentencepiece_model(tokenizer.model_proto))
    else:
        path = tokenizer_json(tokenizer, os.path.join(directory, "tokenizer.json"))
    write_atomic(os.path.join(directory, "llm_metadata.pb"), llm_metadata(task, context_length))
    return names, path


def default_quantize(task):
    """What `tfformer export --format litertlm` writes without `--quantize`: `"int4"` (what an app ships), or
    `"int8"` when a dense layer's input width is not a multiple of `INT4_BLOCK`."""
    if not isinstance(task, CausalLM):
        return "int4"  # `litertlm` refuses the task, naming it
    widths = {int(kernel.shape[0]) for kernel in dense_kernels(task).values()}
    return "int8" if any(width % INT4_BLOCK for width in widths) else "int4"


def _check_arguments(task, quantize, context_length, prefill_lengths, kv_cache):
    """`litertlm`'s argument checks (`kv_cache` too, and `prefill_lengths` only with a static one); returns the
    context length and the sorted prefill lengths (None with a dynamic cache)."""
    config = getattr(task, "config", None)
    if not isinstance(task, CausalLM) or config is None or config.architecture != "causal_lm":
        raise ValueError(f"`task` must be a tfformer CausalLM (a decoder-only language model). Received: "
                         f"task={type(task).__name__}")
    if getattr(task, "preprocessor", None) is None:
        raise ValueError("`task` has no preprocessor (tokenizer), which the bundle must carry: load it with "
                         "`tfformer.models.from_preset(...)` or set `task.preprocessor`.")
    if quantize not in QUANTIZE:
        raise ValueError(f"`quantize` must be one of {QUANTIZE}. Received: quantize={quantize!r}")
    widths = sorted({int(kernel.shape[0]) for kernel in dense_kernels(task).values()})
    if quantize == "int4" and any(width % INT4_BLOCK for width in widths):
        raise ValueError(f"quantize='int4' quantizes blocks of {INT4_BLOCK} inputs: every dense layer's input width "
                         f"must be a multiple of {INT4_BLOCK}. Received input widths {widths}; use quantize='int8'.")
    limit = config.max_sequence_length
    check_int("context_length", context_length, maximum=limit, allow_none=True,
              expected=f"an integer in [1, max_sequence_length={limit}]")
    context_length = context_length or min(DEFAULT_CONTEXT_LENGTH, limit)
    if kv_cache not in KV_CACHES:
        raise ValueError(f"`kv_cache` must be one of {KV_CACHES}. Received: kv_cache={kv_cache!r}")
    if kv_cache == "dynamic":
        if prefill_lengths is not None:
            raise ValueError("`prefill_lengths` sets the prefill signatures of kv_cache='static'; a dynamic cache has "
                             f"one `prefill` of any length. Received: prefill_lengths={prefill_lengths!r}")
        return context_length, None
    prefill_lengths = DEFAULT_PREFILL_LENGTHS if prefill_lengths is None else prefill_lengths
    if isinstance(prefill_lengths, (str, bytes)) or not isinstance(prefill_lengths, (list, tuple)):
        raise ValueError(f"`prefill_lengths` must be a list of ints. Received: prefill_lengths={prefill_lengths!r}")
    for length in prefill_lengths:
        check_int("prefill_lengths", length, expected="a list of positive ints")
    # A prefill longer than the context would never run whole: cut to it.
    lengths = sorted({min(length, context_length) for length in prefill_lengths})
    if not lengths:
        raise ValueError("`prefill_lengths` must hold at least one length. Received: prefill_lengths=[]")
    return context_length, lengths


class _BundleForms(DecodeForms):
    """The forms of a bundle's steps (module docstring): dense layers read their matrices from the tensors `fed`
    (`{id(kernel): (units, in) tensor}`) instead of the kernels; the caches are the signature's own tensors, keys
    `(1, K, S, H)` and values transposed `(1, K, H, S)`, which the attention reads in place: each group of `N / K`
    query heads is one batched matmul against its key/value head (no repeated copy of the cache), and a step writes
    its slots in place (`in_place_cache_writes`: decode, a dynamic prefill) or by a select over the cache (a static
    prefill). `mask`: the runtime's additive mask `(1, 1, T, S)` (a dynamic cache's), added to the scores."""

    def __init__(self, fed, in_place_cache_writes, offsets=None, mask=None):
        super().__init__(in_place_cache_writes=in_place_cache_writes)
        self.fed = fed
        self.mask = mask  # the runtime's additive mask (1, 1, T, S), or None
        self.offsets = offsets or {}  # {id(kernel): (units, in/B) tensor}: `gguf_int4_blocks`' block offsets
        self._masks = {}  # {(use_causal_mask, window): the model's attention mask}, as the first layer made it

    def uses(self, x, kernel, bias=None):
        return id(kernel) in self.fed

    def shared_mask(self, key, compute):
        # The layers of a step attend with the first one's mask of their `key`: made once, not one RANGE, compare and
        # select a layer (12 ops of a layer's 74 in decode, with the shape reads below: 2,251 ops -> 1,870).
        if key not in self._masks:
            self._masks[key] = compute()
        return self._masks[key]

    def lookup(self, table, ids):
        return super().lookup(self.fed.get(id(table), table), ids)  # (B, T, D): a GATHER of the fed table's rows

    def logits(self, x, table):
        if id(table) not in self.fed:
            return super().logits(x, table)
        flat = tf.reshape(tf.cast(x, tf.float32), [-1, table.shape[1]])  # (B*T, D)
        y = tf.matmul(flat, self.fed[id(table)], transpose_b=True)  # (B*T, V): FULLY_CONNECTED, the table its filter
        return tf.reshape(y, tf.concat([tf.shape(x)[:-1], [table.shape[0]]], 0))  # (B, T, V)

    def dense(self, x, kernel, bias=None, start=0, stop=None):
        stop = kernel.shape[-1] if stop is None else stop
        if id(kernel) not in self.fed or (start, stop) != (0, kernel.shape[-1]):
            return dense(x, kernel, bias, start, stop)  # a slice of a fused kernel: not in a causal LM's steps
        flat = tf.reshape(tf.cast(x, tf.float32), [-1, kernel.shape[0]])  # (B*T, in)
        y = tf.matmul(flat, self.fed[id(kernel)], transpose_b=True)  # (B*T, units): FULLY_CONNECTED, no transpose
        if id(kernel) in self.offsets:  # + each block's offset times the block's sum of inputs
            blocks = tf.reshape(flat, [-1, kernel.shape[0] // INT4_BLOCK, INT4_BLOCK])  # (B*T, in/B, B)
            y = y + tf.matmul(tf.reduce_sum(blocks, -1), self.offsets[id(kernel)], transpose_b=True)  # (B*T, units)
        if bias is not None:
            y = y + tf.cast(bias, tf.float32)
        return tf.cast(tf.reshape(y, tf.concat([tf.shape(x)[:-1], [kernel.shape[-1]]], 0)), x.dtype)  # (B, T, units)

    def update_cache(self, cache, k, v, cache_index):
        keys, values = (cache.keys, cache.values) if isinstance(cache, SplitCache) else cache
        keys = write_cache(keys, tf.cast(k, keys.dtype), cache_index, self.in_place_cache_writes)  # (1, K, S, H)
        new = tf.transpose(tf.cast(v, values.dtype), [0, 1, 3, 2])  # (1, K, T, H) -> (1, K, H, T)
        if self.in_place_cache_writes:
            zero = tf.zeros((), tf.int32)
            start = [zero, zero, zero, tf.cast(cache_index, tf.int32)]
            values = keras.ops.slice_update(values, start, new)  # (1, K, H, S): DYNAMIC_UPDATE_SLICE
        else:
            offset = tf.range(values.shape[-1]) - cache_index  # slot s takes new[..., s - index]
            written = tf.logical_and(offset >= 0, offset < new.shape[-1])
            spread = tf.gather(new, tf.clip_by_value(offset, 0, new.shape[-1] - 1), axis=3)  # (1, K, H, S)
            values = tf.where(written, spread, values)
        return keys, values, (keys, values)

    def shared_heads(self, x, q, groups):
        return x  # `dot` and `mix` read each key/value head for its group of query heads

    def dot(self, q, k):
        b, heads, t, head_dim = q.shape
        # A step of a static length (decode) reads no shape: -1 for the slots.
        t, slots = (t, -1) if t is not None else (tf.shape(q)[2], tf.shape(k)[2])
        q = tf.reshape(tf.cast(q, k.dtype), [b, k.shape[1], -1, head_dim])  # (1, K, G*T, H)
        scores = tf.matmul(q, k, transpose_b=True)  # (1, K, G*T, S)
        scores = tf.reshape(scores, [b, heads, t, slots])  # (1, N, T, S)
        if self.mask is not None:  # the runtime's (its masked slots, which the model's own mask hides too)
            scores = scores + tf.maximum(self.mask, MASK_VALUE)
        return scores

    def mix(self, weights, v, dtype):
        b, heads, t = weights.shape[:3]
        rows, slots = (heads // v.shape[1] * t, -1) if t is not None else (-1, tf.shape(weights)[3])
        weights = tf.reshape(tf.cast(weights, v.dtype), [b, v.shape[1], rows, slots])  # (1, K, G*T, S)
        x = tf.matmul(weights, v, transpose_b=True)  # (1, K, G*T, H): values (1, K, H, S) read in place
        return tf.cast(tf.reshape(x, [b, heads, -1, v.shape[2]]), dtype)  # (1, N, T, H)


def dense_kernels(task):
    """The matrices of `task`'s dense layers, `{name: kernel}` with names `weight_<i>`, that reach the converter as
    inputs (module docstring)."""
    kernels = [w for w in task.weights if len(w.shape) == 2 and w.path.endswith("kernel")]
    return {f"weight_{i}": kernel for i, kernel in enumerate(kernels)}


TABLE = "embedding_table"  # the signature input of the token embedding table `(V, D)` (module docstring)


def _step_function(task, length, context_length, kernels, offsets=(), dynamic=False):
    """The `prefill_<length>` (or, for 1, `decode`) signature's function and its input specs; `dynamic`: the
    `prefill` (`length` None) or `decode` of a cache of any number of slots, with the runtime's `mask`."""
    config = task.config
    layers, heads, head_dim = config.num_decoder_layers, config.key_value_heads, config.head_dim
    specs = {"tokens": tf.TensorSpec([1, length], tf.int32, name="tokens"),
             "input_pos": tf.TensorSpec([length], tf.int32, name="input_pos")}
    names = [(f"kv_cache_k_{i}", f"kv_cache_v_{i}") for i in range(layers)]
    if dynamic:
        context_length = None
        specs["mask"] = tf.TensorSpec([1, 1, length, None], tf.float32, name="mask")  # (1, 1, T, S)
    for keys, values in names:
        specs[keys] = tf.TensorSpec([1, heads, context_length, head_dim], tf.float32, name=keys)  # (1, K, S, H)
        specs[values] = tf.TensorSpec([1, heads, head_dim, context_length], tf.float32, name=values)  # (1, K, H, S)
    table = task.token_embedding.embeddings
    specs[TABLE] = tf.TensorSpec(table.shape, tf.float32, name=TABLE)  # (V, D)
    for name, kernel in kernels.items():
        specs[name] = tf.TensorSpec([kernel.shape[1], kernel.shape[0]], tf.float32, name=name)  # (units, in)
        if name in offsets:
            specs[offsets_name(name)] = tf.TensorSpec([kernel.shape[1], kernel.shape[0] // INT4_BLOCK], tf.float32,
                                                      name=offsets_name(name))  # (units, in/B)
    decode = length == 1

    def step(inputs):
        # A static prefill does not write in place: its padding may run past the last slot (module docstring).
        fed = {id(kernel): inputs[name] for name, kernel in kernels.items()}
        fed[id(table)] = inputs[TABLE]
        forms = _BundleForms(fed, decode or dynamic,
                             {id(kernel): inputs[offsets_name(name)] for name, kernel in kernels.items()
                              if name in offsets}, inputs.get("mask"))
        caches = tuple((inputs[k], inputs[v]) for k, v in names)
        logits, caches = task.decode_step(inputs["tokens"], caches, inputs["input_pos"][0], last_only=True,
                                          plan=forms)
        outputs = {name: half for pair, cache in zip(names, caches) for name, half in zip(pair, cache)}
        if decode:
            outputs["logits"] = logits  # (1, 1, V)
        return outputs

    return step, [specs]


def _write_tflite(task, path, context_length, prefill_lengths, quantize, kv_cache):
    """The prefill and decode signatures as one TFLite file at `path` (builtin ops only), the dense layers' matrices
    in `quantize`, the caches `kv_cache` (`prefill_lengths` and `context_length`'s slots: a static cache's)."""
    with tempfile.TemporaryDirectory() as tmp:
        names = _save_steps_and_matrices(task, tmp, context_length, prefill_lengths, quantize, kv_cache)
        return _convert_and_bind(tmp, names, quantize, path)


def _save_steps_and_matrices(task, directory, context_length, prefill_lengths, quantize, kv_cache):
    """What the converter and `bind_kernels` take of `task`, saved in `directory`: the signatures `names` (returned)
    as a SavedModel (`steps/`), and their matrix inputs as `.npy` files (`matrices/`): each dense layer's float32
    filter `(units, in)`, the table `(V, D)`, and for a GGUF Q4_1 matrix kept exactly (`quantize="int4"`) its int4
    values in the filter's place, its block offsets, and its block scales in `matrices/scales/`. Nothing made here
    stays in memory (module docstring: the converter's peak comes on top of what is held)."""
    kernels = dense_kernels(task)
    matrices = os.path.join(directory, "matrices")
    os.makedirs(os.path.join(matrices, "scales"))
    exact = set()
    for name, kernel in kernels.items():
        weights = np.ascontiguousarray(keras.ops.convert_to_numpy(kernel).T, np.float32)  # (units, in)
        blocks = gguf_int4_blocks(weights) if quantize == "int4" else None
        if blocks is not None:
            exact.add(name)
            weights = blocks[0]  # its shape is what `bind_kernels` reads of it
            np.save(os.path.join(matrices, "scales", f"{name}.npy"), blocks[1])
            np.save(os.path.join(matrices, f"{offsets_name(name)}.npy"), blocks[2])
        np.save(os.path.join(matrices, f"{name}.npy"), weights)
    np.save(os.path.join(matrices, f"{TABLE}.npy"),
            np.asarray(keras.ops.convert_to_numpy(task.token_embedding.embeddings), np.float32))  # (V, D)
    archive = keras.export.ExportArchive()
    dynamic = kv_cache == "dynamic"
    lengths = [None] if dynamic else list(prefill_lengths)
    names = ["prefill"] if dynamic else [f"prefill_{length}" for length in prefill_lengths]
    names.append("decode")
    for name, length in zip(names, lengths + [1]):
        fn, specs = _step_function(task, length, context_length, kernels, exact, dynamic)
        archive.add_endpoint(name, fn, input_signature=specs)
    archive.write_out(os.path.join(directory, "steps"), verbose=False)
    return names


def _convert_and_bind(directory, names, quantize, path):
    """The TFLite file at `path` from `_save_steps_and_matrices`'s `directory`: the converter's file of the signatures
    `names`, its matrix inputs bound (`bind_kernels`) from the saved files, which are mapped, not read into memory."""
    release_freed_memory()  # the traced steps, and a model nothing refers to any more
    converter = tf.lite.TFLiteConverter.from_saved_model(os.path.join(directory, "steps"), signature_keys=names)
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS]
    content = converter.convert()
    del converter
    release_freed_memory()  # the converter's: about 0.4 GB that the binding below would otherwise add to

    def load(folder):
        return {entry.name[:-len(".npy")]: np.load(entry.path, mmap_mode="r") for entry in os.scandir(folder)
                if entry.name.endswith(".npy")}

    matrices = os.path.join(directory, "matrices")
    arrays = load(matrices)
    exact = {name: (arrays[name], scales) for name, scales in load(os.path.join(matrices, "scales")).items()}
    return write_atomic(path, bind_kernels(content, arrays, quantize, exact, tables=[TABLE]))


def offsets_name(name):
    """The signature input of the block offsets of the matrix input `name` (`gguf_int4_blocks`)."""
    return f"{name}_offsets"


def bind_kernels(content, arrays, quantize="none", exact=None, tables=()):
    """The TFLite flatbuffer `content` with the signature inputs named in `arrays` (`{name: float32 array}`) made
    constant tensors holding those arrays, float32 or quantized (`int4_blocks`, `int8_channels`: the formats of
    `litert_quantizer`'s `dynamic_wi4b32_afp32` and `dynamic_wi8c_afp32` recipes, which XNNPACK multiplies with
    activations quantized at run time); one set of buffers each, shared by every signature. Quantized, the
    converter's own constants are quantized too: the embedding tables (`_quantize_lookup_tables`) and the filters
    (`_quantize_constant_filters`), a tied table one buffer for both. Returns the new file's bytes, a memoryview.
    (litert_quantizer 0.11 itself, run on the bound file, quantized a shared buffer for one signature's tensor and
    left the other signatures' tensors on it float32: a file the runtime refuses.)

    `exact` (`{name: (q, scales)}`, from `gguf_int4_blocks`) stores those matrices' int4 blocks as they are (their
    `arrays` entry need only have the shape), and their block offsets (`arrays[offsets_name(name)]`) in float32.

    `tables` (names in `arrays`): embedding tables `(V, D)`, read by `GATHER`s of rows and by a tied logits'
    `FULLY_CONNECTED`. They are bound in float32, and quantized (in int8) with the converter's own constants.

    Each must be an input of every signature, of the array's shape, read only as a `FULLY_CONNECTED` filter (a
    table also as a `GATHER`'s rows).
    """
    exact = exact or {}
    float32 = {offsets_name(name) for name in exact} | set(tables)
    import flatbuffers
    from ai_edge_litert import schema_py_generated as schema

    model = schema.ModelT.InitFromPackedBuf(content, 0)
    stored = {}  # name -> (buffer, tensor type, quantization of the filter, scales buffer or None)
    for signature in model.signatureDefs:
        graph = model.subgraphs[signature.subgraphIndex]
        bound = {item.tensorIndex: _name(item.name) for item in signature.inputs if _name(item.name) in arrays}
        missing = set(arrays) - set(bound.values())
        if missing:
            raise ValueError(f"Signature {_name(signature.signatureKey)} does not read the matrices {sorted(missing)}")
        _check_filters(schema, model, graph, bound, tables)
        for index, name in bound.items():
            tensor = graph.tensors[index]
            if list(tensor.shape) != list(arrays[name].shape):
                raise ValueError(f"{name}: tensor {list(tensor.shape)}, array {list(arrays[name].shape)}")
            if name not in stored:
                stored[name] = _store(schema, model, arrays[name], "none" if name in float32 else quantize,
                                      exact.get(name))
            _set_filter(schema, graph, tensor, stored[name])
        graph.inputs = [i for i in graph.inputs if i not in bound]
        signature.inputs = [item for item in signature.inputs if item.tensorIndex not in bound]
    if quantize != "none":
        matrices = {entry[0] for name, entry in stored.items() if name not in tables}  # their buffers, as stored
        _quantize_constant_filters(schema, model, quantize, _quantize_lookup_tables(schema, model), matrices)
    kept = sum(len(buffer.data) for buffer in model.buffers if buffer.data is not None)
    builder = flatbuffers.Builder(kept + len(content) + (1 << 20))  # the whole file: the builder never grows
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    return memoryview(builder.Bytes)[builder.Head():]  # the file's bytes, not copied


def _set_filter(schema, graph, tensor, stored):
    """Point the filter `tensor` of `graph` at its stored buffer (`_store`), with the int4 block scales as a float16
    tensor of this graph on the shared scales buffer."""
    tensor.buffer, tensor.type, tensor.quantization, scales = stored
    if scales is not None:
        scale_tensor = schema.TensorT()
        scale_tensor.name, scale_tensor.type, scale_tensor.buffer = tensor.name + b"_scales", 1, scales
        scale_tensor.shape = [int(tensor.shape[0]), int(tensor.shape[1]) // INT4_BLOCK]
        tensor.quantization = _blockwise(schema, len(graph.tensors))
        graph.tensors.append(scale_tensor)


def _quantize_lookup_tables(schema, model):
    """Replace each `GATHER` of rows (axis 0) from a constant float32 table `(V, D)`, the embedding lookup, with an
    `EMBEDDING_LOOKUP` of the same rows from the table quantized as a `FULLY_CONNECTED` filter `(units=V, in=D)`
    (`_store`'s int8 per row whatever the file's `quantize`; the kernel dequantizes the rows it reads), between
    `RESHAPE`s of the ids to `(N,)` and of the rows back to the `GATHER`'s shape. One buffer per table for every
    graph. Returns `{float32 table buffer: stored}` for `_quantize_constant_filters`; the float32 tables
    themselves stay for it to empty."""
    gather, lookup, reshape = (schema.BuiltinOperator.GATHER, schema.BuiltinOperator.EMBEDDING_LOOKUP,
                               schema.BuiltinOperator.RESHAPE)
    tables = {}  # float32 table buffer -> `_store`'s result
    for graph in model.subgraphs:
        operators = []
        quantized = {}  # float32 table buffer -> this graph's quantized table tensor
        for op in graph.operators:
            table = graph.tensors[op.inputs[0]]
            options = op.builtinOptions
            if (_builtin(model, op) != gather or len(table.shape) != 2
                    or table.type != schema.TensorType.FLOAT32 or table.buffer <= 0
                    or model.buffers[table.buffer].data is None or options.axis != 0 or options.batchDims != 0
                    or graph.tensors[op.inputs[1]].type != schema.TensorType.INT32):
                operators.append(op)
                continue
            if table.buffer not in tables:
                weights = _array(model.buffers[table.buffer].data, np.float32, table.shape)  # (V, D)
                # int8 even in an int4 file: SmolLM2's table in int4 took its perplexity from 26.0 to 31.3 (int8:
                # 26.1), with its matrices as the GGUF's; the GGUF itself holds it in 8 bits (Q8_0).
                tables[table.buffer] = _store(schema, model, weights, "int8")
            if table.buffer not in quantized:
                quantized[table.buffer] = _tensor(schema, graph, table.name + b"_quantized", table.shape,
                                                  schema.TensorType.FLOAT32)
                _set_filter(schema, graph, graph.tensors[quantized[table.buffer]], tables[table.buffer])
            ids, rows = graph.tensors[op.inputs[1]], graph.tensors[op.outputs[0]]
            count, width = int(np.prod(ids.shape)), int(table.shape[1])
            # A dynamic-length signature's ids (`-1` in their shape signature): N and the rows' shape at run time.
            dynamic = -1 in _signature(ids)
            shape = _tensor(schema, graph, ids.name + b"_flat_shape", [1], schema.TensorType.INT32,
                            _buffer(schema, model, np.array([-1 if dynamic else count], np.int32)))
            flat = _tensor(schema, graph, ids.name + b"_flat", [count], schema.TensorType.INT32,
                           signature=[-1] if dynamic else None)  # (N,)
            found = _tensor(schema, graph, rows.name + b"_flat", [count, width], schema.TensorType.FLOAT32,
                            signature=[-1, width] if dynamic else None)  # (N, D)
            if list(_signature(rows)).count(-1) > 1:
                raise ValueError(f"The lookup's rows {list(_signature(rows))} have more than one dynamic axis")
            back = _tensor(schema, graph, rows.name + b"_shape", [len(rows.shape)], schema.TensorType.INT32,
                           _buffer(schema, model, np.array(list(_signature(rows)), np.int32)))
            operators += [_operator(schema, model, reshape, [op.inputs[1], shape], [flat]),
                          _operator(schema, model, lookup, [flat, quantized[table.buffer]], [found]),
                          _operator(schema, model, reshape, [found, back], [op.outputs[0]])]  # (N, D) -> (..., D)
        graph.operators = operators
    return tables


def _signature(tensor):
    """A tensor's shape signature: its shape with `-1` on each dynamic axis."""
    return tensor.shape if tensor.shapeSignature is None or not len(tensor.shapeSignature) else tensor.shapeSignature


def _tensor(schema, graph, name, shape, tensor_type, buffer=0, signature=None):
    """Append a tensor to `graph` (`signature`: its shape signature, if it has dynamic axes); returns its index."""
    tensor = schema.TensorT()
    tensor.name, tensor.shape, tensor.type, tensor.buffer = name, [int(n) for n in shape], tensor_type, buffer
    if signature is not None:
        tensor.shapeSignature = [int(n) for n in signature]
    graph.tensors.append(tensor)
    return len(graph.tensors) - 1


def _builtin_code(code):
    """An operator code's builtin operator: the larger of the schema's two fields (codes past 127 are only in
    `builtinCode`; older converters wrote only `deprecatedBuiltinCode`)."""
    return max(code.builtinCode, code.deprecatedBuiltinCode)


def _builtin(model, op):
    """The builtin operator of `op` in `model`."""
    return _builtin_code(model.operatorCodes[op.opcodeIndex])


def _operator(schema, model, builtin, inputs, outputs):
    """A builtin operator (its code added to `model` if missing) from tensors `inputs` to `outputs`."""
    codes = [_builtin_code(code) for code in model.operatorCodes]
    if builtin not in codes:
        code = schema.OperatorCodeT()
        code.builtinCode, code.deprecatedBuiltinCode, code.version = builtin, min(builtin, 127), 1
        model.operatorCodes.append(code)
        codes.append(builtin)
    op = schema.OperatorT()
    op.opcodeIndex, op.inputs, op.outputs = codes.index(builtin), list(inputs), list(outputs)
    return op


def _quantize_constant_filters(schema, model, quantize, tables, bound=()):
    """Quantize the float32 `FULLY_CONNECTED` filters that are constants of the file, as the bound matrices are:
    a tied embedding's logits projection. A filter that is a lookup table of `tables` (`_quantize_lookup_tables`)
    reads the table's quantized buffer: tied weights stored once. The buffers in `bound` (what `bind_kernels`
    stored, in their formats: float32 block offsets stay so) are left as they are. Buffers no tensor reads any more
    are emptied."""
    fully_connected = schema.BuiltinOperator.FULLY_CONNECTED
    stored = {}  # float32 buffer -> `_store`'s result
    for graph in model.subgraphs:
        filters = {}  # float32 filter tensor -> this graph's tensor on its quantized buffer
        operators = []
        for op in graph.operators:
            if _builtin(model, op) != fully_connected or len(op.inputs) < 2:
                operators.append(op)
                continue
            index = op.inputs[1]
            tensor = graph.tensors[index]
            data = model.buffers[tensor.buffer].data if tensor.buffer > 0 else None
            if (tensor.type != schema.TensorType.FLOAT32 or data is None or not len(data) or len(tensor.shape) != 2
                    or tensor.buffer in bound or (quantize == "int4" and tensor.shape[1] % INT4_BLOCK)):
                operators.append(op)
                continue
            if tensor.buffer not in stored:
                if tensor.buffer in tables:
                    stored[tensor.buffer] = tables[tensor.buffer]
                else:
                    weights = _array(data, np.float32, tensor.shape)
                    stored[tensor.buffer] = _store(schema, model, weights, quantize)
            if index not in filters:
                filters[index] = _tensor(schema, graph, tensor.name + b"_quantized", tensor.shape,
                                         schema.TensorType.FLOAT32)
                _set_filter(schema, graph, graph.tensors[filters[index]], stored[tensor.buffer])
            op.inputs = [op.inputs[0], filters[index], *op.inputs[2:]]
            operators.append(op)
        graph.operators = operators
    read = {graph.tensors[i].buffer for graph in model.subgraphs for op in graph.operators for i in op.inputs if i >= 0}
    for index in set(stored) | set(tables):
        if index not in read:
            model.buffers[index].data = None


def _check_filters(schema, model, graph, bound, tables=()):
    """Raise unless every tensor of `bound` (`{index: name}`) is read only as a `FULLY_CONNECTED` filter, or, named
    in `tables`, also as a `GATHER`'s rows."""
    filter_read, rows_read = (schema.BuiltinOperator.FULLY_CONNECTED, 1), (schema.BuiltinOperator.GATHER, 0)
    for op in graph.operators:
        for position, index in enumerate(op.inputs):
            read = (_builtin(model, op), position)
            if index in bound and read != filter_read and not (bound[index] in tables and read == rows_read):
                raise ValueError(f"{bound[index]} is read by an op other than a FULLY_CONNECTED filter")


def _array(data, dtype, shape):
    """A buffer's bytes `data` (a uint8 array, or bytes) as an array of `dtype` and `shape`, without a copy."""
    return np.frombuffer(data, np.uint8).view(dtype).reshape([int(n) for n in shape])


def _buffer(schema, model, data):
    """Append a buffer holding the bytes of `data`; returns its index."""
    buffer = schema.BufferT()
    buffer.data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    model.buffers.append(buffer)
    return len(model.buffers) - 1


def _store(schema, model, weights, quantize, blocks=None):
    """`(buffer, tensor type, quantization, scales buffer or None)` of one filter `(units, in)` in `quantize`, or
    as the int4 `blocks` `(q, scales)` given (`gguf_int4_blocks`)."""
    if blocks is not None or quantize == "int4":
        packed, scales = (pack_int4(blocks[0]), blocks[1]) if blocks is not None else int4_blocks(weights)[:2]
        return _buffer(schema, model, packed), schema.TensorType.INT4, None, _buffer(schema, model, scales)
    if quantize == "int8":
        q, scales = int8_channels(weights)
        quantization = schema.QuantizationParametersT()
        quantization.scale, quantization.zeroPoint = scales.tolist(), [0] * len(scales)
        quantization.quantizedDimension = 0
        return _buffer(schema, model, q), schema.TensorType.INT8, quantization, None
    return _buffer(schema, model, weights), schema.TensorType.FLOAT32, None, None


def _blockwise(schema, scales_tensor):
    """The quantization of an int4 filter whose block scales are the tensor `scales_tensor` of its graph."""
    details = schema.BlockwiseQuantizationT()
    details.scales, details.zeroPoints, details.blockSize = scales_tensor, -1, INT4_BLOCK
    quantization = schema.QuantizationParametersT()
    quantization.detailsType, quantization.details = schema.QuantizationDetails.BlockwiseQuantization, details
    return quantization


def _name(value):
    return value.decode("utf-8") if isinstance(value, bytes) else value


def int4_blocks(weights):
    """Symmetric int4 weights in blocks of `INT4_BLOCK` inputs: `(packed, scales, zeroed)` for a float32 filter
    `(units, in)`: the weights `q` in -7..7 two a byte (the even input in the low nibble) `(units, in/2)` uint8, the
    float16 block scales `(units, in/B)` with `w ~ q * scale` (`scale = max|w| / 7`), and how many blocks were
    zeroed. A block whose scale is below the smallest normal float16 (all its weights about 0: the float16 scale
    would underflow to 0, and XNNPACK refuses a whole model with a zero scale, google-ai-edge/ai-edge-quantizer#678)
    gets that smallest scale and zero weights, within 1e-7 of its values."""
    units, width = weights.shape
    blocks = weights.reshape(units, width // INT4_BLOCK, INT4_BLOCK)  # (units, in/B, B)
    scales = (np.abs(blocks).max(-1) / 7.0).astype(np.float16)  # (units, in/B)
    small = scales < np.finfo(np.float16).tiny
    scales[small] = np.finfo(np.float16).tiny
    q = np.clip(np.rint(blocks / scales[..., None].astype(np.float32)), -7, 7).astype(np.int8)
    q[small] = 0
    return pack_int4(q.reshape(units, width)), scales, int(small.sum())


def pack_int4(q):
    """int4 values `q` `(units, in)` in -8..7, two a byte (the even input in the low nibble): `(units, in/2)` uint8."""
    q = q.astype(np.uint8) & 15
    return q[:, 0::2] | (q[:, 1::2] << 4)


def gguf_int4_blocks(weights):
    """A float32 filter `(units, in)` whose every block of `INT4_BLOCK` inputs holds GGUF Q4_1 values, `d * q + m`
    (q in 0..15, `d` and `m` float16, as `tfformer.convert.gguf` dequantizes them), as int4 blocks kept exactly:
    `(q - 8, d, m + 8 d)`, int8 `(units, in)` in -8..7, float16 scales and float32 offsets `(units, in/B)`, with
    `w = (q - 8) d + offset`. A block's `d` and `m` are its spread / 15 and its minimum (Q4_1's own choice). None
    when a block does not hold such values (a matrix trained or converted otherwise) or a `d` is too small for
    XNNPACK (below float16's smallest normal; a constant block gets that scale and zero weights)."""
    units, width = weights.shape
    if width % INT4_BLOCK:
        return None
    blocks = weights.reshape(units, width // INT4_BLOCK, INT4_BLOCK)  # (units, in/B, B)
    low = blocks.min(-1)  # (units, in/B)
    scales = ((blocks.max(-1) - low) / 15).astype(np.float16)
    low = low.astype(np.float16)
    d, m = scales.astype(np.float32)[..., None], low.astype(np.float32)[..., None]
    constant = scales == 0
    if np.any(~constant & (scales < np.finfo(np.float16).tiny)):
        return None
    q = np.clip(np.rint((blocks - m) / np.where(constant[..., None], 1, d)), 0, 15).astype(np.float32)
    if not np.array_equal(q * d + m, blocks):  # the dequantizer's two roundings
        return None
    q[constant] = 8
    scales[constant] = np.finfo(np.float16).tiny
    offsets = (m + 8 * d)[..., 0]  # (units, in/B): exact, two float16 values
    return (q - 8).astype(np.int8).reshape(units, width), scales, offsets.astype(np.float32)


def sentencepiece_model(model_proto):
    """A `SubwordTokenizer`'s SentencePiece model (bytes) as a runtime that knows only SentencePiece must read it:
    the tokenizer maps tabs and line breaks to symbols around SentencePiece (`tfformer.data.tokenizers.ESCAPES`),
    and here its (identity) normalizer does the same and a denormalizer maps them back, so the model alone gives
    the tokenizer's ids and texts. The character maps are compiled by SentencePiece's trainer from rule files."""
    import io

    import sentencepiece
    from sentencepiece import sentencepiece_model_pb2

    from tfformer.data.tokenizers import ESCAPES

    model = sentencepiece_model_pb2.ModelProto.FromString(bytes(model_proto))
    if model.normalizer_spec.name != "identity":
        raise ValueError(f"A SubwordTokenizer's model has the identity normalizer; this one has "
                         f"{model.normalizer_spec.name!r}")
    # One throwaway training compiles both maps: the escapes as its normalizer, their reverse as its denormalizer.
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for kind, rules in (("normalization", ESCAPES), ("denormalization", [(b, a) for a, b in ESCAPES])):
            paths[kind] = os.path.join(tmp, f"{kind}.tsv")
            with open(paths[kind], "w") as f:  # one rule a line: source and target code points in hex
                f.writelines(f"{ord(a):X}\t{ord(b):X}\n" for a, b in rules)
        out = io.BytesIO()
        sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(["a b c"] * 8), model_writer=out, vocab_size=8,
                                                 hard_vocab_limit=False, minloglevel=2,
                                                 normalization_rule_tsv=paths["normalization"],
                                                 denormalization_rule_tsv=paths["denormalization"])
    compiled = sentencepiece_model_pb2.ModelProto.FromString(out.getvalue())
    model.normalizer_spec.name = "tfformer_escapes"
    model.normalizer_spec.precompiled_charsmap = compiled.normalizer_spec.precompiled_charsmap
    model.denormalizer_spec.name = "tfformer_unescapes"
    model.denormalizer_spec.precompiled_charsmap = compiled.denormalizer_spec.precompiled_charsmap
    model.denormalizer_spec.add_dummy_prefix = False
    model.denormalizer_spec.remove_extra_whitespaces = False
    model.denormalizer_spec.escape_whitespaces = False
    return model.SerializeToString()


def int8_channels(weights):
    """Symmetric int8 weights per output channel: `(q, scales)` for a float32 filter `(units, in)`, `q` `(units, in)`
    int8 in -127..127 and float32 `scales` `(units,)` with `w ~ q * scale` (`scale = max|w| / 127`, 1 for a row
    of zeros)."""
    scales = np.maximum(weights.max(-1), -weights.min(-1)) / 127.0  # max |w| a row, without a copy of |w|
    scales[scales == 0] = 1.0
    q, chunk = np.empty(weights.shape, np.int8), 4096  # `chunk` rows at a time: no float copy of a whole table
    for start in range(0, len(weights), chunk):
        rows = weights[start:start + chunk] / scales[start:start + chunk, None]
        q[start:start + chunk] = np.clip(np.rint(rows, out=rows), -127, 127, out=rows)
    return q, scales.astype(np.float32)


def tokenizer_json(tokenizer, path):
    """Write a `BytePairTokenizer` as a Hugging Face `tokenizer.json` (the `tokenizers` library) at `path`.

    The same vocabulary, merges, pre-tokenizer (GPT-2's ByteLevel regex, after single digits for "smollm") and
    special tokens, so the ids equal `tokenizer.tokenize`'s. Returns `path`.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    if not hasattr(tokenizer, "merges") or not hasattr(tokenizer, "pre_tokenizer"):
        raise ValueError(f"`tokenizer` must be a tfformer BytePairTokenizer. Received: {type(tokenizer).__name__}")
    vocabulary = {}
    for i, token in enumerate(tokenizer.vocabulary):
        if token and token not in vocabulary:  # the first id of a token, as BytePairTokenizer reads it
            vocabulary[token] = i
    merges = [tuple(merge.split(" ")) for merge in tokenizer.merges]
    hf = Tokenizer(models.BPE(vocab=vocabulary, merges=merges, fuse_unk=False, byte_fallback=False))
    steps = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if tokenizer.pre_tokenizer == "smollm":
        steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
    hf.pre_tokenizer = pre_tokenizers.Sequence(steps)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in tokenizer.special_tokens])
    return write_atomic(path, hf.to_str())


# LiteRT-LM hands a chat template each message's content as a list of parts (`{"type": "text", "text": ...}`);
# the presets' templates (Hugging Face's) add it to strings. The preamble joins the text parts into a string first.
TEMPLATE_PREAMBLE = (
    "{%- set ns = namespace(messages=[]) -%}"
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{%- set text = message['content'] -%}"
    "{%- else -%}{%- set text = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text')"
    " | join('') -%}{%- endif -%}"
    "{%- set ns.messages = ns.messages + [{'role': message['role'], 'content': text}] -%}"
    "{%- endfor -%}"
    "{%- set messages = ns.messages -%}"
)


def llm_metadata(task, context_length):
    """The bundle's `LlmMetadata` proto, serialized: stop tokens (`end_ids` and the padding id 0), chat template,
    context length, greedy sampling."""
    from litert_lm_builder.runtime.proto import llm_metadata_pb2, sampler_params_pb2

    metadata = llm_metadata_pb2.LlmMetadata()
    # The preset's end ids, and the padding id, which a tfformer model never continues from (as tfformer.edge).
    for token in dict.fromkeys([int(i) for i in task.end_ids] + [PAD_ID]):
        metadata.stop_tokens.add().token_ids.ids.append(token)
    metadata.max_num_tokens = context_length
    # Greedy: the runtime takes top-p with k = 1 (its GREEDY and TOP_K types are not implemented on CPU).
    sampler = metadata.sampler_params
    sampler.type = sampler_params_pb2.SamplerParameters.TOP_P
    sampler.k, sampler.p, sampler.temperature, sampler.seed = 1, 0.0, 1.0, 0
    template = getattr(task.preprocessor, "chat_template", None)
    if template:
        metadata.jinja_prompt_template = TEMPLATE_PREAMBLE + template
    return metadata.SerializeToString()
