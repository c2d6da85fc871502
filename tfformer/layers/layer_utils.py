"""Helpers shared by tfformer's layers: argument checks, the matmul + bias they all use, key/value caches, and
`PLAIN`, the default decode plan.

Decode plans. Layers that run inside a decode loop (`MultiHeadAttention`, the feed-forwards, `TokenEmbedding`'s
`attend`) take a `plan` call argument and compute each step through it: `plan.dense(...)`, `plan.update_cache(...)`,
`plan.dot(...)`, ... (`PlainForms` lists them). None means `PLAIN`, whose forms are the plain ones, the same in
training, SavedModel and TFLite. `decode_forms.DecodeForms` overrides them with the fast forms of a compiled decode
loop, and `tfformer.generation.DecodePlan` (which layers never import) adds the loop's own choices to those.
"""

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from tfformer.checks import check_int, check_number
from tfformer.compat import collection_paused, gradient_recording
from tfformer.layers.masks import masked_softmax, static_shape


def check_dropout(value, name="dropout"):
    """Raise a ValueError naming `name` unless `value` is a float in [0, 1)."""
    check_number(name, value, at_least=0, below=1, expected="a float in [0, 1)")


def clone_initializer(initializer):
    """A copy of `initializer` for one weight (keras-hub's `clone_initializer`; Keras' MultiHeadAttention clones
    its initializers too). Keras 3's random initializers draw the same values at every call, so one instance shared
    by several weights starts them equal, or as copies of each other's first values. The copy of an unseeded
    initializer draws a seed of its own (from Keras' seed, so `keras.utils.set_random_seed` still repeats a model);
    a seeded one's draws the same values, as in Keras. A plain callable is returned as it is."""
    if not isinstance(initializer, keras.initializers.Initializer):
        return initializer
    return initializer.__class__.from_config(initializer.get_config())


def add_weight(layer, name, shape, initializer, **kwargs):
    """`layer.add_weight` drawing from a copy of `initializer` of its own (`clone_initializer`)."""
    return layer.add_weight(name=name, shape=shape, initializer=clone_initializer(initializer), **kwargs)


def add_kernel(layer, name, input_dim, units):
    """`(kernel (input_dim, units), bias (units,) or None)` named `{name}_kernel`, `{name}_bias`, of a layer with
    `kernel_initializer`, `bias_initializer` and `use_bias`; the kernel is made first (weights load in that order)."""
    kernel = add_weight(layer, f"{name}_kernel", (input_dim, units), layer.kernel_initializer)
    return kernel, add_weight(layer, f"{name}_bias", (units,), layer.bias_initializer) if layer.use_bias else None


def check_sequences(**tensors):
    """Raise a ValueError naming the argument unless each tensor given (None passes) is `(B, T, D)`."""
    for name, x in tensors.items():
        shape = static_shape(x)  # None: nothing to check
        if shape is not None and len(shape) != 3:
            raise ValueError(f"`{name}` must be a batch of sequences (B, T, D), 3-D. Received: shape={shape}")


def silu(x):
    """`x * sigmoid(x)`: what `tf.nn.silu` (`keras.ops.silu`) computes, without its `tf.custom_gradient`. In a
    graph, a custom gradient registers its gradient function for the life of the process, and with it the graph
    and the variables it captured: every model built with `ops.silu` (Keras traces a functional model's layers in
    graphs) kept its weights after it was deleted. SmolLM2-135M with oneDNN off (whose allocator gives nothing
    back): RSS 1,573 MB loaded, 1,362 after `del`, against 906 with this form. Autodiff of the product gives the
    same gradient."""
    return x * ops.sigmoid(x)


def dense(x, kernel, bias=None, start=0, stop=None):
    """`x @ kernel[:, start:stop] + bias[start:stop]` in `x`'s dtype, `x` `(B, T, input_dim)`."""
    stop = kernel.shape[-1] if stop is None else stop
    part = (start, stop) != (0, kernel.shape[-1])
    bias = None if bias is None else ops.cast(bias[start:stop] if part else bias, x.dtype)
    return matmul_bias(x, ops.cast(kernel[:, start:stop] if part else kernel, x.dtype), bias)


def matmul_bias(x, kernel, bias, activation=None):
    """`activation(x (..., D) @ kernel (D, U) + bias)` as a 2-D MatMul, a BiasAdd and the activation.

    On CPU grappler rewrites that chain (not a 3-D matmul and an add) into one
    oneDNN kernel with the bias and a relu/gelu as post-ops in inference
    graphs (docs/performance.md). Under a gradient tape the pair is
    `matmul_bias_add`, whose bias gradient is a matmul.
    """
    x, kernel = tf.convert_to_tensor(x), tf.convert_to_tensor(kernel)
    flat = x if x.shape.rank == 2 else tf.reshape(x, [-1, kernel.shape[0]])  # (B*T, D)
    if bias is not None and gradient_recording():
        y = matmul_bias_add(flat, kernel, tf.convert_to_tensor(bias))  # (B*T, U)
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


@tf.custom_gradient
def matmul_bias_add(x, kernel, bias):
    """`x (M, D) @ kernel (D, U) + bias (U,)` whose bias gradient is a `(1, M) @ (M, U)` matmul.

    Hand-written because TF's BiasAddGrad (a column reduction) is several times slower than that matmul on
    CPU (docs/performance.md). Built only under a tape (`compat.gradient_recording`): in inference graphs the
    IdentityN ops of a custom gradient would sit between ops that grappler fuses.
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


def apply_dense(layer, x, plan=None):
    """`layer(x)` for a `keras.layers.Dense`, or `plan.dense` on the kernel the plan laid out for it (`uses`)."""
    plan = plan or PLAIN
    if quantized(layer) or not plan.uses(x, layer.kernel, layer.bias):
        return layer(x)
    return layer.activation(plan.dense(ops.cast(x, layer.compute_dtype), layer.kernel, layer.bias))


def write_cache(cache, new, index, in_place=False):
    """`cache` with `new` written at positions `index .. index+T-1` along its slot axis (the second to last).

    `cache` is a stacked `(B, 2, N, S, H)` cache with `new` `(B, 2, N, T, H)`, or one half
    `(B*N, S, H)` of a split cache with `new` `(B*N, T, H)`. By default a gather + select with
    static shapes, instead of `ops.slice_update`: on TensorFlow that is XlaDynamicUpdateSlice,
    which needs XLA at run time (not in every TF Serving build), while a dynamic pad would break
    XLA compilation. This form runs everywhere; with `in_place` (code compiled with XLA, and TFLite
    files, whose converter makes it DYNAMIC_UPDATE_SLICE) the slice update is used, so a step's
    cost does not grow with `S`.
    """
    axis = len(cache.shape) - 2
    slots, length = cache.shape[axis], new.shape[axis]
    if isinstance(index, (int, np.integer)) and None not in (slots, length) and not 0 <= index <= slots - length:
        raise ValueError(f"The {length} new position(s) from `cache_index` must fit the cache's {slots} slots "
                         f"(positions 0 to {slots - 1}). Received: cache_index={index}")
    if isinstance(index, int) and index == 0 and not in_place:
        # A prompt pass from slot 0 (a Python 0): the new slots, then the cache's own past them.
        rest = cache[(slice(None),) * axis + (slice(ops.shape(new)[axis], None),)]  # (..., S - T, H)
        return ops.concatenate([new, rest], axis=axis)
    if in_place:
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
    every cached key and value before each step's matmul (docs/performance.md).
    """
    b, _, n, s, h = ops.shape(cache)
    return tuple(ops.reshape(cache[:, i], (b * n, s, h)) for i in range(2))  # 2 x (B*N, S, H)


class SplitCache:
    """A split cache `(keys, values)` (`split_cache`) as one object, which Keras hands to a layer's call as it is.

    Keras casts every float tensor among a layer call's arguments, tuples included, to the layer's compute
    dtype. A float32 split cache of a mixed_bfloat16 model would be cast to bfloat16 at every block and attention
    call, a copy of every cached key and value each decode step, and back to float32 for the attention's products
    (docs/performance.md). `MultiHeadAttention` and `DecoderBlock` take it where they take a pair and
    return a plain pair.
    """

    __slots__ = ("keys", "values")

    def __init__(self, keys, values):
        self.keys, self.values = keys, values


def uncast(cache):
    """`cache` for a layer call: a split pair as a `SplitCache` (kept in its dtype), anything else as it is."""
    return SplitCache(*cache) if isinstance(cache, (tuple, list)) and len(cache) == 2 else cache


def check_stacked(cache, cache_index):
    """Raise a ValueError unless `cache` is a stacked cache tensor (a split one needs a decode plan)."""
    if isinstance(cache, (SplitCache, tuple, list)):
        size = 2 if isinstance(cache, SplitCache) else len(cache)
        raise ValueError("A split cache is a pair (keys, values) of a decode step: it needs `cache_index` and a "
                         f"decode plan (`tfformer.generation.DecodePlan`). Received: {size} tensors, "
                         f"cache_index={cache_index!r}")


def in_query_chunks(attend, q, mask, query_chunk_size, *args):
    """`attend(q, mask, *args) -> (x (B, N, T, Hv), weights (B, N, T, S) or None)` over `query_chunk_size` queries
    at a time, the parts joined along T: the same numbers, with `(B, N, query_chunk_size, S)` scores and weights in
    memory at once instead of `(B, N, T, S)`: glibc maps a temporary over its mmap limit (at most 32 MB) afresh at
    each call, and every page of it faults in; smaller ones it reuses (`models.whisper.ENCODER_QUERY_CHUNK`).
    `q` `(B, N, T, H)`, `mask` `(B|1, 1, T|1, S)` or None. One piece when `query_chunk_size` is None or >= T, or T
    is unknown when traced."""
    length = q.shape[2]
    check_int("query_chunk_size", query_chunk_size, allow_none=True)
    if query_chunk_size is None or length is None or length <= query_chunk_size:
        return attend(q, mask, *args)
    parts = [attend(q[:, :, start:start + query_chunk_size],  # (B, N, C, H)
                    mask if mask is None or mask.shape[2] == 1 else mask[:, :, start:start + query_chunk_size], *args)
             for start in range(0, length, query_chunk_size)]
    x = ops.concatenate([x for x, _ in parts], axis=2)  # (B, N, T, Hv)
    return x, None if parts[0][1] is None else ops.concatenate([weights for _, weights in parts], axis=2)


class PlainForms:
    """The forms of a layer's computation that a decode plan may replace, each in its plain form (`PLAIN`).

    Layers call them on the `plan` they are given; `decode_forms.DecodeForms` overrides them.
    """

    in_place_cache_writes = False  # `write_cache`'s form

    def dense(self, x, kernel, bias=None, start=0, stop=None):
        """`x @ kernel[:, start:stop] + bias[start:stop]` in `x`'s dtype (`dense`)."""
        return dense(x, kernel, bias, start, stop)

    def uses(self, x, kernel, bias=None):
        """Whether `dense(x, kernel, bias)` reads a kernel laid out for a decode loop."""
        return False

    def lookup(self, table, ids):
        """The rows `(B, T, D)` of a token embedding `table` `(V, D)` at int32 `ids` `(B, T)`."""
        return ops.take(table, ids, axis=0)

    def logits(self, x, table):
        """The float32 logits `x @ table^T` `(B, T, V)` of hidden states `x` `(B, T, D)`, a tied `table` `(V, D)`."""
        kernel = ops.cast(table, x.dtype)
        return ops.cast(ops.matmul(x, ops.transpose(kernel)), "float32")

    def shared_mask(self, key, compute):
        """The attention mask that `compute()` makes, `(B|1, 1, T, S)` bool or None. A plan whose layers attend with
        the same masks (a bundle's step: one query length, position and cache size, no padding) makes it once per
        `key`: `(use_causal_mask, window)`, what else it depends on."""
        return compute()

    def one_row(self, x):
        """Whether `x` `(B, T, D)` is one token of a batch-1 decode loop on laid-out kernels."""
        return False

    def silu(self, x):
        """SiLU in float32, in `x`'s dtype: exp/sigmoid on bfloat16 convert on CPU anyway, and lose precision."""
        return ops.cast(silu(ops.cast(x, "float32")), x.dtype)

    def softmax(self, scores):
        """The attention weights `(B, N, T, S)` float32 of dot-product scores that carry their mask."""
        return masked_softmax(scores, zero_empty_rows=False)

    def read_cache(self, cache, dtype):
        """The keys and values `(B, K, S, H)` in `dtype` of a read-only cache `(B, 2, K, S, H)`, or of its halves
        `(B, K, S, H)` as a `SplitCache` (read as they are: no slice copied at each step of a loop). A split
        self-attention cache, halves `(B*K, S, H)`, needs `cache_index`: an error here."""
        if isinstance(cache, SplitCache) and len(cache.keys.shape) == 4:
            return ops.cast(cache.keys, dtype), ops.cast(cache.values, dtype)
        check_stacked(cache, None)
        return ops.cast(cache[:, 0], dtype), ops.cast(cache[:, 1], dtype)

    def update_cache(self, cache, k, v, cache_index):
        """Writes a step's `k`, `v` `(B, K, T, H)` into `cache` `(B, 2, K, S_max, H)` at `cache_index`; returns the
        keys and values to attend over, in `k`'s dtype, and the cache."""
        check_stacked(cache, cache_index)
        new = ops.cast(ops.stack([k, v], axis=1), cache.dtype)  # (B, 2, K, T, H)
        cache = write_cache(cache, new, cache_index, self.in_place_cache_writes)
        return ops.cast(cache[:, 0], k.dtype), ops.cast(cache[:, 1], k.dtype), cache

    def shared_heads(self, x, q, groups):
        """Keys or values of `K` heads repeated for the `groups = N / K` query heads of each (a no-op for 1)."""
        return x if groups == 1 else ops.repeat(x, groups, axis=1)  # (B, K, S, H) -> (B, N, S, H)

    def key_heads(self, k, q):
        """The keys as `(B, N, S, H)` in q's dtype, for scores that are not a product (additive)."""
        return k

    def dot(self, q, k):
        """The products `q . k` `(B, N, T, S)` of q `(B, N, T, H)` and k `(B, N, S, H)`."""
        # transpose_b, not a transposed copy of k: under XLA a transpose of the cache is a copy every step.
        return tf.matmul(q, k, transpose_b=True)

    def mix(self, weights, v, dtype):
        """The weighted sum of the values, `(B, N, T, S)` x v `(B, N, S, Hv)` -> `(B, N, T, Hv)`."""
        return ops.matmul(ops.cast(weights, v.dtype), v)


PLAIN = PlainForms()


@keras.saving.register_keras_serializable(package="tfformer")
class LowRankAdapters(keras.layers.Layer):
    """Low-rank adapters (LoRA; Hu et al., 2021) for named kernels of the layer that owns them.

    The adapter of a kernel `W` `(input_dim, units)` is a pair `A` `(input_dim, rank)`, `B` `(rank, units)`;
    the owner uses `W + delta(name)`, `delta = (A @ B) * lora_alpha / rank`. As Keras' `Dense.enable_lora`:
    `A` starts from `he_uniform`, `B` from zeros (so the update starts at zero), and both are float32 under
    every dtype policy (small updates would vanish in bfloat16).

    The owner makes this layer, unbuilt and empty, in its `__init__`, and fills it with `add` when it enables
    adapters, also after it was built itself: Keras lets a built layer gain weights only through a sublayer
    that is still unbuilt. `remove` deletes the adapters once the owner merged them into its kernels; a layer
    builds once, so it takes no new adapters after that. It is never called.

    Args:
        rank: int or None. The rank of every adapter (set by `add`).
        lora_alpha: float or None. The update is scaled by `lora_alpha / rank`. Defaults to `rank` (scale 1).
        a_initializer: initializer for `A`. Defaults to `"he_uniform"`.
        b_initializer: initializer for `B`. Defaults to `"zeros"`.
        **kwargs: Base layer arguments (`name`, `dtype`).

    Example:
    ```python
    adapters = LowRankAdapters()
    adapters.add({"query": (8, 4)}, rank=2)
    kernel = query_kernel + adapters.delta("query")  # (8, 4)
    ```
    """

    def __init__(self, rank=None, lora_alpha=None, a_initializer="he_uniform", b_initializer="zeros", **kwargs):
        check_int("rank", rank, allow_none=True)
        check_lora_alpha(lora_alpha)
        super().__init__(**kwargs)
        self.rank = rank
        self.lora_alpha = lora_alpha
        self.a_initializer = keras.initializers.get(a_initializer)
        self.b_initializer = keras.initializers.get(b_initializer)
        self.kernel_names = ()

    def add(self, kernel_shapes, rank, lora_alpha=None, a_initializer=None, b_initializer=None):
        """Create an adapter of `rank` for each kernel of `kernel_shapes`, `{name: (input_dim, units)}`."""
        if self.built:
            raise ValueError(f"Layer {self.name!r} already made its adapters; a layer builds its weights once.")
        check_int("rank", rank)
        check_lora_alpha(lora_alpha)
        self.rank, self.lora_alpha = rank, lora_alpha
        if a_initializer is not None:
            self.a_initializer = keras.initializers.get(a_initializer)
        if b_initializer is not None:
            self.b_initializer = keras.initializers.get(b_initializer)
        self.build(kernel_shapes)

    def build(self, kernel_shapes):
        check_int("rank", self.rank)
        for name, (input_dim, units) in kernel_shapes.items():
            for part, shape, initializer in (("a", (input_dim, self.rank), self.a_initializer),
                                             ("b", (self.rank, units), self.b_initializer)):
                weight = add_weight(self, f"{name}_lora_{part}", shape, initializer, dtype="float32")
                setattr(self, f"{name}_lora_{part}", weight)
        self.kernel_names = tuple(kernel_shapes)
        self.built = True

    @property
    def scale(self):
        return (self.rank if self.lora_alpha is None else self.lora_alpha) / self.rank

    def delta(self, name):
        """The update `(A @ B) * lora_alpha / rank` `(input_dim, units)` float32 of kernel `name`."""
        a, b = getattr(self, f"{name}_lora_a"), getattr(self, f"{name}_lora_b")
        return ops.matmul(a, b) * self.scale  # (input_dim, rank) x (rank, units)

    def remove(self):
        """Delete every adapter (Keras stops tracking a weight deleted from its layer)."""
        with collection_paused():  # Keras collects garbage after each deleted weight
            for name in self.kernel_names:
                delattr(self, f"{name}_lora_a")
                delattr(self, f"{name}_lora_b")
        self.kernel_names = ()
        self.rank = self.lora_alpha = None

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "rank": self.rank,
                "lora_alpha": self.lora_alpha,
                "a_initializer": keras.initializers.serialize(self.a_initializer),
                "b_initializer": keras.initializers.serialize(self.b_initializer),
            }
        )
        return config


class LowRankProjections:
    """Low-rank adapters on the projection kernels of the Keras layer that mixes this in (`MultiHeadAttention`; after
    `keras.layers.Layer` among its bases, which has none of these methods).

    The layer makes `self.lora = LowRankAdapters(name="lora")` (unbuilt) and sets `lora_rank`, `lora_alpha` in its
    `__init__`, calls `_add_adapters()` in `build` when `lora_rank` is set, and reads its kernels through
    `_kernel_of(name)`. It names them with `_projection_shapes()`, `{adapter: (input_dim, units)}`, and
    `_adapted_kernels()`, `{kernel: its adapters}`: weight `{kernel}_kernel` is the adapters' columns side by side.
    """

    def _kernel_of(self, name):
        """Kernel `name`: the weight itself, or with adapters the weight plus their update (a tensor, which no
        decode plan has laid out)."""
        kernel = getattr(self, f"{name}_kernel")
        if not self.lora_rank:
            return kernel
        parts = self._adapted_kernels()[name]
        return kernel + ops.concatenate([self.lora.delta(part) for part in parts], axis=1)  # (D, units)

    def enable_lora(self, rank, lora_alpha=None, a_initializer="he_uniform", b_initializer="zeros"):
        """Add low-rank adapters of `rank` to the projections and stop training their kernels (Keras'
        `Dense.enable_lora`).

        Once per layer, as in Keras: a layer whose adapters were merged takes no new ones (reload the model
        instead). Under a `tf.distribute` strategy, call it in the strategy's scope.
        """
        check_int("rank", rank)
        check_lora_alpha(lora_alpha)
        if self.lora_rank or self.lora.built:
            state = "has adapters" if self.lora_rank else "had adapters, merged into its kernels"
            raise ValueError(f"Layer {self.name!r} {state}; a layer takes adapters once (Keras builds a layer's "
                             "weights once). Save and reload the model to add new ones.")
        self.lora_rank, self.lora_alpha = rank, lora_alpha
        if not self.built:  # `build` makes them
            self.lora.a_initializer = keras.initializers.get(a_initializer)
            self.lora.b_initializer = keras.initializers.get(b_initializer)
            return
        parent, _, own = self.path.rpartition("/")
        with keras.name_scope(own, override_parent=parent or None):  # adapter paths under this layer's
            self._add_adapters(a_initializer, b_initializer)

    def _add_adapters(self, a_initializer=None, b_initializer=None):
        self.lora.add(self._projection_shapes(), self.lora_rank, self.lora_alpha, a_initializer, b_initializer)
        for name in self._adapted_kernels():
            getattr(self, f"{name}_kernel").trainable = False

    def merge_lora(self):
        """Fold the adapters into the kernels, `W <- W + (A @ B) * lora_alpha / rank`, and delete them: the
        same outputs from plain kernels, which train again."""
        if not self.lora_rank:
            raise ValueError(f"Layer {self.name!r} has no adapters to merge; call `enable_lora(rank)` first.")
        if self.built:
            merged = [(getattr(self, f"{name}_kernel"), self._kernel_of(name)) for name in self._adapted_kernels()]
            for kernel, value in merged:
                kernel.assign(value)
                kernel.trainable = True
            self.lora.remove()
        self.lora_rank = self.lora_alpha = None


def check_lora_alpha(value, name="lora_alpha"):
    """Raise a ValueError naming `name` unless `value` is a positive number or None."""
    check_number(name, value, above=0, allow_none=True, expected="a positive number")
