"""Beam search with a length penalty: `BeamSampler`, its own loop over `beams` copies of each row.

Scores are sums of log-probabilities; the final choice divides by the GNMT
length penalty `((5 + length) / 6) ** length_penalty` (Wu et al., 2016).
Beam size 1 is exactly greedy decoding. A beam ends at `end_id` (`-1`: never).
"""

import tensorflow as tf

from tfformer.generation.samplers import Sampler
from tfformer.generation.tokens import PAD_ID

NEG = -1e9


def _reorder(caches, flat_index):
    """Per-layer caches `(B*K, ...)` gathered along the batch axis to follow the surviving beams."""
    return tuple(tf.gather(c, flat_index, axis=0) for c in caches)


def _select(scores, log_probs, forced, finished, beam, vocab, fill=PAD_ID):
    """One beam step: scores (B, K), log_probs (B*K, V) -> new scores, source beam (B, K), tokens (B, K)."""
    batch = tf.shape(scores)[0]
    log_probs = tf.reshape(log_probs, (batch, beam, vocab))  # (B, K, V)
    only = lambda token: tf.where(tf.range(vocab)[None, None, :] == token[..., None], 0.0, NEG)  # noqa: E731
    # A finished beam may only continue with `fill`, at no cost; a forced (prompt) position only with its token.
    log_probs = tf.where(finished[..., None], only(tf.fill(tf.shape(finished), fill)), log_probs)
    log_probs = tf.where((forced >= 0)[..., None], only(forced), log_probs)
    total = tf.reshape(scores[..., None] + log_probs, (batch, beam * vocab))  # (B, K*V)
    new_scores, index = tf.math.top_k(total, k=beam)  # (B, K)
    return new_scores, index // vocab, index % vocab


def _flat(source_beam, beam):
    batch = tf.shape(source_beam)[0]
    return tf.reshape(source_beam + tf.range(batch)[:, None] * beam, [-1])  # (B*K,)


def _penalized(scores, lengths, length_penalty):
    return scores / tf.pow((5.0 + tf.cast(lengths, tf.float32)) / 6.0, length_penalty)


class BeamSampler(Sampler):
    """Beam search: keeps the `beam_size` best sequences of each row, picks the best by the GNMT length penalty.

    The task's caches, `ids` and `logits` hold `beams` (= `beam_size`) adjacent copies of each row, `(B*K, ...)`;
    `run` takes `tokens` `(B, T)` and returns the best beam's `(B, T)`. Its caches are reordered along their
    batch axis, so a plan must have no `kernel_layout` (no split caches).

    Args:
        beam_size: int >= 1.
        length_penalty: float. The GNMT exponent; 0 compares plain sums of log-probabilities.
    """

    kind = "beam"

    def __init__(self, beam_size, length_penalty=0.6):
        if isinstance(beam_size, bool) or not isinstance(beam_size, int) or beam_size < 1:
            raise ValueError(f"`beam_size` must be a positive integer. Received: beam_size={beam_size!r}")
        if isinstance(length_penalty, bool) or not isinstance(length_penalty, (int, float)):
            raise ValueError(f"`length_penalty` must be a number. Received: length_penalty={length_penalty!r}")
        self.beams, self.length_penalty = beam_size, length_penalty

    def key(self):
        return ("beam", self.beams, self.length_penalty)

    @staticmethod
    def check_plan(plan):
        if plan is not None and plan.kernel_layout is not None:
            raise ValueError(f"Beam search takes a plan without `kernel_layout`. Received: plan={plan!r}")

    def run(self, next, tokens, cache, index, end_id, max_new_tokens, column=None, ids=None, logits=None,
            prompt_lengths=None, fill=PAD_ID, plan=None, prefix=0):
        """`Sampler.run`'s loop over beams: `cache`, `ids` `(B*K, 1)` and `logits` `(B*K, V)` hold each row's
        `beams` copies; `tokens` `(B, T)` and `prompt_lengths` `(B,)` one per row. Every row runs all
        `max_new_tokens` columns; an ended beam continues with `fill` at no cost."""
        self.check_plan(plan)
        beam = self.beams
        column, written = self._columns(index, column, ids, logits)
        batch = tf.shape(tokens)[0]
        width = tokens.shape[-1] if tokens.shape[-1] is not None else tf.shape(tokens)[-1]
        tokens = tf.tile(tokens[:, None, :], [1, beam, 1])  # (B, K, T)
        scores = tf.tile(tf.concat([[0.0], tf.fill([beam - 1], NEG)], 0)[None], [batch, 1])  # only beam 0 is live
        finished = tf.zeros([batch, beam], tf.bool)
        lengths = tf.zeros([batch, beam], tf.int32)
        row_lengths = None if prompt_lengths is None else tf.tile(prompt_lengths[:, None], [1, beam])  # (B, K)

        def choose(logits, column, tokens, cache, scores, finished, lengths):
            vocab = logits.shape[-1]
            log_probs = tf.nn.log_softmax(tf.cast(logits, tf.float32))  # (B*K, V)
            if row_lengths is None:
                forced = tf.fill([batch, beam], -1)
            else:
                in_prompt = column < row_lengths
                forced = tf.where(in_prompt, tf.gather(tokens, column, axis=2), -1)  # (B, K); see Sampler._choose
            scores, source, token = _select(scores, log_probs, forced, finished, beam, vocab, fill)
            cache = _reorder(cache, _flat(source, beam))
            tokens = tf.gather(tokens, source, batch_dims=1)
            finished = tf.gather(finished, source, batch_dims=1)
            generated = ~finished if row_lengths is None else ~finished & ~in_prompt
            lengths = tf.gather(lengths, source, batch_dims=1) + tf.cast(generated, tf.int32)
            tokens = tf.where(tf.range(width) == column, token[..., None], tokens)  # write the column
            if row_lengths is None:
                finished = finished | tf.equal(token, end_id)
            else:
                ended = column + 1 >= row_lengths + max_new_tokens
                finished = finished | (generated & tf.equal(token, end_id)) | ended
            return tf.reshape(token, (-1, 1)), tokens, cache, scores, finished, lengths  # ids (B*K, 1)

        state = (ids, tokens, cache, scores, finished, lengths)
        if logits is not None:
            state = choose(logits, column, *state[1:])
        stop = (column if prompt_lengths is None else tf.reduce_max(prompt_lengths)) + max_new_tokens

        def cond(i, *_):
            return written(i) < stop

        def body(plan, i, ids, tokens, cache, *rest):
            logits, _, cache = next(ids, cache, i, plan=plan)
            return (i + 1, *choose(logits, written(i), tokens, cache, *rest))

        _, _, tokens, _, scores, _, lengths = self._loop(cond, body, (index, *state), plan, prefix, max_new_tokens)
        best = tf.argmax(_penalized(scores, lengths, self.length_penalty), axis=1, output_type=tf.int32)  # (B,)
        return tf.gather(tokens, best, batch_dims=1)  # (B, T)
