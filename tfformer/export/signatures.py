"""Names and specs of the exported signatures (shared with the server and the edge runtime).

Every exported function takes named inputs and returns a dict with fixed keys.
"""

import tensorflow as tf

SERVING_DEFAULT = "serving_default"  # raw strings in, strings (or embeddings) out
PREDICT_IDS = "predict_ids"  # token ids in, float32 logits out
GENERATE_IDS = "generate_ids"  # token ids in, generated ids out

TEXT = "text"
TRANSLATION = "translation"
CONTINUATION = "continuation"
EMBEDDING = "embedding"
LOGITS = "logits"
TOKEN_IDS = "token_ids"


def ids_spec(name, batch=None, length=None):
    return tf.TensorSpec([batch, length], tf.int32, name=name)


def text_spec(name=TEXT):
    return tf.TensorSpec([None], tf.string, name=name)
