"""Token choosers: pure functions of the last logits `(B, V)` (float32) -> ids `(B,)` int32.

Randomness is stateless (`seed` and the step index), so the same seed repeats
the same sample, in eager, graph and XLA alike.
"""

import tensorflow as tf

KINDS = ("greedy", "temperature", "top_k", "top_p")


class Sampler:
    """How the next token is picked.

    Args:
        kind: `"greedy"` (argmax), `"temperature"` (sample from softmax(logits / temperature):
            random-weighted sampling), `"top_k"` (sample among the `k` most likely) or
            `"top_p"` (sample from the smallest set whose probability reaches `p`; nucleus).
        temperature: float > 0. Applies to every sampling kind. Defaults to `1.0`.
        k: int >= 1 for `top_k`.
        p: float in (0, 1] for `top_p`.
        seed: int. Same seed, same tokens. Defaults to `0`.
    """

    def __init__(self, kind="greedy", temperature=1.0, k=None, p=None, seed=0):
        if kind not in KINDS:
            raise ValueError(f"`kind` must be one of {KINDS}. Received: kind={kind!r}")
        if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or temperature <= 0:
            raise ValueError(f"`temperature` must be a number > 0. Received: temperature={temperature!r}")
        if kind == "top_k" and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"`k` must be an integer >= 1 for kind='top_k'. Received: k={k!r}")
        if kind == "top_p" and (not isinstance(p, (int, float)) or isinstance(p, bool) or not 0 < p <= 1):
            raise ValueError(f"`p` must be in (0, 1] for kind='top_p'. Received: p={p!r}")
        self.kind, self.temperature, self.k, self.p, self.seed = kind, float(temperature), k, p, int(seed)

    def key(self):
        return (self.kind, self.temperature, self.k, self.p, self.seed)

    def __call__(self, logits, step):
        logits = tf.cast(logits, tf.float32)
        if self.kind == "greedy":
            return tf.argmax(logits, axis=-1, output_type=tf.int32)
        logits = logits / self.temperature
        if self.kind == "top_k":
            k = tf.minimum(self.k, tf.shape(logits)[-1])
            kth = tf.math.top_k(logits, k=k).values[:, -1:]  # (B, 1)
            logits = tf.where(logits < kth, -1e9, logits)
        elif self.kind == "top_p":
            sorted_logits = tf.sort(logits, direction="DESCENDING", axis=-1)  # (B, V)
            probs = tf.nn.softmax(sorted_logits, axis=-1)
            before = tf.cumsum(probs, axis=-1, exclusive=True)  # mass of the strictly more likely tokens
            keep = before < self.p  # always keeps the most likely token
            cutoff = tf.reduce_min(tf.where(keep, sorted_logits, 1e9), axis=-1, keepdims=True)  # (B, 1)
            logits = tf.where(logits < cutoff, -1e9, logits)
        seed = tf.stack([tf.constant(self.seed, tf.int32), tf.cast(step, tf.int32)])
        return tf.cast(tf.random.stateless_categorical(logits, 1, seed=seed)[:, 0], tf.int32)


def as_sampler(sampler):
    if sampler is None:
        return Sampler("greedy")
    if isinstance(sampler, str):
        return Sampler(sampler)
    if isinstance(sampler, Sampler):
        return sampler
    raise ValueError(f"`sampler` must be a Sampler or one of {KINDS}. Received: sampler={sampler!r}")
