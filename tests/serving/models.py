"""Tiny SavedModels the serving tests serve (built in temporary directories).

- `dense`: a Keras functional model (`model.export`), float input `x` (B, 3) ->
  `output_0` (B, 2) = [sum(x), sum(x)] (whole numbers in, whole numbers out).
- `multi`: Keras, two inputs `x` float (B, 3) and `ids` int32 (B, 4) -> two
  outputs `total` (B, 2) float and `idsum` (B, 1) int32.
- `text`: a `tf.Module` (`tf.saved_model.save`) with string input `text` (B,)
  -> `upper_bytes` (bytes, b64 in JSON), `words` (TF-Text WhitespaceTokenizer
  count, int64), `version` (int32, the version number); more signatures:
  `lengths`, `echo_float`, `scalar` (rank-0 output), `types` (double, int64,
  bool, uint8 inputs).
- `seq`: a `tf.Module` with an int32 input `ids` (B, T), T free -> `ids_out` (the input, as the model saw it)
  and `total` (B,) row sums (for batching with and without `pad_variable_length_inputs`).
- `slow`: busy-waits `seconds[0]` seconds (for timeouts and graceful shutdown).
- `classifier`: a TF1-style SavedModel (`tf.compat.v1.saved_model.Builder`) with a real
  `tensorflow/serving/classify` signature (serialized `tf.Example` with float feature `x` -> classes
  `yes`/`no` with scores `x`, `1 - x`) and a `regress` signature (-> `x`).
"""

import os

import keras
import numpy as np
import tensorflow as tf
import tensorflow_text as tf_text


def save_dense(path, scale=1.0):
    x = keras.Input((3,), name="x")
    y = keras.layers.Dense(2, kernel_initializer=keras.initializers.Constant(scale), bias_initializer="zeros")(x)
    keras.Model(x, y).export(os.fspath(path), verbose=False)


def save_multi(path):
    x = keras.Input((3,), name="x")
    ids = keras.Input((4,), name="ids", dtype="int32")
    total = keras.layers.Dense(2, kernel_initializer="ones", bias_initializer="zeros")(x)
    idsum = keras.layers.Lambda(lambda t: keras.ops.sum(t, axis=-1, keepdims=True))(ids)
    keras.Model({"x": x, "ids": ids}, {"total": total, "idsum": idsum}).export(os.fspath(path), verbose=False)


class TextModel(tf.Module):
    def __init__(self, version):
        super().__init__()
        self.version = tf.constant(version, tf.int32)
        self.tokenizer = tf_text.WhitespaceTokenizer()

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="text")])
    def serve(self, text):
        words = self.tokenizer.tokenize(text).row_lengths()
        return {"upper_bytes": tf.strings.upper(text), "words": words,
                "version": tf.fill(tf.shape(text), self.version)}

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="text")])
    def lengths(self, text):
        return {"length": tf.strings.length(text)}

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="x")])
    def echo_float(self, x):
        return {"y": x}

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="x")])
    def scalar(self, x):
        return {"total": tf.reduce_sum(x)}

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float64, name="f64"),
                                  tf.TensorSpec([None], tf.int64, name="i64"),
                                  tf.TensorSpec([None], tf.bool, name="b"),
                                  tf.TensorSpec([None], tf.uint8, name="u8")])
    def types(self, f64, i64, b, u8):
        return {"f64_out": f64 * 2, "i64_out": i64 + 1, "b_out": tf.logical_not(b), "u8_out": u8}


def save_text(path, version=1):
    module = TextModel(version)
    signatures = {"serving_default": module.serve, "lengths": module.lengths, "echo_float": module.echo_float,
                  "scalar": module.scalar, "types": module.types}
    tf.saved_model.save(module, os.fspath(path), signatures=signatures)


class SeqModel(tf.Module):
    @tf.function(input_signature=[tf.TensorSpec([None, None], tf.int32, name="ids")])
    def serve(self, ids):
        return {"ids_out": ids, "total": tf.reduce_sum(ids, axis=1)}


def save_seq(path):
    module = SeqModel()
    tf.saved_model.save(module, os.fspath(path), signatures={"serving_default": module.serve})


def spin(seconds):
    """Busy-waits `seconds[0]` seconds in the graph; returns the loop's iteration count (an int32 scalar)."""
    start = tf.timestamp()
    limit = tf.cast(seconds[0], tf.float64)
    return tf.while_loop(lambda i: tf.timestamp() - start < limit, lambda i: i + 1, [tf.constant(0)],
                         parallel_iterations=1)[0]


class SlowModel(tf.Module):
    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="seconds")])
    def serve(self, seconds):
        return {"iterations": tf.fill(tf.shape(seconds), spin(seconds))}


def save_slow(path):
    module = SlowModel()
    tf.saved_model.save(module, os.fspath(path), signatures={"serving_default": module.serve})


def save_classifier(path):
    with tf.Graph().as_default():
        serialized = tf.compat.v1.placeholder(tf.string, [None], name="tf_example")
        x = tf.io.parse_example(serialized, {"x": tf.io.FixedLenFeature([1], tf.float32)})["x"]
        scores = tf.concat([x, 1 - x], axis=1)
        classes = tf.tile(tf.constant([["yes", "no"]]), [tf.shape(x)[0], 1])
        with tf.compat.v1.Session() as session:
            builder = tf.compat.v1.saved_model.Builder(os.fspath(path))
            builder.add_meta_graph_and_variables(session, ["serve"], signature_def_map={
                "serving_default": tf.compat.v1.saved_model.classification_signature_def(serialized, classes, scores),
                "regress": tf.compat.v1.saved_model.regression_signature_def(serialized, x),
            })
            builder.save()


MODELS_CONFIG = """model_config_list {
  config { name: 'dense' base_path: '%(root)s/dense' model_platform: 'tensorflow' }
  config { name: 'multi' base_path: '%(root)s/multi' model_platform: 'tensorflow' }
  config { name: 'text' base_path: '%(root)s/text' model_platform: 'tensorflow'
           model_version_policy { specific { versions: 1 versions: 2 } }
           version_labels { key: 'stable' value: 1 } version_labels { key: 'canary' value: 2 } }
  config { name: 'slow' base_path: '%(root)s/slow' model_platform: 'tensorflow' }
  config { name: 'classifier' base_path: '%(root)s/classifier' model_platform: 'tensorflow' }
}
"""


def build_model_root(root):
    """Writes every test model under `root` and a `models.config` for them; returns the config path."""
    root = os.fspath(root)
    save_dense(os.path.join(root, "dense", "1"))
    save_multi(os.path.join(root, "multi", "1"))
    save_text(os.path.join(root, "text", "1"), version=1)
    save_text(os.path.join(root, "text", "2"), version=2)
    save_slow(os.path.join(root, "slow", "1"))
    save_classifier(os.path.join(root, "classifier", "1"))
    config = os.path.join(root, "models.config")
    with open(config, "w") as handle:
        handle.write(MODELS_CONFIG % {"root": root})
    return config


def dense_inputs(rows=1):
    return np.ones((rows, 3), np.float32)
