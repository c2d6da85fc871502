"""Metrics: token accuracy and perplexity that ignore padding; corpus BLEU and word error rate of texts."""

import re

import keras
from keras import ops


class TokenStatistics:
    """What a metric needs of the logits, per token, as the fused output projection + loss computes it in
    training (`MaskedSparseCrossEntropy.call_on_hidden_states(..., return_statistics=True)`).

    A model that trains with the fused projection hands this to its compiled metrics in place of the
    `(B, T, V)` logits when every metric takes it (`accepts_token_statistics`), so that no float32 logits
    are made for them.

    Attributes:
        cross_entropy: `(B, T)` float32, `-log softmax(logits)[label]` (no label smoothing).
        correct: `(B, T)` float32, 1.0 where the label is the logits' argmax (the first, on ties), else 0.0.
    """

    def __init__(self, cross_entropy, correct):
        self.cross_entropy, self.correct = cross_entropy, correct


def _token_weights(labels, padding_id, sample_weight):
    """`(B, T)` float32 weights: 0 at padding, else the sample weight (per example `(B,)` or per token)."""
    weights = ops.cast(ops.not_equal(labels, padding_id), "float32")  # (B, T)
    if sample_weight is not None:
        sample_weight = ops.cast(sample_weight, "float32")
        while len(sample_weight.shape) < len(weights.shape):
            sample_weight = ops.expand_dims(sample_weight, -1)  # (B,) -> (B, 1)
        weights = weights * sample_weight
    return weights


@keras.saving.register_keras_serializable(package="tfformer")
class MaskedAccuracy(keras.metrics.Metric):
    """Fraction of non-padding tokens (label != `padding_id`) whose argmax logit is the label: correct tokens over
    real tokens, summed over every batch of any length (as `Perplexity` sums).

    `update_state(y_true, y_pred, sample_weight=None)` takes the logits `(B, T, V)` or a `TokenStatistics`;
    sample weights `(B,)` or `(B, T)` weight the tokens.
    """

    def __init__(self, padding_id=0, name="masked_accuracy", dtype=None):
        super().__init__(name=name, dtype=dtype)
        self.padding_id = padding_id
        # Not keras.metrics.Mean: it averages a (B, T) batch over T first, so a token of a length-T batch counted
        # 1/T and length-bucketed batches were weighted wrongly (2/2 + 0/8 correct read 0.5, not 0.2).
        self.total = self.add_variable(shape=(), initializer="zeros", name="total")
        self.count = self.add_variable(shape=(), initializer="zeros", name="count")

    @property
    def accepts_token_statistics(self):
        """True unless a subclass changed `update_state` (it may not know `TokenStatistics`)."""
        return type(self).update_state is MaskedAccuracy.update_state

    def update_state(self, y_true, y_pred, sample_weight=None):
        labels = ops.cast(y_true, "int32")  # (B, T)
        if isinstance(y_pred, TokenStatistics):
            correct = y_pred.correct  # (B, T)
        else:
            correct = ops.cast(ops.equal(ops.cast(ops.argmax(y_pred, axis=-1), "int32"), labels), "float32")
        weights = _token_weights(labels, self.padding_id, sample_weight)  # (B, T)
        self.total.assign_add(ops.sum(correct * weights))
        self.count.assign_add(ops.sum(weights))

    def result(self):
        return ops.divide_no_nan(self.total, self.count)

    def get_config(self):
        return {"padding_id": self.padding_id, "name": self.name, "dtype": self.dtype}


@keras.saving.register_keras_serializable(package="tfformer")
class Perplexity(keras.metrics.Metric):
    """exp(mean cross-entropy per non-padding token), without label smoothing.

    `update_state(y_true, y_pred, sample_weight=None)` takes the logits `(B, T, V)` or a `TokenStatistics`;
    sample weights `(B,)` or `(B, T)` weight the tokens.
    """

    def __init__(self, padding_id=0, name="perplexity", dtype=None):
        super().__init__(name=name, dtype=dtype)
        self.padding_id = padding_id
        self.total = self.add_variable(shape=(), initializer="zeros", name="total")
        self.count = self.add_variable(shape=(), initializer="zeros", name="count")

    @property
    def accepts_token_statistics(self):
        """True unless a subclass changed `update_state` (it may not know `TokenStatistics`)."""
        return type(self).update_state is Perplexity.update_state

    def update_state(self, y_true, y_pred, sample_weight=None):
        labels = ops.cast(y_true, "int32")  # (B, T)
        weights = _token_weights(labels, self.padding_id, sample_weight)  # (B, T)
        if isinstance(y_pred, TokenStatistics):
            nll = y_pred.cross_entropy  # (B, T)
        else:
            nll = ops.sparse_categorical_crossentropy(labels, ops.cast(y_pred, "float32"), from_logits=True)
        self.total.assign_add(ops.sum(nll * weights))
        self.count.assign_add(ops.sum(weights))

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


def normalize_transcript(text):
    """Lowercase, every character but a-z, 0-9, apostrophe and space made a space, whitespace collapsed: how the
    speech fixtures' word error rates compare texts."""
    return " ".join(re.sub(r"[^a-z0-9' ]+", " ", text.lower()).split())


def word_error_rate(references, hypotheses, normalize=normalize_transcript):
    """Corpus word error rate, as jiwer computes it: word edits (substitutions + deletions + insertions,
    Levenshtein) summed over the pairs, over the references' word count. `normalize` (a str -> str function, or
    None to compare the texts as given) is applied to every text first."""
    if len(references) != len(hypotheses):
        raise ValueError(f"`references` and `hypotheses` need the same length. Received: {len(references)} and "
                         f"{len(hypotheses)}")
    normalize = normalize or (lambda text: text)
    edits = words = 0
    for reference, hypothesis in zip(references, hypotheses):
        ref, hyp = normalize(reference).split(), normalize(hypothesis).split()
        row = list(range(len(hyp) + 1))  # distances from the empty reference prefix
        for i, word in enumerate(ref, 1):
            previous, row[0] = row[0], i
            for j, other in enumerate(hyp, 1):
                previous, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, previous + (word != other))
        edits += row[-1]
        words += len(ref)
    if not words:
        raise ValueError("`references` hold no words.")
    return edits / words
