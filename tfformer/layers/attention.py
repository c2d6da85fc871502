import contextlib
import math

import keras
import tensorflow as tf
from keras import ops
from tensorflow.python.eager import record as _record  # could_possibly_record(): no public equivalent

from tfformer.layers import masks as masks_lib
from tfformer.layers.dropout import Dropout

SCORES = ("scaled_dot", "dot", "general", "additive")


def _check_positive_int(name, value, allow_none=False):
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(
            f"`{name}` must be a positive integer"
            f"{' or None' if allow_none else ''}. Received: {name}={value!r}"
        )


def check_dropout(value, name="dropout"):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"`{name}` must be a float in [0, 1). Received: {name}={value!r}")


_IN_PLACE_CACHE_WRITES = [False]


@contextlib.contextmanager
def in_place_cache_writes():
    """While tracing inside this context, cache writes are in-place dynamic-update-slices.

    For code compiled with XLA (`jit_compile=True`): a decode step then writes
    `T` cache positions instead of rewriting the whole `(B, 2, N, S_max, H)`
    buffer, so its cost does not grow with `S_max`. Outside XLA that op does not
    exist (SavedModel without XLA, TFLite), hence the default select form.
    """
    previous = _IN_PLACE_CACHE_WRITES[0]
    _IN_PLACE_CACHE_WRITES[0] = True
    try:
        yield
    finally:
        _IN_PLACE_CACHE_WRITES[0] = previous


_DECODE_KERNELS = [None]  # (layout, {id(kernel): (parts, id(bias) or None)}) while tracing an XLA decode loop
KERNEL_LAYOUTS = ("rows", "halves")


@contextlib.contextmanager
def decode_kernels(kernels):
    """While tracing inside this context, one-token matmuls use kernels laid out for an XLA decode loop.

    `kernels` is `prepared_kernels(model, layout)`, computed before the loop (XLA
    does not hoist a lone transpose or slice out of a loop, so these stay fused):
    - `"rows"`, for a batch of one: `[x, 1] @ transpose([W^T | b])`. XLA's CPU
      backend fuses a vector times a transposed matrix into one loop that reads each
      output's weights contiguously and runs on both threads, while `x @ W + b` is
      a single-threaded matrix-vector call (~2x slower per step, benchmarks/
      RESULTS.md). The bias rides along as a last column: a separate add would
      take the dot into an output fusion instead. The rows are in the compute dtype
      of the layer that owns the kernel, as its forward pass multiplies them
      (bfloat16 under mixed_bfloat16: half the bytes read a step); the product runs
      in float32, the rows converted inside the fused loop. A decode loop must carry
      non-float32 rows through an optimization barrier (`carry_decode_kernels`):
      XLA would hoist the loop-invariant conversion out of the loop and read a
      float32 copy every step.
    - `"halves"`, for larger batches: `concat([x @ W[:, :u/2], x @ W[:, u/2:]]) + b`,
      two independent dots that XLA's executor runs on both threads (one small
      dot runs on one; ~1.2x faster per step).
    `None` turns it off.
    """
    previous = _DECODE_KERNELS[0]
    _DECODE_KERNELS[0] = kernels
    try:
        yield
    finally:
        _DECODE_KERNELS[0] = previous


def prepared_kernels(model, layout):
    """`(layout, {id(kernel): (parts, id(bias) or None)})` for `decode_kernels`; `layout` in `KERNEL_LAYOUTS`.

    Every float 2-D weight of `model` named `*kernel`; its bias is the weight of the same layer named
    with `bias` for `kernel`. "rows": parts = `[kernel^T | bias]` `(units, input_dim + 1)` (zeros for a
    missing bias) in the compute dtype of the innermost layer holding the kernel; "halves": parts =
    `(kernel[:, :units // 2], kernel[:, units // 2:])`. Quantized (integer) kernels are left out.
    """
    if layout not in KERNEL_LAYOUTS:
        raise ValueError(f"`layout` must be one of {KERNEL_LAYOUTS}. Received: layout={layout!r}")
    by_path = {w.path: w for w in model.weights}
    compute_dtype = {}
    if layout == "rows":
        for layer in model._flatten_layers(include_self=True, recursive=True):  # outer first: the innermost wins
            compute_dtype.update((id(w), layer.compute_dtype) for w in layer.weights)
    kernels = {}
    for w in model.weights:
        if len(w.shape) != 2 or not w.name.endswith("kernel") or not keras.backend.is_float_dtype(w.dtype):
            continue
        bias = by_path.get(w.path[: -len("kernel")] + "bias")
        if layout == "rows":
            dtype = compute_dtype.get(id(w), model.compute_dtype)
            column = ops.zeros((w.shape[1],), dtype) if bias is None else ops.cast(bias, dtype)
            parts = ops.concatenate([ops.transpose(ops.cast(w, dtype)), column[:, None]], axis=1)  # (units, input_dim + 1)
        else:
            half = w.shape[1] // 2
            parts = (tf.identity(w[:, :half]), tf.identity(w[:, half:]))  # (input_dim, units/2), (input_dim, rest)
        kernels[id(w)] = parts, None if bias is None else id(bias)
    return layout, kernels


def carry_decode_kernels(cond, body, loop_vars):
    """`tf.while_loop(cond, body, loop_vars)` that carries the active `decode_kernels`' non-float32 "rows" in its
    state, each step through an XLA optimization barrier (XLA only).

    The rows are loop-invariant, so XLA would hoist their conversion to float32 out of the loop and read a float32
    copy every step; behind the barrier they are loop state, and each step's fused product reads the narrow rows
    and converts them in registers. Anything else is a plain `tf.while_loop`.
    """
    active = _DECODE_KERNELS[0]
    if active is None or active[0] != "rows":
        return tf.while_loop(cond, body, loop_vars)
    layout, table = active
    carried = [key for key, (rows, _) in table.items() if rows.dtype != tf.float32]
    if not carried:
        return tf.while_loop(cond, body, loop_vars)
    from tensorflow.compiler.tf2xla.python import xla  # XLA's OptimizationBarrier: no public TensorFlow name

    def carrying_body(*state):
        *state, rows = state
        rows = list(xla.optimization_barrier(*rows))
        with decode_kernels((layout, {**table, **{key: (r, table[key][1]) for key, r in zip(carried, rows)}})):
            return (*body(*state), rows)

    state = (*loop_vars, [table[key][0] for key in carried])
    return tf.while_loop(lambda *state: cond(*state[:-1]), carrying_body, state)[:-1]


def one_row_step(x):
    """Whether `x` `(B, T, D)` is one token under `decode_kernels` of layout "rows" (a batch-1 decode under XLA)."""
    return _DECODE_KERNELS[0] is not None and _DECODE_KERNELS[0][0] == "rows" and x.shape[1] == 1


def uses_decode_kernels(x, kernel, bias=None):
    """Whether `dense(x, kernel, bias)` uses `decode_kernels`: one token, `kernel` among them, with its own bias."""
    if _DECODE_KERNELS[0] is None or x.shape[1] != 1 or id(kernel) not in _DECODE_KERNELS[0][1]:
        return False
    return bias is None or _DECODE_KERNELS[0][1][id(kernel)][1] == id(bias)


def dense(x, kernel, bias=None, start=0, stop=None):
    """`x @ kernel[:, start:stop] + bias[start:stop]` in `x`'s dtype, `x` `(B, T, input_dim)`.

    A one-token `x` (T == 1) under `decode_kernels` uses the kernel's prepared layout.
    """
    stop = kernel.shape[-1] if stop is None else stop
    part = (start, stop) != (0, kernel.shape[-1])
    layout = uses_decode_kernels(x, kernel, bias) and _DECODE_KERNELS[0][0]
    if layout == "rows":
        rows = _DECODE_KERNELS[0][1][id(kernel)][0]  # (units, input_dim + 1), the bias last; the compute dtype
        rows = rows[start:stop] if part else rows
        row = ops.cast(x, "float32")  # (B, 1, input_dim)
        if bias is None:
            rows = rows[:, :-1]
        else:
            row = ops.concatenate([row, ops.ones_like(row[..., :1])], axis=-1)  # (B, 1, input_dim + 1)
        rows = ops.cast(rows, "float32")  # converted inside the fused product (carry_decode_kernels)
        return ops.cast(ops.matmul(row, ops.transpose(rows)), x.dtype)  # (B, 1, in [+ 1]) x (in [+ 1], units)
    bias = None if bias is None else ops.cast(bias[start:stop] if part else bias, x.dtype)
    if layout == "halves" and not part:
        halves = _DECODE_KERNELS[0][1][id(kernel)][0]
        y = ops.concatenate([ops.matmul(x, ops.cast(h, x.dtype)) for h in halves], axis=-1)  # (B, 1, units)
        return y if bias is None else y + bias
    return _matmul_bias(x, ops.cast(kernel[:, start:stop] if part else kernel, x.dtype), bias)


def _matmul_bias(x, kernel, bias, activation=None):
    """`activation(x (..., D) @ kernel (D, U) + bias)` as a 2-D MatMul, a BiasAdd and the activation.

    On CPU grappler rewrites that chain (not a 3-D matmul and an add) into one
    oneDNN kernel with the bias and a relu/gelu as post-ops in inference
    graphs (benchmarks/RESULTS.md, "Encoder"). Under a gradient tape the pair
    is `_matmul_bias_add`, whose bias gradient is a matmul.
    """
    x, kernel = tf.convert_to_tensor(x), tf.convert_to_tensor(kernel)
    flat = x if x.shape.rank == 2 else tf.reshape(x, [-1, kernel.shape[0]])  # (B*T, D)
    if bias is not None and gradient_recording():
        y = _matmul_bias_add(flat, kernel, tf.convert_to_tensor(bias))  # (B*T, U)
    else:
        y = tf.matmul(flat, kernel)  # (B*T, U)
        if bias is not None:
            y = tf.nn.bias_add(y, bias)
    if activation is not None:
        y = activation(y)
    if x.shape.rank == 2:
        return y
    lead = x.shape[:-1]
    if lead.rank is not None and sum(d is None for d in lead) <= 1:
        shape = [-1 if d is None else d for d in lead] + [kernel.shape[1]]  # a constant: no shape ops in the graph
    else:
        shape = tf.concat([tf.shape(x)[:-1], tf.shape(kernel)[1:]], axis=0)
    return tf.reshape(y, shape)  # (B, T, U)


def gradient_recording():
    """Whether a `tf.GradientTape` could record the ops built now (a training step, not inference or export).

    Hand-written gradients (`tf.custom_gradient`) are used only then: in inference graphs their
    IdentityN ops would sit between ops that grappler fuses (MatMul, BiasAdd, activation).
    """
    return bool(getattr(_record, "could_possibly_record", lambda: False)())


@tf.custom_gradient
def _matmul_bias_add(x, kernel, bias):
    """`x (M, D) @ kernel (D, U) + bias (U,)` whose bias gradient is a `(1, M) @ (M, U)` matmul.

    TF's BiasAddGrad (a column reduction) takes up to 3x as long as that matmul in bfloat16 and up to
    2x in float32 on a 2-core CPU (benchmarks/RESULTS.md, "Training: where the time goes").
    """
    y = tf.nn.bias_add(tf.matmul(x, kernel), bias)  # (M, U)

    def grad(dy):
        dx = tf.matmul(dy, kernel, transpose_b=True)  # (M, D)
        dkernel = tf.matmul(x, dy, transpose_a=True)  # (D, U)
        dbias = tf.matmul(tf.ones([1, tf.shape(dy)[0]], dy.dtype), dy)  # (1, U)
        return dx, dkernel, tf.reshape(dbias, [-1])

    return y, grad


def quantized(layer):
    """A Dense quantized by `keras.Layer.quantize` (int8/float8 kernels with scales): only its own call is right."""
    return getattr(layer, "quantization_mode", None) is not None


def apply_dense(layer, x):
    """`layer(x)` for a `keras.layers.Dense`, through `dense` (and so `decode_kernels`) for one token."""
    if quantized(layer) or not uses_decode_kernels(x, layer.kernel, layer.bias):
        return layer(x)
    return layer.activation(dense(ops.cast(x, layer.compute_dtype), layer.kernel, layer.bias))


def _write_cache(cache, new, index):
    """`cache` with `new` written at positions `index .. index+T-1` along its slot axis (the second to last).

    `cache` is a stacked `(B, 2, N, S, H)` cache with `new` `(B, 2, N, T, H)`, or one half
    `(B*N, S, H)` of a split cache with `new` `(B*N, T, H)`. By default a gather + select with
    static shapes, instead of `ops.slice_update`: on TensorFlow that is XlaDynamicUpdateSlice,
    which needs XLA at run time (not in every TF Serving build) and has no TFLite builtin, while a
    dynamic pad would break XLA compilation. This form runs in all three; under
    `in_place_cache_writes()` (XLA only) the slice update is used.
    """
    axis = len(cache.shape) - 2
    if _IN_PLACE_CACHE_WRITES[0]:
        zero = ops.zeros((), "int32")
        start = [zero] * len(cache.shape)
        start[axis] = ops.cast(index, "int32")
        return ops.slice_update(cache, start, new)
    size, length = ops.shape(cache)[axis], ops.shape(new)[axis]
    offset = ops.arange(size) - index  # slot s takes new[s - index]
    written = ops.logical_and(offset >= 0, offset < length)
    spread = ops.take(new, ops.clip(offset, 0, length - 1), axis=axis)  # the shape of `cache`
    return ops.where(ops.reshape(written, (size, 1)), spread, cache)


def split_cache(cache):
    """A stacked cache `(B, 2, N, S, H)` as a split cache: `(keys, values)`, each `(B*N, S, H)`.

    Same contents, for decode loops: the attention then reads each half as a buffer of its own
    with a batched matmul. A half sliced from the stacked buffer is not one, and XLA copies
    every cached key and value before each step's matmul (benchmarks/RESULTS.md).
    """
    b, _, n, s, h = ops.shape(cache)
    return tuple(ops.reshape(cache[:, i], (b * n, s, h)) for i in range(2))  # 2 x (B*N, S, H)


class SplitCache:
    """A split cache `(keys, values)` (`split_cache`) as one object, which Keras hands to a layer's call as it is.

    Keras casts every float tensor among a layer call's arguments, tuples included, to the layer's compute
    dtype. A float32 split cache of a mixed_bfloat16 model would be cast to bfloat16 at every block and attention
    call, a copy of every cached key and value each decode step, and back to float32 for the attention's products
    (benchmarks/RESULTS.md, "Decoding"). `MultiHeadAttention` and `DecoderBlock` take it where they take a pair and
    return a plain pair.
    """

    __slots__ = ("keys", "values")

    def __init__(self, keys, values):
        self.keys, self.values = keys, values


def uncast(cache):
    """`cache` for a layer call: a split pair as a `SplitCache` (kept in its dtype), anything else as it is."""
    return SplitCache(*cache) if isinstance(cache, (tuple, list)) and len(cache) == 2 else cache


@keras.saving.register_keras_serializable(package="tfformer")
class MultiHeadAttention(keras.layers.Layer):
    """Multi-head attention (Vaswani et al., 2017), with a key/value cache.

    Projects the query, key and value into `num_heads` heads, computes the
    attention weights `softmax(score(q, k))` per head, takes the weighted sum of
    the values, concatenates the heads and projects back with `W_O`:
    `MultiHead(Q, K, V) = Concat(head_1..head_h) W_O`.

    When query, key and value inputs have the same width the three projections
    live in one fused kernel `(D, N*(2*key_dim + value_dim))`: self-attention
    does a single matmul, cross-attention slices it.

    Score functions (`score=`): `"scaled_dot"` q.k/sqrt(key_dim) (the paper),
    `"dot"` q.k, `"general"` q^T W k (one `W` per head), and `"additive"`
    w^T tanh(W_q q + W_k k) (the projections play W_q, W_k; one `w` per head).

    Masking: every mask is boolean with True = may attend. `attention_mask`
    `(B, T, S)`, `use_causal_mask`, the restricted window and Keras' implicit
    masks (`query_mask` `(B, T)`, `value_mask`/`key_mask` `(B, S)`, filled in
    by Keras from `Embedding(mask_zero=True)` and friends) are ANDed. The
    softmax runs in float32 with a finite mask value; a query that sees no key
    gets all-zero weights, so its output is the output bias, never NaN.

    Args:
        num_heads: int. Number of heads `N`.
        key_dim: int. Width `H` of each query/key head.
        value_dim: int. Width of each value head. Defaults to `key_dim`.
        dropout: float. Dropout on the attention weights. Defaults to `0.0`.
        use_bias: bool. Whether projections have biases. Defaults to `True`.
        output_dim: int. Width of the output. Defaults to the query width.
        score: str. One of `"scaled_dot"`, `"dot"`, `"general"`, `"additive"`.
        window: int. If set, query `i` only sees keys `j` with `|i - j| <= window`
            (restricted self-attention). Defaults to `None` (no restriction).
        kernel_initializer: initializer for the projection kernels.
        bias_initializer: initializer for the projection biases.
        **kwargs: Base layer arguments (`name`, `dtype`, `trainable`).

    Call arguments:
        query: `(B, T, Dq)`.
        value: `(B, S, Dv)`.
        key: optional `(B, S, Dk)`; defaults to `value`.
        attention_mask: optional bool `(B, T, S)`.
        use_causal_mask: bool. Query `i` (at absolute position
            `cache_index + i` when decoding with a cache) sees keys `j <= i`.
        return_attention_scores: bool. Also return the weights `(B, N, T, S)`.
        cache: optional `(B, 2, N, S_max, H)` keys (index 0) and values
            (index 1). With `cache_index`, the new keys/values of `key`/`value`
            are written at `cache_index` and attention runs over the whole
            cache; positions `>= cache_index + T` are masked. Without
            `cache_index` the cache is read as precomputed keys/values (e.g.
            cross-attention over a fixed encoder output) and `value` is ignored.
            Implicit `value_mask`/`key_mask` are ignored when a cache is used;
            pass padding through `attention_mask`. With `cache_index`, the
            cache may also be split (`split_cache`): a pair `(keys, values)`,
            each `(B*N, S_max, H)`, or the same as a `SplitCache` (which Keras
            does not cast to the compute dtype), returned as a pair (faster in
            XLA decode loops).
        cache_index: int scalar, where the `T` new positions start.
        training: bool, enables dropout.

    Returns:
        `outputs` `(B, T, output_dim)`; `(outputs, scores)` with
        `return_attention_scores`; `(outputs, cache)` when `cache` is given;
        `(outputs, scores, cache)` with both.

    Example:
    ```python
    layer = tfformer.layers.MultiHeadAttention(num_heads=2, key_dim=4)
    x = np.random.rand(1, 5, 8).astype("float32")
    y = layer(x, x, use_causal_mask=True)  # (1, 5, 8)
    ```

    Reference:
        Vaswani et al., "Attention Is All You Need", 2017; Luong et al., 2015
        (general score); Bahdanau et al., 2015 (additive score).
    """

    def __init__(
        self,
        num_heads,
        key_dim,
        value_dim=None,
        dropout=0.0,
        use_bias=True,
        output_dim=None,
        score="scaled_dot",
        window=None,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        **kwargs,
    ):
        _check_positive_int("num_heads", num_heads)
        _check_positive_int("key_dim", key_dim)
        _check_positive_int("value_dim", value_dim, allow_none=True)
        _check_positive_int("output_dim", output_dim, allow_none=True)
        check_dropout(dropout)
        if score not in SCORES:
            raise ValueError(f"`score` must be one of {SCORES}. Received: score={score!r}")
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 0):
            raise ValueError(f"`window` must be a non-negative integer or None. Received: window={window!r}")
        super().__init__(**kwargs)
        self.num_heads = num_heads
        self.key_dim = key_dim
        self.value_dim = value_dim
        self.dropout = dropout
        self.use_bias = use_bias
        self.output_dim = output_dim
        self.score = score
        self.window = window
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.supports_masking = True
        self._dropout_layer = Dropout(dropout)

    @property
    def _value_dim(self):
        return self.value_dim or self.key_dim

    def _check_cacheable(self):
        # Keys and values share one cache tensor (B, 2, N, S, H).
        if self._value_dim != self.key_dim:
            raise ValueError(f"A cache needs value_dim == key_dim. Received: key_dim={self.key_dim}, value_dim={self.value_dim}")

    def _kernel(self, name, input_dim, units):
        kernel = self.add_weight(name=f"{name}_kernel", shape=(input_dim, units), initializer=self.kernel_initializer)
        bias = self.add_weight(name=f"{name}_bias", shape=(units,), initializer=self.bias_initializer) if self.use_bias else None
        return kernel, bias

    def build(self, query_shape, value_shape, key_shape=None):
        query_dim, value_dim = query_shape[-1], value_shape[-1]
        key_dim = value_dim if key_shape is None else key_shape[-1]
        n, h, hv = self.num_heads, self.key_dim, self._value_dim
        self._q_units, self._k_units, self._v_units = n * h, n * h, n * hv
        self._fused = query_dim == value_dim == key_dim
        if self._fused:
            self.qkv_kernel, self.qkv_bias = self._kernel("qkv", query_dim, 2 * n * h + n * hv)
        else:
            self.query_kernel, self.query_bias = self._kernel("query", query_dim, n * h)
            self.key_kernel, self.key_bias = self._kernel("key", key_dim, n * h)
            self.value_kernel, self.value_bias = self._kernel("value", value_dim, n * hv)
        if self.score == "general":
            self.general_kernel = self.add_weight(name="general_kernel", shape=(n, h, h), initializer=self.kernel_initializer)
        elif self.score == "additive":
            self.additive_vector = self.add_weight(name="additive_vector", shape=(n, 1, h), initializer=self.kernel_initializer)
        self.output_kernel, self.output_bias = self._kernel("output", n * hv, self.output_dim or query_dim)
        self.built = True

    # === Projections ===
    def _split_heads(self, x, head_dim):
        b, t = ops.shape(x)[0], ops.shape(x)[1]
        x = ops.reshape(x, (b, t, self.num_heads, head_dim))  # (B, T, N, H)
        return ops.transpose(x, (0, 2, 1, 3))  # (B, N, T, H)

    def _split_stacked_heads(self, x, parts):
        """`(B, T, parts * N * H)` -> `parts` tensors `(B, N, T, H)` with one transpose.

        A split of the last axis copies every part before its own transpose; TF's Unpack along
        the leading axis shares the transposed buffer when each part's byte size is a multiple
        of 64 (else it copies once).
        """
        b, t = ops.shape(x)[0], ops.shape(x)[1]
        x = ops.reshape(x, (b, t, parts, self.num_heads, self.key_dim))  # (B, T, parts, N, H)
        x = ops.transpose(x, (2, 0, 3, 1, 4))  # (parts, B, N, T, H)
        return tf.unstack(x, num=parts, axis=0)  # parts x (B, N, T, H)

    def _project_query(self, query):
        if self._fused:
            return dense(query, self.qkv_kernel, self.qkv_bias, 0, self._q_units)
        return dense(query, self.query_kernel, self.query_bias, 0, self._q_units)

    def _project(self, query, value, key):
        """Returns q `(B, N, T, H)`, k `(B, N, S, H)`, v `(B, N, S, Hv)`."""
        qu, ku, vu = self._q_units, self._k_units, self._v_units
        if self._fused and value is query and (key is None or key is query):
            qkv = dense(query, self.qkv_kernel, self.qkv_bias, 0, qu + ku + vu)  # (B, T, N*(2H+Hv))
            if vu == qu:
                return tuple(self._split_stacked_heads(qkv, 3))
            # A split, not three slices: its gradient is one concat, a slice's is a zero-filled copy each.
            q, k, v = ops.split(qkv, [qu, qu + ku], axis=-1)
        elif self._fused and (key is None or key is value):
            if gradient_recording():
                # Training: the fused kernel split once into its q and k/v columns. The gradient of a split is
                # one concat; that of two slices is a zero-filled StridedSliceGrad each and their sum.
                kernel_q, kernel_kv = tf.split(self.qkv_kernel, [qu, ku + vu], axis=1)  # (D, N*H), (D, N*(H+Hv))
                bias_q, bias_kv = (None, None) if self.qkv_bias is None else tf.split(self.qkv_bias, [qu, ku + vu])
                q = dense(query, kernel_q, bias_q)  # (B, T, N*H)
                kv = dense(value, kernel_kv, bias_kv)  # (B, S, N*(H+Hv))
            else:
                q = self._project_query(query)
                kv = dense(value, self.qkv_kernel, self.qkv_bias, qu, qu + ku + vu)  # (B, S, N*(H+Hv))
            if vu == ku:
                k, v = self._split_stacked_heads(kv, 2)
                return self._split_heads(q, self.key_dim), k, v
            k, v = ops.split(kv, [ku], axis=-1)
        elif self._fused:
            q = self._project_query(query)
            k = dense(key, self.qkv_kernel, self.qkv_bias, qu, qu + ku)
            v = dense(value, self.qkv_kernel, self.qkv_bias, qu + ku, qu + ku + vu)
        else:
            q = self._project_query(query)
            k = dense(value if key is None else key, self.key_kernel, self.key_bias, 0, ku)
            v = dense(value, self.value_kernel, self.value_bias, 0, vu)
        return (
            self._split_heads(q, self.key_dim),
            self._split_heads(k, self.key_dim),
            self._split_heads(v, self._value_dim),
        )

    def compute_cache(self, value, key=None):
        """Keys/values of a fixed memory as a read-only cache `(B, 2, N, S, H)`.

        Used for cross-attention during decoding: the encoder output is
        projected once instead of at every step.
        """
        self._check_cacheable()
        dummy_query = value[:, :1]
        _, k, v = self._project(dummy_query, value, key)
        return ops.stack([k, v], axis=1)  # (B, 2, N, S, H)

    # === Scores ===
    def _scores(self, q, k, one_query=False):
        # q (B, N, T, H), k (B, N, S, H) or, from a split cache, (B*N, S, H) -> (B, N, T, S)
        if len(k.shape) == 3 and self.score == "additive":
            k = ops.reshape(ops.cast(k, q.dtype), (ops.shape(q)[0], self.num_heads, ops.shape(k)[1], self.key_dim))  # (B*N, S, H) -> (B, N, S, H)
        if self.score == "additive":
            w = ops.cast(self.additive_vector, q.dtype)[None, :, :, None, :]  # (1, N, 1, 1, H)
            hidden = ops.tanh(ops.expand_dims(q, 3) + ops.expand_dims(k, 2))  # (B, N, T, S, H)
            return ops.sum(hidden * w, axis=-1)
        # Dot-product scores are (q W) . k: W = I (dot, and scaled_dot before its 1/sqrt(H)), one W per head (general).
        if self.score == "general":
            q = ops.matmul(q, ops.cast(self.general_kernel, q.dtype))  # (B, N, T, H)
        head_dim = q.shape[-1]
        if len(k.shape) == 3:
            # A split cache: one batched matmul reading the key buffer in place, also under XLA.
            b, t, s = ops.shape(q)[0], ops.shape(q)[2], ops.shape(k)[1]
            q3 = ops.reshape(ops.cast(q, k.dtype), (b * self.num_heads, t, head_dim))  # (B, N, T, H) -> (B*N, T, H)
            return ops.reshape(tf.matmul(q3, k, transpose_b=True), (b, self.num_heads, t, s))  # (B*N, T, S) -> (B, N, T, S)
        if one_query and head_dim is not None and head_dim % 8 == 0:
            # One query against a cache, under XLA: a dot needs the key half of the (B, 2, N, S, H) cache as a
            # buffer of its own, i.e. a copy of all cached keys every step; a multiply + sum fuses and reads the
            # cache in place. Summed over H as (H/8, 8): one reduce, where a sum over one axis of 64 becomes a
            # reduce-window + reduce pair on XLA's CPU backend (benchmarks/RESULTS.md). float32 products and
            # sums also under mixed precision (the fusion converts in registers).
            b, n, s = ops.shape(k)[0], ops.shape(k)[1], ops.shape(k)[2]
            q8 = ops.reshape(ops.cast(q, "float32"), (b, n, 1, head_dim // 8, 8))  # (B, N, 1, H/8, 8)
            k8 = ops.reshape(ops.cast(k, "float32"), (b, n, s, head_dim // 8, 8))  # (B, N, S, H/8, 8)
            return ops.sum(ops.sum(q8 * k8, axis=3), axis=3)[:, :, None, :]  # (B, N, S) -> (B, N, 1, S)
        # transpose_b, not a transposed copy of k: under XLA a transpose of the cache is a copy every step.
        return tf.matmul(q, k, transpose_b=True)  # (B, N, T, H) x (B, N, S, H)^T -> (B, N, T, S)

    def call(
        self,
        query,
        value,
        key=None,
        query_mask=None,
        value_mask=None,
        key_mask=None,
        attention_mask=None,
        use_causal_mask=False,
        return_attention_scores=False,
        cache=None,
        cache_index=None,
        training=None,
    ):
        query_length = ops.shape(query)[1]
        if isinstance(cache, SplitCache):
            cache = (cache.keys, cache.values)
        split = isinstance(cache, (tuple, list))
        if split and (cache_index is None or len(cache) != 2):
            raise ValueError(
                "A split cache is a pair (keys, values) and needs `cache_index`. "
                f"Received: {len(cache)} tensors, cache_index={cache_index!r}"
            )
        if cache is not None and cache_index is None:
            # Read-only cache: precomputed keys/values of a fixed memory.
            q = self._split_heads(self._project_query(query), self.key_dim)
            k, v = ops.cast(cache[:, 0], q.dtype), ops.cast(cache[:, 1], q.dtype)
        else:
            q, k, v = self._project(query, value, key)
        if cache is not None and cache_index is not None:
            self._check_cacheable()
        if split:
            b, t = ops.shape(k)[0], ops.shape(k)[2]
            cache = tuple(
                _write_cache(half, ops.cast(ops.reshape(new, (b * self.num_heads, t, -1)), half.dtype), cache_index)
                for half, new in zip(cache, (k, v))  # (B, N, T, H) -> (B*N, T, H) into (B*N, S_max, H)
            )
            # float32 scores and mixing also under mixed precision, as in the stacked one-step form below (XLA's
            # CPU dots on bfloat16 convert their operands first anyway).
            k, v = (ops.cast(half, "float32") for half in cache)  # (B*N, S_max, H), (B*N, S_max, Hv)
        elif cache is not None and cache_index is not None:
            cache = _write_cache(cache, ops.cast(ops.stack([k, v], axis=1), cache.dtype), cache_index)  # (B, 2, N, S_max, H)
            k, v = ops.cast(cache[:, 0], q.dtype), ops.cast(cache[:, 1], q.dtype)
        key_length = ops.shape(k)[-2]
        offset = 0 if cache_index is None else cache_index

        mask = masks_lib.merge_masks(
            attention_mask,
            masks_lib.query_mask(query_mask),
            None if cache is not None else masks_lib.key_mask(value_mask),
            None if cache is not None else masks_lib.key_mask(key_mask),
            masks_lib.causal_mask(query_length, key_length, offset) if use_causal_mask else None,
            masks_lib.window_mask(query_length, key_length, self.window, offset) if self.window is not None else None,
            # Cache slots past the ones written so far hold no keys yet (implied by the causal mask).
            masks_lib.causal_mask(1, key_length, offset + query_length - 1)
            if cache_index is not None and not use_causal_mask
            else None,
        )
        mask = None if mask is None else ops.expand_dims(mask, 1)  # (B|1, 1, T, S)
        # One query against a cache, under XLA (a decode step): see _scores and the value mixing below.
        one_step = _IN_PLACE_CACHE_WRITES[0] and cache is not None and not split and query.shape[1] == 1
        scores = self._scores(q, k, one_query=one_step)  # (B, N, T, S)
        # Dot-product scores take their scale and mask after the matmul: BatchMatMul + Mul + Add is one
        # oneDNN kernel on CPU, instead of a matmul, a float32 select and a scaled copy of q.
        dot_scores = self.score != "additive"
        if self.score == "scaled_dot":
            scores = scores * ops.cast(1.0 / math.sqrt(self.key_dim), scores.dtype)
        if dot_scores and mask is not None:
            scores = scores + masks_lib.mask_bias(mask, scores.dtype)
        # A query that sees no key is zeroed after the mixing, on (B, N, T, Hv), not on the larger weights.
        weights = masks_lib.masked_softmax(scores, None if dot_scores else mask, zero_empty_rows=False)  # (B, N, T, S) float32
        dropped = self._dropout_layer(weights, training=training)
        # One query against a cache, under XLA: XLA's CPU dot for the (B*N) tiny weights-times-values
        # products is a scalar loop; a broadcast multiply + sum over S fuses into one vectorized pass.
        if one_step:
            x = ops.sum(ops.cast(dropped, v.dtype)[:, :, 0, :, None] * v, axis=2)[:, :, None, :]  # (B, N, S, 1) * (B, N, S, Hv) -> (B, N, 1, Hv)
        elif split:
            b = ops.shape(dropped)[0]
            x = ops.reshape(ops.cast(dropped, v.dtype), (b * self.num_heads, query_length, key_length))  # (B*N, T, S)
            x = ops.reshape(ops.matmul(x, v), (b, self.num_heads, query_length, -1))  # (B*N, T, Hv) -> (B, N, T, Hv)
            x = ops.cast(x, q.dtype)
        else:
            x = ops.matmul(ops.cast(dropped, v.dtype), v)  # (B, N, T, Hv)
        if mask is not None:
            row_has_key = masks_lib.has_visible_key(mask)  # (B|1, 1, T, 1)
            x = x * ops.cast(row_has_key, x.dtype)
            if return_attention_scores:
                weights = weights * ops.cast(row_has_key, weights.dtype)
        x = ops.transpose(x, (0, 2, 1, 3))  # (B, T, N, Hv)
        x = ops.reshape(x, (ops.shape(x)[0], query_length, self._v_units))  # (B, T, N*Hv)
        outputs = dense(x, self.output_kernel, self.output_bias, 0, self.output_kernel.shape[-1])

        result = (outputs,)
        if return_attention_scores:
            result += (weights,)
        if cache is not None:
            result += (cache,)
        return result[0] if len(result) == 1 else result

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_heads": self.num_heads,
                "key_dim": self.key_dim,
                "value_dim": self.value_dim,
                "dropout": self.dropout,
                "use_bias": self.use_bias,
                "output_dim": self.output_dim,
                "score": self.score,
                "window": self.window,
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
                "bias_initializer": keras.initializers.serialize(self.bias_initializer),
            }
        )
        return config
