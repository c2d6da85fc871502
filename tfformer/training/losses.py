"""Label-smoothed sparse cross-entropy that ignores padding (label id 0)."""

import keras
import tensorflow as tf
from keras import ops

from tfformer.checks import check_number
from tfformer.training.metrics import TokenStatistics


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

    The loss and its gradient run as XLA computations (also inside a graph that
    is not XLA-compiled), compiled once per distinct `(B*T, V)` (a fraction of a
    second each on a CPU). Bucket sequence lengths (`data.pipelines` does) rather
    than feeding every length. Labels outside `[0, V)` other than `padding_id`
    raise; under `jit_compile=True`, where XLA drops that check, their tokens'
    losses are NaN (so `fit` reports a NaN loss) and their gradients zero.

    With `fuse_projection=True` (the default), a tfformer model whose logits
    come from its tied token embedding (`CausalLM`, `Seq2SeqTransformer`) trains
    through `call_on_hidden_states` instead: the vocabulary projection and this
    loss run as one operation, and `fit` gives the same losses and gradients.
    `False` keeps the two apart (the model's logits, then `call`).

    Args:
        label_smoothing: float in [0, 1). Defaults to `0.1`.
        padding_id: int. Label id that is ignored. Defaults to `0`.
        fuse_projection: bool. Let tfformer models fuse their output projection
            with this loss in training. Defaults to `True`.
    """

    def __init__(self, label_smoothing=0.1, padding_id=0, name="masked_sparse_cross_entropy",
                 reduction="sum_over_batch_size", dtype=None, fuse_projection=True):
        check_number("label_smoothing", label_smoothing, at_least=0, below=1, expected="a float in [0, 1)")
        if not isinstance(fuse_projection, bool):
            raise ValueError(f"`fuse_projection` must be True or False. Received: fuse_projection={fuse_projection!r}")
        super().__init__(name=name, reduction=reduction, dtype=dtype)
        self.label_smoothing = label_smoothing
        self.padding_id = padding_id
        self.fuse_projection = fuse_projection

    def call(self, y_true, y_pred):
        logits = ops.cast(y_pred, "float32")  # (B, T, V)
        labels = ops.cast(y_true, "int32")  # (B, T)
        loss = _smoothed_cross_entropy(logits, labels, float(self.label_smoothing), self.padding_id)  # (B, T)
        return ops.where(ops.not_equal(labels, self.padding_id), loss, 0.0)

    def call_on_hidden_states(self, y_true, hidden_states, embeddings, return_logits=False, return_statistics=False):
        """`call(y_true, hidden_states @ embeddings^T)` with the projection and the loss as one operation.

        The forward pass computes the logits in `hidden_states`' dtype, and from them in one XLA pass the
        loss and its gradient `softmax - target` (in that dtype; float32 arithmetic inside). The backward pass is
        the two matmuls of that gradient, with the upstream per-token factor applied to the `(B*T, D)` side.
        Neither float32 logits nor their gradient exist under mixed precision, and the logits are not kept for
        the backward pass.

        Args:
            y_true: `(B, T)` int labels.
            hidden_states: `(B, T, D)` inputs of the projection, float32 or bfloat16 (float16's loss scaling needs
                the gradient in float32 before the scale is known: models do not fuse under float16).
            embeddings: `(V, D)` float32 embedding table (a variable or its value); logits are
                `hidden_states @ embeddings^T`, as `layers.TokenEmbedding(..., reverse=True)` computes them.
            return_logits: bool. Also return the float32 logits `(B, T, V)` (for metrics).
            return_statistics: bool. Also return a `TokenStatistics` (the unsmoothed cross-entropy and whether
                the argmax is the label, per token; for `MaskedAccuracy` and `Perplexity`), computed in the
                same pass over the logits.

        Returns:
            `(B, T)` per-token losses, zero at padding, as `call` returns them; with `return_logits` or
            `return_statistics`, a tuple `(losses, logits)`, `(losses, statistics)` or
            `(losses, logits, statistics)`.
        """
        labels = ops.cast(y_true, "int32")  # (B, T)
        losses, logits, statistics = _projected_cross_entropy(hidden_states, embeddings, labels,
                                                              float(self.label_smoothing), self.padding_id,
                                                              return_logits, return_statistics)
        losses = ops.where(ops.not_equal(labels, self.padding_id), losses, 0.0)  # (B, T)
        extra = ((logits,) if return_logits else ()) + ((statistics,) if return_statistics else ())
        return (losses,) + extra if extra else losses

    @property
    def fuses_projection(self):
        """Whether a model may train through `call_on_hidden_states`: `fuse_projection`, a float32 loss, and no
        subclass that changed `call` without changing `call_on_hidden_states` to match."""
        cls, base = type(self), MaskedSparseCrossEntropy
        consistent = cls.call is base.call or cls.call_on_hidden_states is not base.call_on_hidden_states
        return self.fuse_projection and self.dtype == "float32" and consistent

    def get_config(self):
        return {"label_smoothing": self.label_smoothing, "padding_id": self.padding_id, "name": self.name,
                "reduction": self.reduction, "fuse_projection": self.fuse_projection}


def _smoothed_cross_entropy(logits, labels, smoothing, padding_id):
    """Per-token `-sum_v q_v log softmax(logits)_v` with `q = (1 - smoothing) onehot + smoothing / V`.

    `logsumexp(logits) - (1 - smoothing) logits[label] - smoothing mean(logits)`, with its own gradient
    `(softmax - q) * upstream`, each as one XLA computation (`_forward`, `_backward`): XLA fuses the
    exponentials, reductions and the one-hot into one pass over the `(B*T, V)` logits each way and keeps only
    the `(B*T,)` log-sum-exp for the backward pass, not a `(B*T, V)` log-softmax: less time than TF's
    separate log-softmax, exp, scatter and multiply (docs/performance.md), and far less than autodiff through
    a gather.
    XLA compiles once per distinct `(B*T, V)`: bucket sequence lengths (as `data.pipelines` does).
    """
    vocabulary_size = tf.shape(logits)[-1]
    flat_logits = tf.reshape(logits, [-1, vocabulary_size])  # (B*T, V)
    flat_labels = tf.reshape(labels, [-1])  # (B*T,)
    checks = _label_checks(flat_labels, vocabulary_size, padding_id)
    smoothing = tf.constant(smoothing, tf.float32)

    @tf.custom_gradient
    def forward(flat_logits):
        with tf.control_dependencies(checks):
            loss, log_sum_exp = _forward(flat_logits, flat_labels, smoothing)  # (B*T,), (B*T,)

        def grad(upstream):  # upstream (B*T,)
            return _backward(flat_logits, flat_labels, smoothing, log_sum_exp, upstream)

        return loss, grad

    return tf.reshape(forward(flat_logits), tf.shape(labels))


def _label_checks(flat_labels, vocabulary_size, padding_id):
    """XLA would clamp an out-of-range label silently; TF's gather used to raise. Check it here (padding may be
    any id). Inside an XLA-compiled step these checks are dropped: `_in_range` makes such tokens' losses NaN."""
    checked = tf.where(tf.equal(flat_labels, padding_id), 0, flat_labels)  # (B*T,)
    return [
        tf.debugging.assert_non_negative(checked, message="`y_true` (token ids) must be >= 0"),
        tf.debugging.assert_less(checked, vocabulary_size, message="`y_true` (token ids) must be < the "
                                 "number of logits (the vocabulary size, the last axis of `y_pred`)"),
    ]


def _projected_cross_entropy(hidden_states, embeddings, labels, smoothing, padding_id, return_logits,
                             return_statistics):
    """Per-token smoothed cross-entropy `(B, T)` of the logits `hidden_states @ embeddings^T`, the float32 logits
    or None, and a `TokenStatistics` or None: the projection and the loss as one custom-gradient operation (see
    `call_on_hidden_states`)."""
    embeddings = tf.convert_to_tensor(embeddings)  # a variable read the tape sees
    hidden_dim = tf.shape(hidden_states)[-1]
    flat_hidden = tf.reshape(hidden_states, [-1, hidden_dim])  # (B*T, D)
    flat_labels = tf.reshape(labels, [-1])  # (B*T,)
    checks = _label_checks(flat_labels, tf.shape(embeddings)[0], padding_id)
    smoothing = tf.constant(smoothing, tf.float32)

    @tf.custom_gradient
    def forward(flat_hidden, embeddings):
        kernel = tf.cast(embeddings, flat_hidden.dtype)  # (V, D)
        logits = tf.matmul(flat_hidden, kernel, transpose_b=True)  # (B*T, V)
        with tf.control_dependencies(checks):
            # (B*T,), (B*T, V), and with statistics (B*T,) cross-entropy and correct
            loss, grad_logits, *statistics = _forward_with_gradient(logits, flat_labels, smoothing, return_statistics)
        outputs = (loss,) + ((tf.cast(logits, tf.float32),) if return_logits else ()) + tuple(statistics)

        def grad(upstream, *unused_upstream):  # upstream (B*T,); the logits and statistics only feed metrics
            # The per-token factor multiplies in float32 and each product is rounded once, as the unfused
            # gradient `(softmax - target) * upstream` is (not one rounded factor for every element).
            scale = upstream[:, None]  # (B*T, 1) float32
            dtype = flat_hidden.dtype
            d_hidden = tf.cast(tf.cast(tf.matmul(grad_logits, kernel), tf.float32) * scale, dtype)  # (B*T, D)
            scaled_hidden = tf.cast(tf.cast(flat_hidden, tf.float32) * scale, dtype)  # (B*T, D)
            d_kernel = tf.matmul(grad_logits, scaled_hidden, transpose_a=True)  # (V, D)
            return d_hidden, tf.cast(d_kernel, embeddings.dtype)

        return outputs, grad

    outputs = list(forward(flat_hidden, embeddings))
    loss = tf.reshape(outputs.pop(0), tf.shape(labels))  # (B, T)
    logits = statistics = None
    if return_logits:
        shape = tf.concat([tf.shape(labels), tf.shape(embeddings)[:1]], 0)  # not -1: B*T may be 0
        logits = tf.reshape(tf.stop_gradient(outputs.pop(0)), shape)  # (B, T, V)
    if return_statistics:
        cross_entropy, correct = (tf.reshape(tf.stop_gradient(x), tf.shape(labels)) for x in outputs)  # (B, T) each
        statistics = TokenStatistics(cross_entropy, correct)
    return loss, logits, statistics


def _in_range(flat_labels, flat_logits):
    """`(B*T,)` whether each label indexes a logit (XLA's gather would clamp the others)."""
    return (flat_labels >= 0) & (flat_labels < tf.shape(flat_logits)[-1])


def _smoothed_gradient(probs, flat_labels, smoothing):
    """`(B*T, V)` `softmax - q` with the smoothed targets `q = (1 - smoothing) onehot + smoothing / V`, zero in the
    rows of out-of-range labels; the one-hot is a comparison that fuses into the surrounding XLA pass."""
    vocabulary_size = tf.cast(tf.shape(probs)[-1], tf.float32)
    one_hot = tf.equal(tf.range(tf.shape(probs)[-1])[None, :], flat_labels[:, None])  # (B*T, V)
    target = tf.where(one_hot, 1.0 - smoothing, 0.0) + smoothing / vocabulary_size  # (B*T, V)
    return tf.where(_in_range(flat_labels, probs)[:, None], probs - target, 0.0)


def _smoothed_loss(flat_logits, flat_labels, smoothing, log_sum_exp, picked=None):
    """Per-token `-sum_v q_v log softmax_v`: `logsumexp - (1 - smoothing) logits[label] - smoothing mean(logits)`;
    NaN for an out-of-range label."""
    if picked is None:
        picked = tf.gather(flat_logits, flat_labels, batch_dims=1)  # (B*T,)
    mean = tf.reduce_mean(flat_logits, axis=-1)  # (B*T,)
    loss = log_sum_exp - (1.0 - smoothing) * picked - smoothing * mean  # (B*T,)
    return tf.where(_in_range(flat_labels, flat_logits), loss, float("nan"))


@tf.function(jit_compile=True, autograph=False)
def _forward(flat_logits, flat_labels, smoothing):
    peak = tf.stop_gradient(tf.reduce_max(flat_logits, axis=-1, keepdims=True))  # (B*T, 1)
    log_sum_exp = peak[:, 0] + tf.math.log(tf.reduce_sum(tf.exp(flat_logits - peak), axis=-1))  # (B*T,)
    return _smoothed_loss(flat_logits, flat_labels, smoothing, log_sum_exp), log_sum_exp


@tf.function(jit_compile=True, autograph=False)
def _forward_with_gradient(logits, flat_labels, smoothing, return_statistics):
    """`_forward`'s loss and `_backward`'s `softmax - target` (for an upstream of 1) in one pass, the gradient in
    the logits' dtype; with `return_statistics` (a Python bool) also the unsmoothed cross-entropy and whether the
    label is the argmax (the first maximum, as `argmax` picks it), float32 `(B*T,)` each."""
    flat_logits = tf.cast(logits, tf.float32)  # (B*T, V)
    peak = tf.reduce_max(flat_logits, axis=-1, keepdims=True)  # (B*T, 1)
    shifted = tf.exp(flat_logits - peak)  # (B*T, V)
    total = tf.reduce_sum(shifted, axis=-1, keepdims=True)  # (B*T, 1)
    log_sum_exp = peak[:, 0] + tf.math.log(total[:, 0])  # (B*T,)
    picked = tf.gather(flat_logits, flat_labels, batch_dims=1)  # (B*T,)
    loss = _smoothed_loss(flat_logits, flat_labels, smoothing, log_sum_exp, picked)  # (B*T,)
    outputs = (loss, tf.cast(_smoothed_gradient(shifted / total, flat_labels, smoothing), logits.dtype))
    if not return_statistics:
        return outputs
    # A maximum before the label's position makes that position argmax's pick, even when the label ties it.
    positions = tf.range(tf.shape(flat_logits)[-1])[None, :]  # (1, V)
    earlier_peak = tf.reduce_any((flat_logits == peak) & (positions < flat_labels[:, None]), axis=-1)  # (B*T,)
    correct = (picked == peak[:, 0]) & ~earlier_peak  # (B*T,)
    return outputs + (log_sum_exp - picked, tf.cast(correct, tf.float32))


@tf.function(jit_compile=True, autograph=False)
def _backward(flat_logits, flat_labels, smoothing, log_sum_exp, upstream):
    probs = tf.exp(flat_logits - log_sum_exp[:, None])  # (B*T, V)
    return _smoothed_gradient(probs, flat_labels, smoothing) * upstream[:, None]  # (B*T, V)
