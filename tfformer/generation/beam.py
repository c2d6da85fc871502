"""Beam search with a length penalty, in-graph with the KV cache.

Scores are sums of log-probabilities; the final choice divides by the GNMT
length penalty `((5 + length) / 6) ** length_penalty` (Wu et al., 2016).
Beam size 1 is exactly greedy decoding. A beam ends at `end_id` (`-1`: never).
"""

import tensorflow as tf

from tfformer.generation.plan import DecodePlan
from tfformer.generation.tokens import END_ID, PAD_ID, START_ID

NEG = -1e9


def _repeat(x, beam, axis=0):
    return tf.repeat(x, beam, axis=axis)  # (B*K, ...) with each row's beams adjacent


def _reorder(caches, flat_index):
    """Per-layer caches `(B*K, ...)` gathered along the batch axis to follow the surviving beams."""
    return tuple(tf.gather(c, flat_index, axis=0) for c in caches)


def _select(scores, log_probs, forced, finished, beam, vocab):
    """One beam step: scores (B, K), log_probs (B*K, V) -> new scores, source beam (B, K), tokens (B, K)."""
    batch = tf.shape(scores)[0]
    log_probs = tf.reshape(log_probs, (batch, beam, vocab))  # (B, K, V)
    only = lambda token: tf.where(tf.range(vocab)[None, None, :] == token[..., None], 0.0, NEG)  # noqa: E731
    # A finished beam may only continue with padding, at no cost; a forced (prompt) position only with its token.
    log_probs = tf.where(finished[..., None], only(tf.fill(tf.shape(finished), PAD_ID)), log_probs)
    log_probs = tf.where((forced >= 0)[..., None], only(forced), log_probs)
    total = tf.reshape(scores[..., None] + log_probs, (batch, beam * vocab))  # (B, K*V)
    new_scores, index = tf.math.top_k(total, k=beam)  # (B, K)
    return new_scores, index // vocab, index % vocab


def _flat(source_beam, beam):
    batch = tf.shape(source_beam)[0]
    return tf.reshape(source_beam + tf.range(batch)[:, None] * beam, [-1])  # (B*K,)


def _check_plan(plan):
    """A plan beam search can follow: it reorders stacked `(B*K, ...)` caches along their batch axis, so no kernel
    layout (and no split caches)."""
    if plan is None:
        return DecodePlan()
    if plan.kernel_layout is not None:
        raise ValueError(f"Beam search takes a plan without `kernel_layout`. Received: plan={plan!r}")
    return plan


def _penalized(scores, lengths, length_penalty):
    return scores / tf.pow((5.0 + tf.cast(lengths, tf.float32)) / 6.0, length_penalty)


def seq2seq_beam_fn(model, max_new_tokens, beam, length_penalty, plan=None, end_id=END_ID):
    plan = _check_plan(plan)
    vocab = model.config.vocabulary_size

    def run(encoder_token_ids):
        batch = tf.shape(encoder_token_ids)[0]
        encoder_outputs, encoder_mask = model.encode(encoder_token_ids)
        encoder_outputs, encoder_mask = _repeat(encoder_outputs, beam), _repeat(encoder_mask, beam)
        cross = model.cross_attention_caches(encoder_outputs)
        cache = plan.layer_caches(model, batch * beam, plan.first_segment(max_new_tokens), cross.dtype)
        cross = tuple(tf.unstack(cross))
        scores = tf.tile(tf.concat([[0.0], tf.fill([beam - 1], NEG)], 0)[None], [batch, 1])  # only beam 0 is live
        output = tf.zeros([batch, beam, max_new_tokens], tf.int32)
        finished = tf.zeros([batch, beam], tf.bool)
        lengths = tf.zeros([batch, beam], tf.int32)
        tokens = tf.fill([batch * beam, 1], START_ID)

        def cond(i, *_):
            return i < max_new_tokens

        def body(plan, i, tokens, cache, scores, output, finished, lengths):
            logits, cache = model.decode_step(tokens, cache, i, cross, encoder_mask, plan=plan)
            log_probs = tf.nn.log_softmax(tf.cast(logits[:, -1, :], tf.float32))
            forced = tf.fill([batch, beam], -1)
            scores, source, token = _select(scores, log_probs, forced, finished, beam, vocab)
            flat = _flat(source, beam)
            cache = _reorder(cache, flat)
            output = tf.gather(output, source, batch_dims=1)
            finished = tf.gather(finished, source, batch_dims=1)
            lengths = tf.gather(lengths, source, batch_dims=1) + tf.cast(~finished, tf.int32)
            output = tf.where(tf.range(max_new_tokens) == i, token[..., None], output)  # write column i
            finished = finished | tf.equal(token, end_id)
            return i + 1, tf.reshape(token, (-1, 1)), cache, scores, output, finished, lengths

        loop = (tf.constant(0), tokens, cache, scores, output, finished, lengths)
        _, _, _, scores, output, finished, lengths = plan.segmented_loop(cond, body, loop, 2, 0, max_new_tokens)
        best = tf.argmax(_penalized(scores, lengths, length_penalty), axis=1, output_type=tf.int32)  # (B,)
        return tf.gather(output, best, batch_dims=1)

    return run


def causal_beam_fn(model, max_new_tokens, beam, length_penalty, plan=None, end_id=END_ID):
    plan = _check_plan(plan)
    vocab = model.config.vocabulary_size

    def run(prompt_ids):
        batch, prompt_length = tf.shape(prompt_ids)[0], tf.shape(prompt_ids)[1]
        prompt_lengths = tf.reduce_sum(tf.cast(prompt_ids != PAD_ID, tf.int32), axis=1)  # (B,)
        total = prompt_length + max_new_tokens
        tokens = tf.pad(prompt_ids, [[0, 0], [0, max_new_tokens]])  # (B, P + N)
        tokens = tf.tile(tokens[:, None, :], [1, beam, 1])  # (B, K, P + N)
        start = tf.reduce_min(prompt_lengths)
        cache = plan.layer_caches(model, batch * beam, prompt_length + plan.first_segment(max_new_tokens))
        # The whole (static-width) prompt: a slice to `start` would make XLA compile once per prompt (decode.py).
        prompts = tf.reshape(tokens, (batch * beam, -1))[:, :prompt_length]  # (B*K, P)
        logits, cache = model.decode_step(prompts, cache, 0, logits_index=start - 1, plan=plan)
        logits = logits[:, -1, :]  # (B*K, V): a fixed loop-variable shape (XLA needs it)
        scores = tf.tile(tf.concat([[0.0], tf.fill([beam - 1], NEG)], 0)[None], [batch, 1])
        finished = tf.zeros([batch, beam], tf.bool)
        lengths = tf.zeros([batch, beam], tf.int32)
        row_lengths = tf.tile(prompt_lengths[:, None], [1, beam])  # (B, K)

        def cond(i, *_):
            return i < tf.reduce_max(prompt_lengths) + max_new_tokens

        def body(plan, i, logits, tokens, cache, scores, finished, lengths):
            log_probs = tf.nn.log_softmax(tf.cast(logits, tf.float32))
            in_prompt = i < row_lengths
            forced = tf.where(in_prompt, tokens[:, :, i], -1)
            scores, source, token = _select(scores, log_probs, forced, finished, beam, vocab)
            flat = _flat(source, beam)
            cache = _reorder(cache, flat)
            tokens = tf.gather(tokens, source, batch_dims=1)
            finished = tf.gather(finished, source, batch_dims=1)
            generated = ~finished & ~in_prompt
            lengths = tf.gather(lengths, source, batch_dims=1) + tf.cast(generated, tf.int32)
            tokens = tf.where(tf.range(total) == i, token[..., None], tokens)  # write column i
            finished = finished | (generated & tf.equal(token, end_id)) | (i + 1 >= row_lengths + max_new_tokens)
            logits, cache = model.decode_step(tf.reshape(token, (-1, 1)), cache, i, plan=plan)
            return i + 1, logits[:, -1, :], tokens, cache, scores, finished, lengths

        loop = (start, logits, tokens, cache, scores, finished, lengths)
        _, _, tokens, _, scores, finished, lengths = plan.segmented_loop(cond, body, loop, 3, prompt_length,
                                                                          max_new_tokens)
        best = tf.argmax(_penalized(scores, lengths, length_penalty), axis=1, output_type=tf.int32)
        tokens = tf.gather(tokens, best, batch_dims=1)  # (B, P + N)
        index = prompt_lengths[:, None] + tf.range(max_new_tokens)[None, :]
        return tf.gather(tokens, index, batch_dims=1)

    return run
