"""Samplers (keras-hub's pattern): the one decode loop, `Sampler.run`, and the token choice subclasses override.
Draws are stateless (`seed`, step): the same seed repeats a sample in eager and graph mode, and under XLA; but XLA draws
other samples than the graph runtime for the same seed (TensorFlow's stateless kernels differ: measured on CPU)."""

import tensorflow as tf

from tfformer.checks import check_int, check_number
from tfformer.tokens import PAD_ID


class Sampler:
    """How the next token is picked (`get_next_token`, which subclasses override), and the loop that picks it."""

    kind, temperature, k, p, seed = None, 1.0, None, None, 0
    beams = 1  # rows the loop keeps per input row: the task's caches and prefill hold that many copies of each

    def key(self):
        """What tells compiled decode functions apart."""
        return (self.kind, self.temperature, self.k, self.p, self.seed)

    def get_next_token(self, logits, step):
        """Ids `(B,)` int32 for the logits `(B, V)` of step `step` (an int32 scalar: the column they fill)."""
        raise NotImplementedError(f"{type(self).__name__} does not pick tokens one row at a time.")

    def _sample(self, logits, step):
        """One stateless draw from softmax(`logits`) `(B, V)` float32, seeded by `seed` and `step`."""
        seed = tf.stack([tf.constant(self.seed, tf.int32), tf.cast(step, tf.int32)])
        return tf.cast(tf.random.stateless_categorical(logits, 1, seed=seed)[:, 0], tf.int32)

    def run(self, next, tokens, cache, index, end_id, max_new_tokens, **options):
        """`run_with_cache`'s `tokens` `(B, T)` alone."""
        return self.run_with_cache(next, tokens, cache, index, end_id, max_new_tokens, **options)[0]

    def run_with_cache(self, next, tokens, cache, index, end_id, max_new_tokens, column=None, ids=None, logits=None,
                       prompt_lengths=None, fill=PAD_ID, plan=None, prefix=0):
        """Fill `tokens` `(B, T)` int32 from column `column` (default `index`) on; returns it and the last `cache`.

        Step `i` feeds ids `(B, 1)` at cache index `index + i` to `next(ids, cache, index, plan=plan) -> (logits
        (B, V), hidden, cache)`; the token chosen from the logits goes to the next column. The first step feeds `ids`,
        or the token chosen from a prefill's `logits` (written to `column`). A row ends at `end_id` (-1: never; `fill`
        after it) or `max_new_tokens` columns past its `prompt_lengths` `(B,)`, whose columns keep the prompt. A `plan`
        runs `plan.segmented_loop` over caches that grow from `prefix + plan.first_segment(max_new_tokens)` slots.
        `cache` may carry a task's own per-row state beside its key/value caches (`next` reads and returns it).
        """
        column, written, stop = self._columns(index, column, ids, logits, prompt_lengths, max_new_tokens)

        def choose(logits, column, tokens, done):  # -> the ids (B, 1) to feed next, `tokens` and `done`
            batch = tf.shape(tokens)[0]
            chosen = tf.where(done, fill, self.get_next_token(logits, column))  # (B,)
            if prompt_lengths is None:
                done = done | tf.equal(chosen, end_id)
            else:
                in_prompt = column < prompt_lengths
                # A gather: a slice at a traced column outside the loop would make XLA compile once per prompt.
                chosen = tf.where(in_prompt, tf.gather(tokens, column, axis=1), chosen)
                done = done | (~in_prompt & tf.equal(chosen, end_id)) | (column + 1 >= prompt_lengths + max_new_tokens)
            at = tf.stack([tf.range(batch), tf.fill([batch], column)], 1)  # (B, 2)
            return chosen[:, None], tf.tensor_scatter_nd_update(tokens, at, chosen), done

        done = tf.zeros([tf.shape(tokens)[0]], tf.bool)
        if logits is not None:
            ids, tokens, done = choose(logits, column, tokens, done)

        # `done` read one step late: the predicate does not wait for the last token, so TensorFlow's executor (without
        # XLA) runs the next steps' loop-invariant work beside it (weights' casts), for one extra step of `fill`.
        def cond(i, ids, tokens, cache, done, done_before):
            return tf.logical_and(written(i) < stop, tf.logical_not(tf.reduce_all(done_before)))

        def body(plan, i, ids, tokens, cache, done, done_before):
            logits, _, cache = next(ids, cache, i, plan=plan)
            chosen, tokens, now_done = choose(logits, written(i), tokens, done)
            return i + 1, chosen, tokens, cache, now_done, done

        state = (index, ids, tokens, cache, done, done)
        _, _, tokens, cache, _, _ = self._loop(cond, body, state, plan, prefix, max_new_tokens)
        return tokens, cache

    @staticmethod
    def _loop(cond, body, state, plan, prefix, max_new_tokens):
        """`state` `(i, ids, tokens, cache, ...)` after `body(plan, *state)` while `cond(*state)`."""
        if plan is None:
            return tf.while_loop(cond, lambda *state: body(None, *state), state)
        return plan.segmented_loop(cond, body, state, 3, prefix, max_new_tokens)

    @staticmethod
    def _columns(index, column, ids, logits, prompt_lengths, max_new_tokens):
        """`run`'s first column, `written(i)` (the column step `i` fills) and the column the loop stops before."""
        if (ids is None) == (logits is None):
            raise ValueError("`run` takes `ids` or `logits` for its first step, not both or neither. Received: "
                             f"ids={ids!r}, logits={logits!r}")
        first = index if column is None else column
        stop = (first if prompt_lengths is None else tf.reduce_max(prompt_lengths)) + max_new_tokens
        shift = (0 if column is None else column - index) + (0 if logits is None else 1)
        if isinstance(shift, int) and shift == 0:  # no index arithmetic in the loop
            return first, lambda i: i, stop
        return first, lambda i: i + shift, stop


class GreedySampler(Sampler):
    """The most likely token."""
    kind = "greedy"

    def get_next_token(self, logits, step):
        return tf.argmax(tf.cast(logits, tf.float32), axis=-1, output_type=tf.int32)


class TemperatureSampler(Sampler):
    """A draw from softmax(logits / `temperature`) (> 0); the same `seed` (an int) draws the same tokens."""
    kind = "temperature"

    def __init__(self, temperature=1.0, seed=0):
        check_number("temperature", temperature, above=0)
        self.temperature, self.seed = float(temperature), int(seed)

    def get_next_token(self, logits, step):
        return self._sample(tf.cast(logits, tf.float32) / self.temperature, step)


class TopKSampler(TemperatureSampler):
    """A draw among the `k` most likely tokens (int >= 1), from softmax(logits / temperature). Tokens tied with the
    k-th are kept too (as Hugging Face's top-k keeps them): with ties, `k=1` is not greedy."""
    kind = "top_k"

    def __init__(self, k, temperature=1.0, seed=0):
        check_int("k", k, expected="an integer >= 1")
        super().__init__(temperature, seed)
        self.k = k

    def get_next_token(self, logits, step):
        logits = tf.cast(logits, tf.float32) / self.temperature
        kth = tf.math.top_k(logits, k=tf.minimum(self.k, tf.shape(logits)[-1])).values[:, -1:]  # (B, 1)
        return self._sample(tf.where(logits < kth, -1e9, logits), step)


class TopPSampler(TemperatureSampler):
    """A draw from the nucleus: the fewest most likely tokens whose probability reaches `p` in (0, 1]."""
    kind = "top_p"

    def __init__(self, p, temperature=1.0, seed=0):
        check_number("p", p, above=0, at_most=1, expected="in (0, 1]")
        super().__init__(temperature, seed)
        self.p = p

    def get_next_token(self, logits, step):
        logits = tf.cast(logits, tf.float32) / self.temperature
        sorted_logits = tf.sort(logits, direction="DESCENDING", axis=-1)  # (B, V)
        before = tf.cumsum(tf.nn.softmax(sorted_logits, axis=-1), axis=-1, exclusive=True)  # more likely tokens' mass
        keep = before < self.p  # always keeps the most likely token
        cutoff = tf.reduce_min(tf.where(keep, sorted_logits, 1e9), axis=-1, keepdims=True)  # (B, 1)
        return self._sample(tf.where(logits < cutoff, -1e9, logits), step)


SAMPLERS = {"greedy": GreedySampler, "temperature": TemperatureSampler}  # the others need their `k` or `p`


def get(sampler):
    """`sampler` as a `Sampler` (keras-hub's `samplers.get`): a Sampler as it is, None as `GreedySampler()`, a name
    in `SAMPLERS` as that class with its defaults."""
    if isinstance(sampler, Sampler):
        return sampler
    name = "greedy" if sampler is None else sampler
    if not isinstance(name, str) or name not in SAMPLERS:
        raise ValueError(f"`sampler` must be a Sampler (e.g. `TopKSampler(k)`, `TopPSampler(p)`), None or one of "
                         f"{tuple(SAMPLERS)}. Received: sampler={sampler!r}")
    return SAMPLERS[name]()
