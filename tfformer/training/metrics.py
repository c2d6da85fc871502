"""Metrics that ignore padding: token accuracy and perplexity."""

import keras
from keras import ops


@keras.saving.register_keras_serializable(package="tfformer")
class MaskedAccuracy(keras.metrics.Mean):
    """Fraction of non-padding tokens (label != `padding_id`) whose argmax logit is the label."""

    def __init__(self, padding_id=0, name="masked_accuracy", dtype=None):
        super().__init__(name=name, dtype=dtype)
        self.padding_id = padding_id

    def update_state(self, y_true, y_pred, sample_weight=None):
        labels = ops.cast(y_true, "int32")
        mask = ops.cast(ops.not_equal(labels, self.padding_id), "float32")
        correct = ops.cast(ops.equal(ops.cast(ops.argmax(y_pred, axis=-1), "int32"), labels), "float32")
        return super().update_state(correct, sample_weight=mask)

    def get_config(self):
        return {"padding_id": self.padding_id, "name": self.name, "dtype": self.dtype}


@keras.saving.register_keras_serializable(package="tfformer")
class Perplexity(keras.metrics.Metric):
    """exp(mean cross-entropy per non-padding token), without label smoothing."""

    def __init__(self, padding_id=0, name="perplexity", dtype=None):
        super().__init__(name=name, dtype=dtype)
        self.padding_id = padding_id
        self.total = self.add_variable(shape=(), initializer="zeros", name="total")
        self.count = self.add_variable(shape=(), initializer="zeros", name="count")

    def update_state(self, y_true, y_pred, sample_weight=None):
        labels = ops.cast(y_true, "int32")
        mask = ops.cast(ops.not_equal(labels, self.padding_id), "float32")
        nll = ops.sparse_categorical_crossentropy(labels, ops.cast(y_pred, "float32"), from_logits=True)  # (B, T)
        self.total.assign_add(ops.sum(nll * mask))
        self.count.assign_add(ops.sum(mask))

    def result(self):
        return ops.exp(ops.divide_no_nan(self.total, self.count))

    def get_config(self):
        return {"padding_id": self.padding_id, "name": self.name, "dtype": self.dtype}


def corpus_bleu(hypotheses, references):
    """Corpus BLEU (sacreBLEU, default 13a tokenization) of detokenized strings."""
    import sacrebleu

    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references.")
    return sacrebleu.corpus_bleu(list(hypotheses), [list(references)]).score
