"""Samplers: the one decode loop (`Sampler.run`) and the token choice each subclass overrides.

The task sets up a decode (prefill, caches, the buffer of ids) and hands `run` a callback
`next(ids, cache, index, plan=None) -> (logits, hidden, cache)` that feeds `ids` `(B, 1)` at cache index
`index` (keras-hub's sampler pattern); `get_next_token(logits, step)` picks ids `(B,)` int32 from float
logits `(B, V)`. Randomness is stateless (`seed` and the step), so the same seed repeats the same sample,
in eager, graph and XLA alike. `BeamSampler` (`generation.beam`) overrides the loop.
"""

import tensorflow as tf

from tfformer.checks import check_int, check_number
from tfformer.tokens import PAD_ID

KINDS = ("greedy", "temperature", "top_k", "top_p")


def _check_temperature(temperature):
    check_number("temperature", temperature, above=0)
    return float(temperature)


class _ByKind(type):
    """`Sampler(kind, ...)` builds the subclass for `kind` (the one-class API); subclasses construct as usual."""

    def __call__(cls, *args, **kwargs):
        if cls is Sampler:
            return _from_kind(*args, **kwargs)
        return super().__call__(*args, **kwargs)


class Sampler(metaclass=_ByKind):
    """How the next token is picked, and the decode loop that picks it step after step.

    `Sampler(kind, temperature=1.0, k=None, p=None, seed=0)` builds the subclass of `kind`:
    `"greedy"` (`GreedySampler`), `"temperature"` (`TemperatureSampler`), `"top_k"` (`TopKSampler`) or
    `"top_p"` (`TopPSampler`). Subclasses override `get_next_token`.
    """

    kind, temperature, k, p, seed = None, 1.0, None, None, 0
    beams = 1  # rows the loop keeps per input row: the task's caches and prefill hold that many copies of each

    def key(self):
        """What tells compiled decode functions apart."""
        return (self.kind, self.temperature, self.k, self.p, self.seed)

    def __repr__(self):
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"

    def get_next_token(self, logits, step):
        """Ids `(B,)` int32 for the logits `(B, V)` of step `step` (an int32 scalar: the column they fill)."""
        raise NotImplementedError(f"{type(self).__name__} does not pick tokens one row at a time.")

    def _sample(self, logits, step):
        """One stateless draw from softmax(`logits`) `(B, V)` float32, seeded by `seed` and `step`."""
        seed = tf.stack([tf.constant(self.seed, tf.int32), tf.cast(step, tf.int32)])
        return tf.cast(tf.random.stateless_categorical(logits, 1, seed=seed)[:, 0], tf.int32)

    def run(self, next, tokens, cache, index, end_id, max_new_tokens, column=None, ids=None, logits=None,
            prompt_lengths=None, fill=PAD_ID, plan=None, prefix=0):
        """Fill `tokens` `(B, T)` int32 from column `column` on, one `next` step at a time; returns `tokens`.

        Each step feeds `ids` `(B, 1)` at cache index `index`, `index + 1`, ... and writes the token chosen from
        its logits to the next column. The loop stops when every row is done (it chose `end_id`; later columns
        get `fill`) or after `max_new_tokens` columns (past the longest prompt with `prompt_lengths`).

        Args:
            next: `next(ids, cache, index, plan=plan) -> (logits (B, V), hidden or None, cache)`.
            tokens: `(B, T)` int32, the ids so far (prompts right-padded, with `prompt_lengths`).
            cache: what `next` carries from step to step (per-layer caches, with a `plan`).
            index: int32 scalar. The cache index of the first step.
            end_id: int. A row ends at it (`-1`: never).
            max_new_tokens: int. Columns to fill per row.
            column: the column of `tokens` the first step fills; defaults to `index`.
            ids: `(B, 1)` int32, what the first step feeds. Or:
            logits: `(B, V)`, a prefill's logits for `column`: the token chosen from them is written there and
                fed by the first step (which fills `column + 1`).
            prompt_lengths: `(B,)` int32 or None. Columns below a row's length keep its prompt token, and the
                row ends `max_new_tokens` columns after it.
            fill: int. The id written after a row's end.
            plan: a `generation.plan.DecodePlan` or None. With one, the loop runs `plan.segmented_loop`: `cache`
                is per-layer caches that grow from `prefix + plan.first_segment(max_new_tokens)` slots, and
                `next` gets the plan of the step. None: a plain `tf.while_loop`; `next` gets `plan=None`.
            prefix: int32 scalar. With a `plan`, the cache slots before the new tokens' (a prompt's width):
                segment k's caches hold `prefix + segment_sizes(max_new_tokens)[k]`.
        """
        column, written = self._columns(index, column, ids, logits)
        done = tf.zeros([tf.shape(tokens)[0]], tf.bool)
        if logits is not None:
            ids, tokens, done = self._choose(logits, column, tokens, done, end_id, max_new_tokens, prompt_lengths,
                                             fill)
        stop = (column if prompt_lengths is None else tf.reduce_max(prompt_lengths)) + max_new_tokens

        # The condition reads `done` one step late: then a step's predicate does not wait for the previous step's
        # token, and TensorFlow's executor (without XLA) runs the next steps' loop-invariant work, such as the
        # weights' casts under mixed precision, beside the current one. It costs one step after the last row ends,
        # which writes `fill` where `fill` already stands.
        def cond(i, ids, tokens, cache, done, done_before):
            return tf.logical_and(written(i) < stop, tf.logical_not(tf.reduce_all(done_before)))

        def body(plan, i, ids, tokens, cache, done, done_before):
            logits, _, cache = next(ids, cache, i, plan=plan)
            chosen, tokens, now_done = self._choose(logits, written(i), tokens, done, end_id, max_new_tokens,
                                                    prompt_lengths, fill)
            return i + 1, chosen, tokens, cache, now_done, done

        state = (index, ids, tokens, cache, done, done)
        return self._loop(cond, body, state, plan, prefix, max_new_tokens)[2]

    @staticmethod
    def _loop(cond, body, state, plan, prefix, max_new_tokens):
        """`state` `(i, ids, tokens, cache, ...)` after `body(plan, *state)` while `cond(*state)`: on a `plan`,
        its segmented loop over growing caches; without one, a plain `tf.while_loop` (`body` gets None)."""
        if plan is None:
            return tf.while_loop(cond, lambda *state: body(None, *state), state)
        return plan.segmented_loop(cond, body, state, 3, prefix, max_new_tokens)

    @staticmethod
    def _columns(index, column, ids, logits):
        """`run`'s first column, and `written(i)`: the column the step at cache index `i` fills."""
        if (ids is None) == (logits is None):
            raise ValueError("`run` takes `ids` or `logits` for its first step, not both or neither. Received: "
                             f"ids={ids!r}, logits={logits!r}")
        first = index if column is None else column
        shift = (0 if column is None else column - index) + (0 if logits is None else 1)
        if isinstance(shift, int) and shift == 0:  # no index arithmetic in the loop
            return first, lambda i: i
        return first, lambda i: i + shift

    def _choose(self, logits, column, tokens, done, end_id, max_new_tokens, prompt_lengths, fill):
        """Column `column` of `tokens` from `logits`: the ids `(B, 1)` to feed next, `tokens` and `done`."""
        batch = tf.shape(tokens)[0]
        chosen = tf.where(done, fill, self.get_next_token(logits, column))  # (B,)
        if prompt_lengths is None:
            done = done | tf.equal(chosen, end_id)
        else:
            in_prompt = column < prompt_lengths
            # A gather: a slice at a traced column outside the loop would make XLA compile once per prompt.
            chosen = tf.where(in_prompt, tf.gather(tokens, column, axis=1), chosen)
            done = done | (~in_prompt & tf.equal(chosen, end_id)) | (column + 1 >= prompt_lengths + max_new_tokens)
        tokens = tf.tensor_scatter_nd_update(tokens, tf.stack([tf.range(batch), tf.fill([batch], column)], 1), chosen)
        return chosen[:, None], tokens, done


class GreedySampler(Sampler):
    """The most likely token."""

    kind = "greedy"

    def get_next_token(self, logits, step):
        return tf.argmax(tf.cast(logits, tf.float32), axis=-1, output_type=tf.int32)


class TemperatureSampler(Sampler):
    """A draw from softmax(logits / temperature).

    Args:
        temperature: float > 0. Defaults to `1.0`.
        seed: int. Same seed, same tokens. Defaults to `0`.
    """

    kind = "temperature"

    def __init__(self, temperature=1.0, seed=0):
        self.temperature, self.seed = _check_temperature(temperature), int(seed)

    def get_next_token(self, logits, step):
        return self._sample(tf.cast(logits, tf.float32) / self.temperature, step)


class TopKSampler(TemperatureSampler):
    """A draw among the `k` most likely tokens (int >= 1), from softmax(logits / temperature)."""

    kind = "top_k"

    def __init__(self, k, temperature=1.0, seed=0):
        check_int("k", k, expected="an integer >= 1 for kind='top_k'")
        super().__init__(temperature, seed)
        self.k = k

    def get_next_token(self, logits, step):
        logits = tf.cast(logits, tf.float32) / self.temperature
        kth = tf.math.top_k(logits, k=tf.minimum(self.k, tf.shape(logits)[-1])).values[:, -1:]  # (B, 1)
        return self._sample(tf.where(logits < kth, -1e9, logits), step)


class TopPSampler(TemperatureSampler):
    """A draw from the smallest set of most likely tokens whose probability reaches `p` in (0, 1] (nucleus),
    from softmax(logits / temperature)."""

    kind = "top_p"

    def __init__(self, p, temperature=1.0, seed=0):
        check_number("p", p, above=0, at_most=1, expected="in (0, 1] for kind='top_p'")
        super().__init__(temperature, seed)
        self.p = p

    def get_next_token(self, logits, step):
        logits = tf.cast(logits, tf.float32) / self.temperature
        sorted_logits = tf.sort(logits, direction="DESCENDING", axis=-1)  # (B, V)
        before = tf.cumsum(tf.nn.softmax(sorted_logits, axis=-1), axis=-1, exclusive=True)  # more likely tokens' mass
        keep = before < self.p  # always keeps the most likely token
        cutoff = tf.reduce_min(tf.where(keep, sorted_logits, 1e9), axis=-1, keepdims=True)  # (B, 1)
        return self._sample(tf.where(logits < cutoff, -1e9, logits), step)


def _from_kind(kind="greedy", temperature=1.0, k=None, p=None, seed=0):
    if kind not in KINDS:
        raise ValueError(f"`kind` must be one of {KINDS}. Received: kind={kind!r}")
    _check_temperature(temperature)
    if kind == "greedy":
        return GreedySampler()
    if kind == "temperature":
        return TemperatureSampler(temperature, seed)
    if kind == "top_k":
        return TopKSampler(k, temperature, seed)
    return TopPSampler(p, temperature, seed)


def as_sampler(sampler):
    """`sampler` (a `Sampler`, one of `KINDS`, or None: greedy) as a `Sampler`."""
    if sampler is None:
        return GreedySampler()
    if isinstance(sampler, str):
        return Sampler(sampler)
    if isinstance(sampler, Sampler):
        return sampler
    raise ValueError(f"`sampler` must be a Sampler or one of {KINDS}. Received: sampler={sampler!r}")
