"""LiteRT-LM bundles: a tfformer causal LM as one `.litertlm` file that Google's LiteRT-LM runtime runs.

LiteRT-LM (`pip install litert-lm-api`: `litert_lm.Engine`, the C++ runtime its Android, iOS and desktop APIs
share) loads a bundle of a TFLite model, a tokenizer and an `LlmMetadata` proto, and owns the whole loop: prompt
template, tokenizer, prefill, decode, sampling, stop tokens. The TFLite model follows the runtime's contract:

- signatures `prefill_<T>` (one per prefill length `T`; the runtime covers a prompt with the longest ones, then the
  shortest that holds the rest) and `decode` (`T` = 1);
- inputs `tokens` `(1, T)` int32, `input_pos` `(T,)` int32 (the positions `input_pos[0]...`; the runtime pads a
  short chunk with token 0 at position 0), and one cache tensor per layer and half, `kv_cache_k_<i>` and
  `kv_cache_v_<i>` `(1, K, S, H)` float32 (`K` key/value heads, `S` = `context_length` slots): the split caches
  of `tfformer.layers.layer_utils.split_cache` with a leading axis of one, where the runtime reads the context
  length (axis 2; a 3-D `(K, S, H)` cache made it take `H` as the context);
- outputs: the same cache tensors (the runtime binds each to one buffer, in and out), and from `decode` `logits`
  `(1, 1, V)`.

A step writes its `T` keys and values at `input_pos[0]` and attends over the slots up to each query's position
(the model's own causal mask from `input_pos[0]`, so no `mask` input). `decode` writes its slot with
DYNAMIC_UPDATE_SLICE, in place in the bound buffer; a prefill writes with a select over the cache, which drops any
padding past the last slot. (LiteRT-LM 0.18 never runs a prefill longer than the slots left, but a
DYNAMIC_UPDATE_SLICE would move such a window back over cached positions.)

The tokenizer goes in as the runtime reads it: a `BytePairTokenizer` (SmolLM2) as a Hugging Face `tokenizer.json`
(`tokenizer_json`), a `SubwordTokenizer` as its SentencePiece model. The metadata holds the stop tokens (the
preset's `end_ids`), the chat template (as `jinja_prompt_template`), the context length and greedy sampling. No
start token: SmolLM2's chat template begins with `<|im_start|>`, which the runtime would then refuse in a prompt.
"""

import os
import tempfile

import keras
import tensorflow as tf

from tfformer.checks import check_int
from tfformer.files import atomic_path, write_atomic
from tfformer.layers.decode_forms import DecodeForms
from tfformer.models.causal_lm import CausalLM

QUANTIZE = ("none", "int8", "int4")
# What a chat app ships (the acceptance measures at least this), cut to the model's max_sequence_length.
DEFAULT_CONTEXT_LENGTH = 2048
# A short chat turn takes prefill_32; a long prompt goes through prefill_128 in chunks.
DEFAULT_PREFILL_LENGTHS = (32, 128)


def litertlm(task, path, quantize="none", context_length=None, prefill_lengths=DEFAULT_PREFILL_LENGTHS):
    """Write `task` (a tfformer `CausalLM` with its preprocessor) as a `.litertlm` bundle for LiteRT-LM.

    Args:
        task: a `tfformer.models.CausalLM` with a `preprocessor` (`BytePairTokenizer` or `SubwordTokenizer`), e.g.
            `tfformer.models.from_preset("smollm2-135m-instruct")` or a trained `gpt-mini` run.
        path: the output file, e.g. `"model.litertlm"`.
        quantize: `"none"` (float32 weights), `"int8"` or `"int4"` (weights quantized by `litert_quantizer`).
        context_length: int. Cache slots (prompt + reply, all turns of a conversation): the default is
            `DEFAULT_CONTEXT_LENGTH` (2048), or the model's `max_sequence_length` when that is shorter. Every decode
            step attends over all of them.
        prefill_lengths: ints. The `prefill_<T>` signatures, each at most `context_length`.

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
    context_length, prefill_lengths = _check_arguments(task, quantize, context_length, prefill_lengths)
    if quantize != "none":
        raise ValueError(f"quantize={quantize!r} is not implemented yet; use quantize='none'.")
    from litert_lm_builder import litertlm_builder

    with tempfile.TemporaryDirectory() as tmp:
        model_path = _write_tflite(task, os.path.join(tmp, "model.tflite"), context_length, prefill_lengths)
        builder = litertlm_builder.LitertLmFileBuilder()
        builder.add_tflite_model(model_path, litertlm_builder.TfLiteModelType.PREFILL_DECODE)
        tokenizer = task.preprocessor
        if hasattr(tokenizer, "model_proto"):  # a SubwordTokenizer: its SentencePiece model as it is
            builder.add_sentencepiece_tokenizer(write_atomic(os.path.join(tmp, "tokenizer.model"),
                                                             tokenizer.model_proto))
        else:
            builder.add_hf_tokenizer(tokenizer_json(tokenizer, os.path.join(tmp, "tokenizer.json")))
        builder.add_llm_metadata(write_atomic(os.path.join(tmp, "llm_metadata.pb"),
                                              llm_metadata(task, context_length)))
        with atomic_path(path) as out, open(out, "wb") as stream:
            builder.build(stream)
    return path


def _check_arguments(task, quantize, context_length, prefill_lengths):
    """`litertlm`'s argument checks; returns the context length and the sorted prefill lengths."""
    config = getattr(task, "config", None)
    if not isinstance(task, CausalLM) or config is None or config.architecture != "causal_lm":
        raise ValueError(f"`task` must be a tfformer CausalLM (a decoder-only language model). Received: "
                         f"task={type(task).__name__}")
    if getattr(task, "preprocessor", None) is None:
        raise ValueError("`task` has no preprocessor (tokenizer), which the bundle must carry: load it with "
                         "`tfformer.models.from_preset(...)` or set `task.preprocessor`.")
    if quantize not in QUANTIZE:
        raise ValueError(f"`quantize` must be one of {QUANTIZE}. Received: quantize={quantize!r}")
    limit = config.max_sequence_length
    check_int("context_length", context_length, maximum=limit, allow_none=True,
              expected=f"an integer in [1, max_sequence_length={limit}]")
    context_length = context_length or min(DEFAULT_CONTEXT_LENGTH, limit)
    if isinstance(prefill_lengths, (str, bytes)) or not isinstance(prefill_lengths, (list, tuple)):
        raise ValueError(f"`prefill_lengths` must be a list of ints. Received: prefill_lengths={prefill_lengths!r}")
    for length in prefill_lengths:
        check_int("prefill_lengths", length, expected="a list of positive ints")
    # A prefill longer than the context would never run whole: cut to it.
    lengths = sorted({min(length, context_length) for length in prefill_lengths})
    if not lengths:
        raise ValueError("`prefill_lengths` must hold at least one length. Received: prefill_lengths=[]")
    return context_length, lengths


def _step_function(task, length, context_length):
    """The `prefill_<length>` (or, for 1, `decode`) signature's function and its input specs."""
    config = task.config
    layers, heads, head_dim = config.num_decoder_layers, config.key_value_heads, config.head_dim
    specs = {"tokens": tf.TensorSpec([1, length], tf.int32, name="tokens"),
             "input_pos": tf.TensorSpec([length], tf.int32, name="input_pos")}
    names = [(f"kv_cache_k_{i}", f"kv_cache_v_{i}") for i in range(layers)]
    for pair in names:
        for name in pair:
            specs[name] = tf.TensorSpec([1, heads, context_length, head_dim], tf.float32, name=name)  # (1, K, S, H)
    decode = length == 1
    # Only decode writes in place: a prefill's padding may run past the last slot (module docstring).
    forms = DecodeForms(in_place_cache_writes=decode)

    def step(inputs):
        caches = tuple((inputs[k][0], inputs[v][0]) for k, v in names)
        logits, caches = task.decode_step(inputs["tokens"], caches, inputs["input_pos"][0], last_only=True,
                                          plan=forms)
        outputs = {name: half[None] for pair, cache in zip(names, caches) for name, half in zip(pair, cache)}
        if decode:
            outputs["logits"] = logits  # (1, 1, V)
        return outputs

    return step, [specs]


def _write_tflite(task, path, context_length, prefill_lengths):
    """The prefill and decode signatures as one float32 TFLite file at `path` (builtin ops only)."""
    with tempfile.TemporaryDirectory() as tmp:
        archive = keras.export.ExportArchive()
        names = [f"prefill_{length}" for length in prefill_lengths] + ["decode"]
        for name, length in zip(names, list(prefill_lengths) + [1]):
            fn, specs = _step_function(task, length, context_length)
            archive.add_endpoint(name, fn, input_signature=specs)
        archive.write_out(tmp, verbose=False)
        converter = tf.lite.TFLiteConverter.from_saved_model(tmp, signature_keys=names)
        converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS]
        return write_atomic(path, converter.convert())


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


def llm_metadata(task, context_length):
    """The bundle's `LlmMetadata` proto, serialized: stop tokens, chat template, context length, greedy sampling."""
    from litert_lm_builder.runtime.proto import llm_metadata_pb2, sampler_params_pb2

    metadata = llm_metadata_pb2.LlmMetadata()
    for token in task.end_ids:
        metadata.stop_tokens.add().token_ids.ids.append(int(token))
    metadata.max_num_tokens = context_length
    # Greedy: the runtime takes top-p with k = 1 (its GREEDY and TOP_K types are not implemented on CPU).
    sampler = metadata.sampler_params
    sampler.type = sampler_params_pb2.SamplerParameters.TOP_P
    sampler.k, sampler.p, sampler.temperature, sampler.seed = 1, 0.0, 1.0, 0
    template = getattr(task.preprocessor, "chat_template", None)
    if template:
        metadata.jinja_prompt_template = template
    return metadata.SerializeToString()
