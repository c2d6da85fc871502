"""Label-smoothed sparse cross-entropy that ignores padding (label id 0)."""

import keras
import tensorflow as tf
from keras import ops


@keras.saving.register_keras_serializable(package="tfformer")
class MaskedSparseCrossEntropy(keras.losses.Loss):
    """Sparse cross-entropy over logits with label smoothing; padding labels (id 0) contribute nothing.

    The smoothed target puts `1 - label_smoothing` on the true class and
    `label_smoothing / V` on every class (Szegedy et al.; the paper uses 0.1).
    Returns per-token losses `(B, T)`, zero at padding; with Keras' default
    `sum_over_batch_size` reduction the batch loss is their sum divided by
    `B * T`. That divisor is the same on every replica of a synchronous strategy
    (batches are padded before they are split), so the update of N replicas
    equals the update of one replica on the global batch.

    Args:
        label_smoothing: float in [0, 1). Defaults to `0.1`.
        padding_id: int. Label id that is ignored. Defaults to `0`.
    """

    def __init__(self, label_smoothing=0.1, padding_id=0, name="masked_sparse_cross_entropy", reduction="sum_over_batch_size", dtype=None):
        if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)) or not 0 <= label_smoothing < 1:
            raise ValueError(f"`label_smoothing` must be a float in [0, 1). Received: label_smoothing={label_smoothing!r}")
        super().__init__(name=name, reduction=reduction, dtype=dtype)
        self.label_smoothing = label_smoothing
        self.padding_id = padding_id

    def call(self, y_true, y_pred):
        logits = ops.cast(y_pred, "float32")  # (B, T, V)
        labels = ops.cast(y_true, "int32")  # (B, T)
        # Fused softmax + cross-entropy kernels: one pass over the logits, the
        # gradient (softmax - target) comes out of the same op. Gathering the
        # true log-probability instead costs a scatter of B*T*V on the way back.
        if self.label_smoothing == 0:
            loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)  # (B, T)
        else:
            vocabulary_size = ops.shape(logits)[-1]
            off = self.label_smoothing / ops.cast(vocabulary_size, "float32")
            target = tf.one_hot(labels, vocabulary_size, on_value=1.0 - self.label_smoothing + off, off_value=off)  # (B, T, V)
            loss = tf.nn.softmax_cross_entropy_with_logits(labels=target, logits=logits)  # (B, T)
        return ops.where(ops.not_equal(labels, self.padding_id), loss, 0.0)

    def get_config(self):
        return {"label_smoothing": self.label_smoothing, "padding_id": self.padding_id, "name": self.name,
                "reduction": self.reduction}
