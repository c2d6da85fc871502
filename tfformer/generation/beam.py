"""Beam search: `BeamSampler`, its own loop over `beam_size` copies of each row."""

import collections
import functools
import math

import tensorflow as tf

from tfformer.checks import check_int, check_number
from tfformer.generation.samplers import Sampler
from tfformer.tokens import PAD_ID

NEG = -1e9
NORMALIZATIONS = ("gnmt", "length")


# What a step needs of the rows; `row_stop`: the column (exclusive) of each row's last token.
_Rows = collections.namedtuple("_Rows", "batch end_id fill prompt_lengths row_stop")


def _write(tokens, column, token):
    """`tokens` `(..., T)` with column `column` set to `token` `(...)`."""
    width = tokens.shape[-1] if tokens.shape[-1] is not None else tf.shape(tokens)[-1]  # static when known
    return tf.where(tf.range(width) == column, token[..., None], tokens)


def _follow(cache, tokens, source, token, column):
    """The beams continued from beams `source` `(B, K)` with `token` `(B, K)` at `column`: the ids `(B*K, 1)` to
    feed next, `tokens` `(B, K, T)`, and the per-layer caches `(B*K, ...)` gathered along the batch axis."""
    flat = tf.reshape(source + tf.range(tf.shape(source)[0])[:, None] * source.shape[1], [-1])  # (B*K,)
    cache = tuple(tf.gather(c, flat, axis=0) for c in cache)
    return tf.reshape(token, (-1, 1)), _write(tf.gather(tokens, source, batch_dims=1), column, token), cache


class BeamSampler(Sampler):
    """Beam search over the `beam_size` best sequences of each row (1: greedy decoding).

    Scores sum log-probabilities; the winner's is divided by `((5 + length) / 6) ** length_penalty` (GNMT, Wu et al.,
    2016) or `length ** length_penalty` (`normalization="length"`, CTranslate2's). `patience=None` (GNMT's search):
    an ended beam continues with `fill` at no cost, every row runs all its columns, `length` counts the end. With a
    `patience` (Kasai et al., 2022; CTranslate2's and faster-whisper's search), of `2 * beam_size` candidates a step
    sets the ended among the best `beam_size` aside as finished and keeps the first `beam_size` that did not end; a
    row stops after `round(beam_size * patience)` finished (with `length_penalty` 0: when the best ends) or at its
    last column; `length` leaves the end out. The caches, `ids` and `logits` hold `beam_size` adjacent copies of each
    row, `(B*K, ...)`, reordered along the batch axis: a plan must have no `kernel_layout`.
    """
    kind = "beam"

    def __init__(self, beam_size, length_penalty=0.6, normalization="gnmt", patience=None):
        check_int("beam_size", beam_size)
        check_number("length_penalty", length_penalty)
        if normalization not in NORMALIZATIONS:
            raise ValueError(f"`normalization` must be one of {NORMALIZATIONS}. Received: "
                             f"normalization={normalization!r}")
        check_number("patience", patience, above=0, allow_none=True)
        self.beams, self.length_penalty = beam_size, length_penalty
        self.normalization, self.patience = normalization, patience

    def key(self):
        if self.normalization == "gnmt" and self.patience is None:
            return ("beam", self.beams, self.length_penalty)
        return ("beam", self.beams, self.length_penalty, self.normalization, self.patience)

    def _normalized(self, scores, lengths):
        lengths = tf.cast(lengths, tf.float32)
        base = lengths if self.normalization == "length" else (5.0 + lengths) / 6.0
        return scores / tf.pow(base, self.length_penalty)

    def _ranked(self, rows, logits, column, tokens, scores, finished, candidates=None):
        """Whether `column` is in each row's prompt `(B, 1)`; the best `candidates` (default K) continuations `(B, C)`:
        scores, source beams, tokens (a `finished` beam may only add `fill`, at no cost; a prompt column its token)."""
        beam, vocab, batch = self.beams, logits.shape[-1], tf.shape(scores)[0]
        log_probs = tf.reshape(tf.nn.log_softmax(tf.cast(logits, tf.float32)), (batch, beam, vocab))  # (B, K, V)
        if rows.prompt_lengths is None:
            in_prompt, forced = tf.zeros([rows.batch, 1], tf.bool), tf.fill([rows.batch, beam], -1)
        else:
            in_prompt = (column < rows.prompt_lengths)[:, None]  # (B, 1)
            forced = tf.where(in_prompt, tf.gather(tokens, column, axis=2), -1)  # (B, K); see Sampler.run
        only = lambda token: tf.where(tf.range(vocab)[None, None, :] == token[..., None], 0.0, NEG)  # noqa: E731
        log_probs = tf.where(finished[..., None], only(tf.fill(tf.shape(finished), rows.fill)), log_probs)
        log_probs = tf.where((forced >= 0)[..., None], only(forced), log_probs)
        total = tf.reshape(scores[..., None] + log_probs, (batch, beam * vocab))  # (B, K*V)
        top_scores, index = tf.math.top_k(total, k=candidates or beam)  # (B, C)
        return in_prompt, top_scores, index // vocab, index % vocab

    def run(self, next, tokens, cache, index, end_id, max_new_tokens, column=None, ids=None, logits=None,
            prompt_lengths=None, fill=PAD_ID, plan=None, prefix=0):
        """`Sampler.run` over beams: `cache`, `ids` and `logits` hold each row's `beams` copies, `(B*K, ...)`."""
        if plan is not None and plan.kernel_layout is not None:
            raise ValueError(f"Beam search takes a plan without `kernel_layout`. Received: plan={plan!r}")
        beam = self.beams
        column, written, stop = self._columns(index, column, ids, logits, prompt_lengths, max_new_tokens)
        batch = tf.shape(tokens)[0]
        row_stop = column + max_new_tokens if prompt_lengths is None else prompt_lengths + max_new_tokens
        rows = _Rows(batch, end_id, fill, prompt_lengths, row_stop)
        state = (ids, tf.tile(tokens[:, None, :], [1, beam, 1]), cache,  # tokens (B, K, T)
                 tf.tile(tf.concat([[0.0], tf.fill([beam - 1], NEG)], 0)[None], [batch, 1]),  # only beam 0 is live
                 tf.zeros([batch, beam], tf.int32))  # scores (B, K), lengths (B, K)
        if self.patience is None:
            step = functools.partial(self._gnmt_step, rows)
            state += (tf.zeros([batch, beam], tf.bool),)  # finished (B, K)
        else:
            step = functools.partial(self._patience_step, rows)
            # The best finished hypothesis (B, T), its normalized score, how many finished, whether a row is done.
            state += (tokens, tf.fill([batch], -float("inf")), tf.zeros([batch], tf.int32), tf.zeros([batch], tf.bool))
        if logits is not None:
            state = step(logits, column, *state[1:])

        def cond(i, *state):
            if self.patience is None:
                return written(i) < stop
            return tf.logical_and(written(i) < stop, tf.logical_not(tf.reduce_all(state[-1])))  # state[-1]: done

        def body(plan, i, ids, tokens, cache, *rest):
            logits, _, cache = next(ids, cache, i, plan=plan)
            return (i + 1, *step(logits, written(i), tokens, cache, *rest))

        _, _, tokens, _, scores, lengths, *rest = self._loop(cond, body, (index, *state), plan, prefix, max_new_tokens)
        if self.patience is not None:
            return rest[0]  # the best finished hypothesis (B, T)
        best = tf.argmax(self._normalized(scores, lengths), axis=1, output_type=tf.int32)  # (B,)
        return tf.gather(tokens, best, batch_dims=1)  # (B, T)

    def _gnmt_step(self, rows, logits, column, tokens, cache, scores, lengths, finished):
        """GNMT's step at `column` (an ended beam continues with `fill`): the next ids `(B*K, 1)` and new state."""
        in_prompt, scores, source, token = self._ranked(rows, logits, column, tokens, scores, finished)
        finished = tf.gather(finished, source, batch_dims=1)
        generated = ~finished if rows.prompt_lengths is None else ~finished & ~in_prompt
        lengths = tf.gather(lengths, source, batch_dims=1) + tf.cast(generated, tf.int32)
        if rows.prompt_lengths is None:
            finished = finished | tf.equal(token, rows.end_id)
        else:  # a row also ends at its last column
            finished = finished | (generated & tf.equal(token, rows.end_id)) | (column + 1 >= rows.row_stop)[:, None]
        return (*_follow(cache, tokens, source, token, column), scores, lengths, finished)

    def _patience_step(self, rows, logits, column, tokens, cache, scores, lengths, best_tokens, best_score, count,
                       done):
        """The step with finished hypotheses set aside (a row keeps its best `(B, T)`, its score and their count)."""
        beam, candidates = self.beams, 2 * self.beams
        live = tf.zeros([rows.batch, beam], tf.bool)  # no live beam has ended: every one may continue
        in_prompt, cand_scores, source, token = self._ranked(rows, logits, column, tokens, scores, live, candidates)
        ended = tf.equal(token, rows.end_id) & ~in_prompt  # (B, C)
        last = tf.broadcast_to(column + 1 >= rows.row_stop, [rows.batch])  # (B,): every live beam finishes
        cand_lengths = tf.gather(lengths, source, batch_dims=1) + tf.cast(~ended & ~in_prompt, tf.int32)

        # Finished hypotheses: the ended among the best `beam` candidates (every one of them at the last column).
        register = (tf.range(candidates) < beam) & (ended | last[:, None]) & ~done[:, None]  # (B, C)
        normalized = tf.where(register, self._normalized(cand_scores, cand_lengths), -float("inf"))
        # Among the registered only, also when each scores -inf: TF's argmax finds nothing above its lowest float in
        # a row of -inf (or of float32.min) and answers 0, a candidate that may not have ended.
        pick = tf.argmax(tf.where(register, tf.maximum(normalized, -1e30), -2e30), axis=1, output_type=tf.int32)
        picked = tf.gather(normalized, pick, batch_dims=1)
        hypothesis = _write(tf.gather(tokens, tf.gather(source, pick, batch_dims=1), batch_dims=1), column,
                            tf.gather(token, pick, batch_dims=1))  # (B, T)
        # The first hypothesis counts even at -inf (an end at length 0 under `length ** length_penalty`).
        better = (picked > best_score) | ((count == 0) & tf.reduce_any(register, axis=1))
        best_tokens = tf.where(better[:, None], hypothesis, best_tokens)
        best_score = tf.where(better, picked, best_score)
        count += tf.reduce_sum(tf.cast(register, tf.int32), axis=1)
        # Without a length penalty no live beam can overtake the best candidate once it ends; else CTranslate2's
        # `round(beam_size * patience)` hypotheses (halves away from zero; at least one).
        needed = max(1, math.floor(beam * self.patience + 0.5))
        done = done | (register[:, 0] if self.length_penalty == 0 else count >= needed) | last

        # Live beams: the first `beam` candidates that did not end (a beam ends at most once per step, so at least
        # `beam` of the `2 * beam` did not).
        order = tf.cast(candidates - tf.range(candidates), tf.float32)  # (C,): larger for earlier candidates
        _, keep = tf.math.top_k(tf.where(ended, 0.0, order), k=beam)  # (B, K)
        source, token, scores, lengths = (tf.gather(x, keep, batch_dims=1) for x in (source, token, cand_scores,
                                                                                      cand_lengths))
        return (*_follow(cache, tokens, source, token, column), scores, lengths, best_tokens, best_score, count, done)
