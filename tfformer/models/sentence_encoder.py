import keras
import numpy as np
import tensorflow as tf
from keras import ops

from tfformer.checks import check_int
from tfformer.compat import Untracked
from tfformer.models import task


def cosine_similarity(a, b=None):
    """Cosine similarity matrix `(n, m)` of row vectors `a` `(n, D)` and `b` `(m, D)` (default `a`)."""
    a = np.asarray(a, "float32")
    b = a if b is None else np.asarray(b, "float32")
    a = a / np.maximum(np.linalg.norm(a, axis=-1, keepdims=True), 1e-12)
    b = b / np.maximum(np.linalg.norm(b, axis=-1, keepdims=True), 1e-12)
    return a @ b.T


@keras.saving.register_keras_serializable(package="tfformer")
class SentenceEncoder(task.Task, keras.Model):
    """Sentence embeddings: an encoder, mean pooling over real tokens, L2 norm.

    The sentence-transformers recipe (`Transformer -> Pooling(mean) ->
    Normalize`): `sequence_output` `(B, T, D)` is averaged over the positions
    where `padding_mask` is 1, then divided by its L2 norm (unless
    `normalize=False`), so cosine similarity is a dot product.

    The tokenizer is attached to the model, not part of its graph: `model(...)`
    takes token ids, `encode(texts)` tokenizes and batches for you. It is saved
    in the `.keras` file with the model when it is Keras-serializable (like
    `tfformer.data.BertTokenizer`).

    Args:
        encoder: a `TransformerEncoder` (its `segment_ids`, if any, are zeros).
        tokenizer: optional callable, list of str -> `{"token_ids",
            "padding_mask"}`. Needed by `encode` and `tokenize`.
        normalize: bool. L2-normalise the pooled vectors. Defaults to `True`.
        **kwargs: Base model arguments (`name`, `trainable`).

    Call arguments:
        inputs: `{"token_ids": int32 (B, T), "padding_mask": int32 (B, T)}`,
            `padding_mask` 1 on real tokens.

    Returns:
        `(B, D)` float32 sentence embeddings.

    Example:
    ```python
    model = tfformer.models.from_preset("all-minilm-l6-v2")
    vectors = model.encode(["A man is eating food.", "A man eats."])  # (2, 384)
    vectors[0] @ vectors[1]  # cosine similarity
    ```
    """

    def __init__(self, encoder, tokenizer=None, normalize=True, **kwargs):
        # === Functional model ===
        token_ids = keras.Input(shape=(None,), dtype="int32", name="token_ids")
        padding_mask = keras.Input(shape=(None,), dtype="int32", name="padding_mask")
        encoder_inputs = {"token_ids": token_ids}
        if "segment_ids" in encoder.input:
            encoder_inputs["segment_ids"] = ops.zeros_like(token_ids)
        sequence = encoder(encoder_inputs)["sequence_output"]  # (B, T, D)
        weights = ops.expand_dims(ops.cast(padding_mask, sequence.dtype), -1)  # (B, T, 1)
        # Mean over real tokens; the count is clamped as in sentence-transformers.
        pooled = ops.sum(sequence * weights, axis=1) / ops.maximum(ops.sum(weights, axis=1), 1e-9)  # (B, D)
        if normalize:
            # torch.nn.functional.normalize: x / max(||x||, 1e-12).
            pooled = pooled / ops.maximum(ops.norm(pooled, axis=-1, keepdims=True), 1e-12)
        super().__init__(inputs={"token_ids": token_ids, "padding_mask": padding_mask}, outputs=pooled, **kwargs)
        self.dtype_policy = encoder.dtype_policy  # its own ops compute as the encoder does

        # === Config ===
        self.encoder = encoder
        self.tokenizer = tokenizer
        self.normalize = normalize

    # The tokenizer is in the Keras config (`get_config`), so `save_to_preset` writes no file for it.
    saves_preprocessor_in_config = True

    @property
    def preprocessor(self):
        return self.tokenizer

    @preprocessor.setter
    def preprocessor(self, tokenizer):
        self.tokenizer = tokenizer

    @property
    def backbone(self):
        """The encoder's backbone (token ids to hidden states)."""
        return self.encoder.backbone

    @property
    def transformer_config(self):
        return self.encoder.config

    def tokenize(self, texts):
        """`{"token_ids": int32 (B, T), "padding_mask": int32 (B, T)}` numpy arrays, padded with 0."""
        if self.tokenizer is None:
            raise ValueError("This SentenceEncoder has no tokenizer; pass `tokenizer=` or call the model on token ids.")
        return {key: np.asarray(value) for key, value in self.tokenizer(texts).items()}

    def encode(self, texts, batch_size=32):
        """Embeddings of `texts` (list of str), `(n, D)` float32 numpy.

        Texts are run longest first in batches of `batch_size`, so each batch
        carries little padding; the rows come back in the input order. The
        batches go through one `tf.function` of the model (no XLA, which would
        compile a program per batch shape; not replicated under a `tf.distribute`
        strategy), traced at most three times whatever the batches' shapes (the
        first shape, then with the length left open, then the batch size too),
        much faster than eager calls. The graph's kernels can round differently from the first
        traced shape's, in the last bits of float32.
        """
        check_int("batch_size", batch_size)
        texts = list(texts)
        if not texts:
            return np.zeros((0, self.output.shape[-1]), "float32")
        tokens = self.tokenize(texts)
        lengths = tokens["padding_mask"].sum(axis=1)
        order = np.argsort(-lengths, kind="stable")
        vectors = np.zeros((len(texts), self.output.shape[-1]), "float32")
        for start in range(0, len(texts), batch_size):
            rows = order[start : start + batch_size]
            length = int(lengths[rows].max())
            batch = {key: value[rows, :length] for key, value in tokens.items()}  # (b, length)
            vectors[rows] = np.asarray(self._inference_function()(batch))  # (b, D)
        return vectors

    def _inference_function(self):
        """`self(batch, training=False)` as a `tf.function`, made once; kept in a plain object so that neither
        Keras nor a SavedModel export (which saves a layer's `tf.function` attributes) tracks it."""
        holder = getattr(self, "_inference", None)
        if holder is None:
            holder = self._inference = Untracked(function=tf.function(
                lambda batch: self(batch, training=False), reduce_retracing=True, jit_compile=False))
        return holder.function

    def get_config(self):
        return {
            "encoder": keras.saving.serialize_keras_object(self.encoder),
            "tokenizer": None if self.tokenizer is None else keras.saving.serialize_keras_object(self.tokenizer),
            "normalize": self.normalize,
            "name": self.name,
            "trainable": self.trainable,
        }

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["encoder"] = keras.saving.deserialize_keras_object(config["encoder"])
        if config.get("tokenizer") is not None:
            config["tokenizer"] = keras.saving.deserialize_keras_object(config["tokenizer"])
        return cls(**config)
