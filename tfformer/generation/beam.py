"""Beam search: `BeamSampler`, its own loop over `beams` copies of each row.

Scores are sums of log-probabilities; the winner's is divided by a length normalization (`normalization`):
GNMT's `((5 + length) / 6) ** length_penalty` (Wu et al., 2016) or `length ** length_penalty` (CTranslate2's;
with 1, the mean log-probability per token). Two ways to finish:

- GNMT's (`patience=None`, the default): an ended beam keeps its slot and continues with `fill` at no cost; the
  best of the `beam_size` beams after the last column wins. `length` counts the generated tokens with the end.
- Patience (Kasai et al., 2022, "A Call for Clarity in Beam Search"; CTranslate2's and so faster-whisper's):
  each step ranks `2 * beam_size` candidates; those among the best `beam_size` that end are set aside as
  finished hypotheses and the first `beam_size` that do not end stay live, so `beam_size` beams always search
  on. A row stops once `round(beam_size * patience)` hypotheses have finished (with `length_penalty` 0: as soon
  as the best candidate ends) or at its last column, where every live beam finishes; the best finished
  hypothesis wins. `length` counts the generated tokens without the end, as CTranslate2 does.

Beam size 1 is exactly greedy decoding. A beam ends at `end_id` (`-1`: never).
"""

import collections
import functools
import math

import tensorflow as tf

from tfformer.checks import check_int, check_number
from tfformer.generation.samplers import Sampler
from tfformer.tokens import PAD_ID

NEG = -1e9
NORMALIZATIONS = ("gnmt", "length")


def _reorder(caches, flat_index):
    """Per-layer caches `(B*K, ...)` gathered along the batch axis to follow the surviving beams."""
    return tuple(tf.gather(c, flat_index, axis=0) for c in caches)


def _select(scores, log_probs, forced, finished, beam, vocab, fill=PAD_ID, candidates=None):
    """One beam step: scores (B, K), log_probs (B*K, V) -> the best `candidates` (default K) continuations:
    their scores, source beams and tokens, each (B, candidates)."""
    batch = tf.shape(scores)[0]
    log_probs = tf.reshape(log_probs, (batch, beam, vocab))  # (B, K, V)
    only = lambda token: tf.where(tf.range(vocab)[None, None, :] == token[..., None], 0.0, NEG)  # noqa: E731
    # A finished beam may only continue with `fill`, at no cost; a forced (prompt) position only with its token.
    log_probs = tf.where(finished[..., None], only(tf.fill(tf.shape(finished), fill)), log_probs)
    log_probs = tf.where((forced >= 0)[..., None], only(forced), log_probs)
    total = tf.reshape(scores[..., None] + log_probs, (batch, beam * vocab))  # (B, K*V)
    new_scores, index = tf.math.top_k(total, k=candidates or beam)  # (B, C)
    return new_scores, index // vocab, index % vocab


def _flat(source_beam, beam):
    batch = tf.shape(source_beam)[0]
    return tf.reshape(source_beam + tf.range(batch)[:, None] * beam, [-1])  # (B*K,)


def _penalized(scores, lengths, length_penalty, normalization="gnmt"):
    lengths = tf.cast(lengths, tf.float32)
    if normalization == "length":
        return scores / tf.pow(lengths, length_penalty)
    return scores / tf.pow((5.0 + lengths) / 6.0, length_penalty)


# What a beam step needs of the rows: the batch size, the end and fill ids, the prompt lengths `(B,)` (or None)
# and the column (exclusive) each row's last token goes in.
_Rows = collections.namedtuple("_Rows", "batch end_id fill prompt_lengths row_stop")


def _in_prompt(rows, column):
    """`(B, 1)`: whether `column` is still in each row's prompt (never without prompt lengths)."""
    if rows.prompt_lengths is None:
        return tf.zeros([rows.batch, 1], tf.bool)
    return (column < rows.prompt_lengths)[:, None]


def _write(tokens, column, token):
    """`tokens` `(..., T)` with column `column` set to `token` `(...)`."""
    width = tokens.shape[-1] if tokens.shape[-1] is not None else tf.shape(tokens)[-1]  # static when known
    return tf.where(tf.range(width) == column, token[..., None], tokens)


class BeamSampler(Sampler):
    """Beam search: keeps the `beam_size` best sequences of each row and returns the best by a length penalty.

    The task's caches, `ids` and `logits` hold `beams` (= `beam_size`) adjacent copies of each row, `(B*K, ...)`;
    `run` takes `tokens` `(B, T)` and returns the best sequence's `(B, T)`. Its caches are reordered along their
    batch axis, so a plan must have no `kernel_layout` (no split caches). See the module docstring for the two
    ways to finish.

    Args:
        beam_size: int >= 1.
        length_penalty: float. The exponent of the length normalization; 0 compares plain sums of
            log-probabilities.
        normalization: `"gnmt"` (`((5 + length) / 6) ** length_penalty`, the default) or `"length"`
            (`length ** length_penalty`: with 1, the mean log-probability per token, as CTranslate2).
        patience: float > 0 or None. None: GNMT's search (ended beams keep their slot). A number: finished
            hypotheses are set aside and a row stops after `round(beam_size * patience)` of them
            (CTranslate2's and faster-whisper's search with `patience=1`).
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

    @staticmethod
    def check_plan(plan):
        if plan is not None and plan.kernel_layout is not None:
            raise ValueError(f"Beam search takes a plan without `kernel_layout`. Received: plan={plan!r}")

    def run(self, next, tokens, cache, index, end_id, max_new_tokens, column=None, ids=None, logits=None,
            prompt_lengths=None, fill=PAD_ID, plan=None, prefix=0):
        """`Sampler.run`'s loop over beams: `cache`, `ids` `(B*K, 1)` and `logits` `(B*K, V)` hold each row's
        `beams` copies; `tokens` `(B, T)` and `prompt_lengths` `(B,)` one per row. Without `patience` every row
        runs all `max_new_tokens` columns and an ended beam continues with `fill` at no cost; with it the loop
        stops when every row has finished. After the chosen sequence's end its columns hold `fill`."""
        self.check_plan(plan)
        beam = self.beams
        column, written = self._columns(index, column, ids, logits)
        batch = tf.shape(tokens)[0]
        # The column (exclusive) a row's last token goes in: (B,), or a scalar without prompt lengths.
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
        stop = (column if prompt_lengths is None else tf.reduce_max(prompt_lengths)) + max_new_tokens

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
        penalized = _penalized(scores, lengths, self.length_penalty, self.normalization)
        best = tf.argmax(penalized, axis=1, output_type=tf.int32)  # (B,)
        return tf.gather(tokens, best, batch_dims=1)  # (B, T)

    def _gnmt_step(self, rows, logits, column, tokens, cache, scores, lengths, finished):
        """GNMT's step at `column`: every beam continues (an ended one with `fill`, at no cost). Returns the ids
        `(B*K, 1)` to feed next and the new `(tokens, cache, scores, lengths, finished)`."""
        beam, vocab = self.beams, logits.shape[-1]
        log_probs = tf.nn.log_softmax(tf.cast(logits, tf.float32))  # (B*K, V)
        if rows.prompt_lengths is None:
            forced = tf.fill([rows.batch, beam], -1)
        else:
            in_prompt = _in_prompt(rows, column)  # (B, 1)
            forced = tf.where(in_prompt, tf.gather(tokens, column, axis=2), -1)  # (B, K); see Sampler.run
        scores, source, token = _select(scores, log_probs, forced, finished, beam, vocab, rows.fill)
        cache = _reorder(cache, _flat(source, beam))
        tokens = tf.gather(tokens, source, batch_dims=1)
        finished = tf.gather(finished, source, batch_dims=1)
        generated = ~finished if rows.prompt_lengths is None else ~finished & ~in_prompt
        lengths = tf.gather(lengths, source, batch_dims=1) + tf.cast(generated, tf.int32)
        tokens = _write(tokens, column, token)
        if rows.prompt_lengths is None:
            finished = finished | tf.equal(token, rows.end_id)
        else:
            ended = (column + 1 >= rows.row_stop)[:, None]  # (B, 1)
            finished = finished | (generated & tf.equal(token, rows.end_id)) | ended
        return tf.reshape(token, (-1, 1)), tokens, cache, scores, lengths, finished  # ids (B*K, 1)

    def _patience_step(self, rows, logits, column, tokens, cache, scores, lengths, best_tokens, best_score, count,
                       done):
        """The step at `column` with finished hypotheses set aside (see the module docstring): live beams never
        end, and each row keeps only its best finished hypothesis `(B, T)`, its normalized score and how many
        finished. Returns the ids `(B*K, 1)` to feed next and the new state, as `_gnmt_step`."""
        beam, candidates, vocab = self.beams, 2 * self.beams, logits.shape[-1]
        log_probs = tf.nn.log_softmax(tf.cast(logits, tf.float32))  # (B*K, V)
        in_prompt = _in_prompt(rows, column)  # (B, 1)
        forced = tf.where(in_prompt, tf.gather(tokens, column, axis=2), -1)  # (B, K); see Sampler.run
        live = tf.zeros([rows.batch, beam], tf.bool)  # no live beam has ended: `_select` lets every beam continue
        cand_scores, source, token = _select(scores, log_probs, forced, live, beam, vocab, rows.fill, candidates)
        ended = tf.equal(token, rows.end_id) & ~in_prompt  # (B, C)
        last = tf.broadcast_to(column + 1 >= rows.row_stop, [rows.batch])  # (B,): every live beam finishes
        cand_lengths = tf.gather(lengths, source, batch_dims=1) + tf.cast(~ended & ~in_prompt, tf.int32)

        # Finished hypotheses: the ended among the best `beam` candidates (every one of them at the last column).
        register = (tf.range(candidates) < beam) & (ended | last[:, None]) & ~done[:, None]  # (B, C)
        normalized = tf.where(register, _penalized(cand_scores, cand_lengths, self.length_penalty,
                                                   self.normalization), -float("inf"))
        pick = tf.argmax(normalized, axis=1, output_type=tf.int32)  # (B,)
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
        source, token = tf.gather(source, keep, batch_dims=1), tf.gather(token, keep, batch_dims=1)
        scores = tf.gather(cand_scores, keep, batch_dims=1)
        lengths = tf.gather(cand_lengths, keep, batch_dims=1)
        cache = _reorder(cache, _flat(source, beam))
        tokens = _write(tf.gather(tokens, source, batch_dims=1), column, token)
        return tf.reshape(token, (-1, 1)), tokens, cache, scores, lengths, best_tokens, best_score, count, done
