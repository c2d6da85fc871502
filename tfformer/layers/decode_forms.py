"""The fast forms of a layer's step inside a compiled decode loop (CPU), behind the plan the layers are given.

`DecodeForms` overrides the plain forms of `layer_utils.PlainForms`; `tfformer.generation.DecodePlan`, a subclass,
chooses them for a loop and lays the kernels out. What each form does, and why (docs/performance.md):

- `kernel_layout` with `kernels` (laid out before the loop): one-token matmuls read them.
  - `"rows"`, for a batch of one: `[x, 1] @ transpose([W^T | b])`. XLA's CPU backend fuses a vector times a
    transposed matrix into one loop that reads each output's weights contiguously and runs on both threads,
    while `x @ W + b` is a single-threaded matrix-vector call. The bias rides along as a last column: a separate
    add would take the dot into an output fusion instead. The rows are in the compute dtype of the layer that owns
    the kernel; the product runs in float32, the rows converted inside the fused loop.
  - `"halves"`, for larger batches: `concat([x @ W[:, :u/2], x @ W[:, u/2:]]) + b`, two independent dots that
    XLA's executor runs on both threads (one small dot runs on one).
- `in_place_cache_writes` (XLA; TFLite files): cache writes are dynamic-update-slices, so a step writes `T` positions
  instead of rewriting the whole buffer; and one query against a stacked cache takes the fused one-step scores and
  mixing (`dot`, `mix`). In TensorFlow's graph runtime the update is XlaDynamicUpdateSlice, which needs XLA at run
  time, hence the select form by default; TFLite's converter makes it DYNAMIC_UPDATE_SLICE (`export.tflite`).
- Split caches (`layer_utils.split_cache`: `(keys, values)`, each `(B*K, S, H)`, float32 under any policy, passed as
  a `layer_utils.SplitCache` so that Keras does not cast them): the attention reads each half as a buffer of its own
  with a batched matmul; a half sliced from a stacked buffer is not one, and XLA copies every cached key and value
  before each step's matmul.
- `native_bfloat16` (TensorFlow's graph runtime, not XLA): softmax and SiLU take bfloat16 tensors as they are. On
  CPUs with bfloat16 instructions oneDNN computes them in float32 inside and rounds once, the numbers of the casts.
"""

import tensorflow as tf
from keras import ops

from tfformer.layers.layer_utils import PlainForms, SplitCache, silu, write_cache

KERNEL_LAYOUTS = ("rows", "halves")


def check_kernel_layout(kernel_layout, allow_none=True):
    if (kernel_layout is None and allow_none) or kernel_layout in KERNEL_LAYOUTS:
        return
    raise ValueError(f"`kernel_layout` must be one of {KERNEL_LAYOUTS}{' or None' if allow_none else ''}. "
                     f"Received: kernel_layout={kernel_layout!r}")


class DecodeForms(PlainForms):
    """The forms of a decode step (module docstring); with every argument at its default, the plain forms on
    stacked caches, and split caches read as such.

    Args:
        kernel_layout: `"rows"`, `"halves"` or None (plain matmuls). XLA only.
        in_place_cache_writes: bool. In-place cache writes and one-step attention forms. XLA (TFLite files: the writes).
        native_bfloat16: bool. bfloat16 softmax and SiLU without float32 casts around them. Graph runtime only.
        kernels: `{id(kernel): (parts, id(bias) or None)}` laid out in `kernel_layout`
            (`generation.plan.prepared_kernels`).
    """

    def __init__(self, kernel_layout=None, in_place_cache_writes=False, native_bfloat16=False, kernels=None):
        check_kernel_layout(kernel_layout)
        if kernels is not None and kernel_layout is None:
            raise ValueError("`kernels` need a `kernel_layout`. Received: kernel_layout=None")
        if native_bfloat16 and (kernel_layout is not None or in_place_cache_writes):
            raise ValueError("`native_bfloat16` is for the graph runtime, without XLA's forms. Received: "
                             f"kernel_layout={kernel_layout!r}, in_place_cache_writes={in_place_cache_writes!r}")
        self.kernel_layout = kernel_layout
        self.in_place_cache_writes = bool(in_place_cache_writes)
        self.native_bfloat16 = bool(native_bfloat16)
        self.kernels = kernels

    # === Matmuls on laid-out kernels ===
    def uses(self, x, kernel, bias=None):
        """Whether `dense(x, kernel, bias)` reads a laid-out kernel: one token, `kernel` among them, its own bias."""
        if self.kernels is None or x.shape[1] != 1 or id(kernel) not in self.kernels:
            return False
        return bias is None or self.kernels[id(kernel)][1] == id(bias)

    def one_row(self, x):
        """Whether `x` `(B, T, D)` is one token in the "rows" layout (a batch-1 decode step under XLA)."""
        return self.kernels is not None and self.kernel_layout == "rows" and x.shape[1] == 1

    def dense(self, x, kernel, bias=None, start=0, stop=None):
        stop = kernel.shape[-1] if stop is None else stop
        part = (start, stop) != (0, kernel.shape[-1])
        if not self.uses(x, kernel, bias) or (part and self.kernel_layout == "halves"):  # no halves of a slice
            return super().dense(x, kernel, bias, start, stop)
        parts = self.kernels[id(kernel)][0]
        if self.kernel_layout == "halves":
            y = ops.concatenate([ops.matmul(x, ops.cast(h, x.dtype)) for h in parts], axis=-1)  # (B, 1, units)
            return y if bias is None else y + ops.cast(bias, x.dtype)
        rows = parts[start:stop] if part else parts  # (units, input_dim + 1), the bias last; the compute dtype
        row = ops.cast(x, "float32")  # (B, 1, input_dim)
        if bias is None:
            rows = rows[:, :-1]
        else:
            row = ops.concatenate([row, ops.ones_like(row[..., :1])], axis=-1)  # (B, 1, input_dim + 1)
        rows = ops.cast(rows, "float32")  # converted inside the fused product (see DecodePlan.while_loop)
        return ops.cast(ops.matmul(row, ops.transpose(rows)), x.dtype)  # (B, 1, in [+ 1]) x (in [+ 1], units)

    # === bfloat16 in the graph runtime ===
    def silu(self, x):
        if self.native_bfloat16 and x.dtype == "bfloat16":
            return silu(x)  # oneDNN's bfloat16 SiLU: float32 inside, the casts' numbers in one pass
        return super().silu(x)

    def softmax(self, scores):
        if self.native_bfloat16 and scores.dtype == "bfloat16":
            return ops.softmax(scores, axis=-1)  # oneDNN's: float32 inside, (B, N, T, S) in the scores' dtype
        return super().softmax(scores)

    # === Split caches and one-query steps ===
    def update_cache(self, cache, k, v, cache_index):
        """As `PlainForms.update_cache`; a split cache comes back as a pair `(B*K, S_max, H)` and its keys and values
        as float32 `(B*K, S_max, H)`."""
        if not isinstance(cache, (SplitCache, tuple, list)):
            return super().update_cache(cache, k, v, cache_index)
        cache = (cache.keys, cache.values) if isinstance(cache, SplitCache) else tuple(cache)
        if len(cache) != 2:
            raise ValueError(f"A split cache is a pair (keys, values). Received: {len(cache)} tensors")
        b, heads, t = ops.shape(k)[0], k.shape[1], ops.shape(k)[2]
        cache = tuple(
            write_cache(half, ops.cast(ops.reshape(new, (b * heads, t, -1)), half.dtype), cache_index,
                        self.in_place_cache_writes)
            for half, new in zip(cache, (k, v))  # (B, K, T, H) -> (B*K, T, H) into (B*K, S_max, H)
        )
        # float32 scores and mixing also under mixed precision, as in the stacked one-step form (XLA's CPU dots on
        # bfloat16 convert their operands first anyway).
        k, v = (ops.cast(half, "float32") for half in cache)  # (B*K, S_max, H), (B*K, S_max, Hv)
        return k, v, cache

    def shared_heads(self, x, q, groups):
        # A repeat keeps every form of the scores and mixing as it is; a grouped product reading each key/value head
        # once saves the copy (a TFLite decoder file's `_FileForms` does that).
        if len(x.shape) != 3 or groups == 1:
            return super().shared_heads(x, q, groups)
        batch, heads, s = ops.shape(q)[0], q.shape[1], ops.shape(x)[1]
        x = ops.reshape(x, (batch, heads // groups, s, x.shape[-1]))  # (B*K, S, H) -> (B, K, S, H)
        return ops.reshape(ops.repeat(x, groups, axis=1), (batch * heads, s, x.shape[-1]))  # (B*N, S, H)

    def key_heads(self, k, q):
        if len(k.shape) != 3:
            return k
        # (B*N, S, H) -> (B, N, S, H)
        return ops.reshape(ops.cast(k, q.dtype), (ops.shape(q)[0], q.shape[1], ops.shape(k)[1], q.shape[-1]))

    def dot(self, q, k):
        heads, head_dim = q.shape[1], q.shape[-1]
        if len(k.shape) == 3:
            # A split cache: one batched matmul reading the key buffer in place, also under XLA.
            b, t, s = ops.shape(q)[0], ops.shape(q)[2], ops.shape(k)[1]
            q3 = ops.reshape(ops.cast(q, k.dtype), (b * heads, t, head_dim))  # (B, N, T, H) -> (B*N, T, H)
            return ops.reshape(tf.matmul(q3, k, transpose_b=True), (b, heads, t, s))  # (B*N, T, S) -> (B, N, T, S)
        if not (self.in_place_cache_writes and q.shape[2] == 1 and head_dim is not None and head_dim % 8 == 0):
            return super().dot(q, k)
        # One query against a cache, under XLA: a dot needs the key half of the (B, 2, N, S, H) cache as a buffer of
        # its own, i.e. a copy of all cached keys every step; a multiply + sum fuses and reads the cache in place.
        # Summed over H as (H/8, 8): one reduce, where a sum over one axis of 64 becomes a reduce-window + reduce
        # pair on XLA's CPU backend. float32 products and sums also under mixed precision (converted in registers).
        b, s = ops.shape(k)[0], ops.shape(k)[2]
        q8 = ops.reshape(ops.cast(q, "float32"), (b, heads, 1, head_dim // 8, 8))  # (B, N, 1, H/8, 8)
        k8 = ops.reshape(ops.cast(k, "float32"), (b, heads, s, head_dim // 8, 8))  # (B, N, S, H/8, 8)
        return ops.sum(ops.sum(q8 * k8, axis=3), axis=3)[:, :, None, :]  # (B, N, S) -> (B, N, 1, S)

    def mix(self, weights, v, dtype):
        if len(v.shape) == 3:  # a split cache
            b, t, s = ops.shape(weights)[0], ops.shape(weights)[2], ops.shape(weights)[3]
            heads = weights.shape[1]
            x = ops.reshape(ops.cast(weights, v.dtype), (b * heads, t, s))  # (B*N, T, S)
            x = ops.reshape(ops.matmul(x, v), (b, heads, t, -1))  # (B*N, T, Hv) -> (B, N, T, Hv)
            return ops.cast(x, dtype)
        if self.in_place_cache_writes and weights.shape[2] == 1:
            # One query against a cache, under XLA: XLA's CPU dot for the (B*N) tiny weights-times-values products is
            # a scalar loop; a broadcast multiply + sum over S fuses into one vectorized pass:
            # (B, N, S, 1) * (B, N, S, Hv) -> (B, N, 1, Hv).
            return ops.sum(ops.cast(weights, v.dtype)[:, :, 0, :, None] * v, axis=2)[:, :, None, :]
        return super().mix(weights, v, dtype)
