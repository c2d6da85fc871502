"""Text in, text out: tokenizer + decoding."""

import tensorflow as tf

from tfformer.generation.decode import generate_ids
from tfformer.generation.tokens import END_ID


def _check_texts(texts, name):
    if isinstance(texts, str):
        texts = [texts]
    texts = list(texts)
    if not texts:
        raise ValueError(f"`{name}` is empty.")
    for text in texts:
        if not isinstance(text, str):
            raise ValueError(f"`{name}` must hold str; received {type(text).__name__}.")
        if not text.strip():
            raise ValueError(f"`{name}` holds an empty or whitespace-only string; there is nothing to {name[:-1]}.")
    return texts


def _decode(tokenizer, ids):
    ids = tf.RaggedTensor.from_tensor(ids, padding=0)
    # Cut each row at its end token.
    keep = tf.cast(tf.math.cumsum(tf.cast(ids == END_ID, tf.int32), axis=1), tf.bool)
    ids = tf.ragged.boolean_mask(ids, ~keep)
    return [s.decode("utf-8") for s in tokenizer.detokenize(ids).numpy()]


def translate(model, tokenizer, texts, max_new_tokens=64, sampler=None, batch_size=64, beam_size=None, jit_compile=True):
    """Translate strings with a `Seq2SeqTransformer` and its `SubwordTokenizer`. Returns a list of str."""
    texts = _check_texts(texts, "texts")
    results = []
    for start in range(0, len(texts), batch_size):
        ids = tokenizer.tokenize(texts[start : start + batch_size]).to_tensor()
        results += _decode(tokenizer, generate_ids(model, ids, max_new_tokens, sampler, beam_size, jit_compile=jit_compile))
    return results


def generate(model, tokenizer, prompts, max_new_tokens=64, sampler=None, beam_size=None, jit_compile=True):
    """Continue each prompt with a `CausalLM`. Returns the continuations (without the prompt)."""
    prompts = _check_texts(prompts, "prompts")
    ids = tokenizer.tokenize(prompts).to_tensor()
    return _decode(tokenizer, generate_ids(model, ids, max_new_tokens, sampler, beam_size, jit_compile=jit_compile))
