import math

import keras
import tensorflow as tf
from keras import ops

from tfformer.checks import check_int, check_one_of
from tfformer.compat import gradient_recording
from tfformer.layers import masks as masks_lib
from tfformer.layers.dropout import Dropout
from tfformer.layers.layer_utils import (PLAIN, LowRankAdapters, LowRankProjections, check_dropout, check_lora_alpha,
                                         add_kernel, add_weight, check_sequences, in_query_chunks)
from tfformer.layers.rotary_embedding import RotaryEmbedding, check_rope_max_wavelength

SCORES = ("scaled_dot", "dot", "general", "additive")
CONFIG = ("num_heads", "key_dim", "value_dim", "dropout", "use_bias", "output_dim", "score", "window",
          "num_key_value_heads", "kernel_initializer", "bias_initializer", "rope_max_wavelength", "lora_rank",
          "lora_alpha")


@keras.saving.register_keras_serializable(package="tfformer")
class MultiHeadAttention(keras.layers.Layer, LowRankProjections):
    """Multi-head attention (Vaswani et al., 2017), with a key/value cache.

    Projects the query, key and value into `num_heads` heads, computes the attention weights `softmax(score(q, k))`
    per head, takes the weighted sum of the values, concatenates the heads and projects back with `W_O`:
    `MultiHead(Q, K, V) = Concat(head_1..head_h) W_O`.

    When query, key and value inputs have the same width the three projections live in one fused kernel
    `(D, N*key_dim + K*(key_dim + value_dim))`: self-attention does a single matmul, cross-attention slices it.

    Grouped-query attention (Ainslie et al., 2023): with `num_key_value_heads` `K < N` the keys and values have `K`
    heads, each shared by `N / K` consecutive query heads, and the cache holds `K` heads. `K = N` (the default) is
    multi-head attention, `K = 1` multi-query attention.

    Rotary positions (`rope_max_wavelength`; Su et al., 2021, as in Llama): q and k are rotated by their absolute
    positions (`cache_index + i` when decoding with a cache) after the projection and before the cache write, with
    `RotaryEmbedding`'s interleaved pairs `(2i, 2i+1)` of each head. A read-only cache (keys of a fixed memory) and
    its queries are not rotated.

    Score functions (`score=`): `"scaled_dot"` q.k/sqrt(key_dim) (the paper), `"dot"` q.k, `"general"` q^T W k (one
    `W` per head), and `"additive"` w^T tanh(W_q q + W_k k) (the projections play W_q, W_k; one `w` per head).

    Low-rank adapters (LoRA; Hu et al., 2021; `lora_rank` or `enable_lora`, as Keras' `Dense.enable_lora`): each
    projection kernel `W` (query, key, value, output; views of the fused kernel) is used as
    `W + (A @ B) * lora_alpha / rank` and stops training, so only the adapters `A`, `B` (and the biases) train;
    `merge_lora` folds them into the kernels. A decode plan lays out the plain kernels only: with adapters, a decode
    step takes the plain matmuls (the same numbers, slower); merge before generating at speed.

    Masking: every mask is boolean with True = may attend. `attention_mask` `(B, T, S)` (an axis of size 1
    broadcasts), `use_causal_mask`, the restricted window and Keras' implicit masks (`query_mask` `(B, T)`,
    `value_mask`/`key_mask` `(B, S)`, from `Embedding(mask_zero=True)` and friends) are ANDed. The softmax runs in
    float32 with a finite mask value; a query that sees no key gets all-zero weights (its output: the output bias).

    Args:
        num_heads: int. Number of query heads `N`.
        key_dim: int. Width `H` of each query/key head.
        value_dim: int. Width of each value head. Defaults to `key_dim`.
        dropout: float. Dropout on the attention weights. Defaults to `0.0`.
        use_bias: bool. Whether projections have biases. Defaults to `True`.
        output_dim: int. Width of the output. Defaults to the query width.
        score: str. One of `"scaled_dot"`, `"dot"`, `"general"`, `"additive"`.
        window: int. If set, query `i` only sees keys `j` with `|i - j| <= window` (restricted self-attention).
            Defaults to `None` (no restriction).
        num_key_value_heads: int. Number of key/value heads `K`; must divide `num_heads`. Defaults to `None`
            (`num_heads`).
        rope_max_wavelength: float. If set, rotary positions with this base on the projected q and k. Defaults to
            `None` (none).
        kernel_initializer: initializer for the projection kernels.
        bias_initializer: initializer for the projection biases.
        lora_rank: int. If set, low-rank adapters of this rank on the four projections (see above). Defaults to
            `None` (none).
        lora_alpha: float. The adapters' update is scaled by `lora_alpha / lora_rank`. Defaults to `None`
            (`lora_rank`: scale 1).
        **kwargs: Base layer arguments (`name`, `dtype`, `trainable`).

    Call arguments:
        query: `(B, T, Dq)`.
        value: `(B, S, Dv)`.
        key: optional `(B, S, Dk)`; defaults to `value`.
        attention_mask: optional bool `(B, T, S)`.
        use_causal_mask: bool. Query `i` (at absolute position `cache_index + i` when decoding with a cache) sees
            keys `j <= i`.
        return_attention_scores: bool. Also return the weights `(B, N, T, S)`.
        cache: optional `(B, 2, K, S_max, H)` keys (index 0) and values (index 1). With `cache_index`, the new
            keys/values of `key`/`value` are written at `cache_index` and attention runs over the whole cache;
            positions `>= cache_index + T` are masked. Without `cache_index` the cache is read as precomputed
            keys/values (e.g. cross-attention over a fixed encoder output) and `value` is ignored. Implicit
            `value_mask`/`key_mask` are ignored when a cache is used; pass padding through `attention_mask`. With
            `cache_index` and a decode plan the cache may also be split, `(keys, values)` each `(B*K, S_max, H)`
            (`layers.decode_forms`), and comes back a pair.
        cache_index: int scalar, where the `T` new positions start.
        training: bool, enables dropout.
        plan: optional decode plan (`tfformer.generation.DecodePlan`): the forms of a step inside a compiled decode
            loop (`layer_utils`). Defaults to `None` (`layer_utils.PLAIN`, the plain forms).
        query_chunk_size: int. Attend this many queries at a time (`layer_utils.in_query_chunks`). Defaults to `None`.

    Returns:
        `outputs` `(B, T, output_dim)`; `(outputs, scores)` with `return_attention_scores`; `(outputs, cache)` when
        `cache` is given; `(outputs, scores, cache)` with both.

    Example:
    ```python
    layer = tfformer.layers.MultiHeadAttention(num_heads=2, key_dim=4)
    x = np.random.rand(1, 5, 8).astype("float32")
    y = layer(x, x, use_causal_mask=True)  # (1, 5, 8)
    ```

    Reference:
        Vaswani et al., 2017, "Attention Is All You Need"; Luong et al., 2015; Bahdanau et al., 2015
    """

    def __init__(self, num_heads, key_dim, value_dim=None, dropout=0.0, use_bias=True, output_dim=None,
                 score="scaled_dot", window=None, num_key_value_heads=None, kernel_initializer="glorot_uniform",
                 bias_initializer="zeros", rope_max_wavelength=None, lora_rank=None, lora_alpha=None, **kwargs):
        check_int("num_heads", num_heads)
        check_int("key_dim", key_dim)
        check_int("value_dim", value_dim, allow_none=True)
        check_int("output_dim", output_dim, allow_none=True)
        check_int("num_key_value_heads", num_key_value_heads, allow_none=True)
        if num_key_value_heads is not None and num_heads % num_key_value_heads:
            raise ValueError("`num_key_value_heads` must divide `num_heads`. "
                             f"Received: num_key_value_heads={num_key_value_heads}, num_heads={num_heads}")
        check_dropout(dropout)
        check_rope_max_wavelength(rope_max_wavelength)
        check_one_of("score", score, SCORES)
        check_int("window", window, minimum=0, allow_none=True)
        check_int("lora_rank", lora_rank, allow_none=True)
        check_lora_alpha(lora_alpha)
        super().__init__(**kwargs)
        self.num_heads, self.key_dim, self.value_dim, self.output_dim = num_heads, key_dim, value_dim, output_dim
        self.dropout, self.use_bias, self.score, self.window = dropout, use_bias, score, window
        self.num_key_value_heads, self.rope_max_wavelength = num_key_value_heads, rope_max_wavelength
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.lora_rank, self.lora_alpha = lora_rank, lora_alpha
        self._value_dim, self._kv_heads = value_dim or key_dim, num_key_value_heads or num_heads
        self.supports_masking = True
        self._dropout_layer = Dropout(dropout, dtype=self.dtype_policy)
        self.rotary = None
        if rope_max_wavelength is not None:  # no weights; rotates q and k laid out (B, N|K, T, H)
            self.rotary = RotaryEmbedding(rope_max_wavelength, sequence_axis=2, dtype=self.dtype_policy)
        # Unbuilt and empty until adapters are enabled, which may be after this layer is built.
        self.lora = LowRankAdapters(name="lora", dtype=self.dtype_policy)

    def _check_cacheable(self):
        if self._value_dim != self.key_dim:  # keys and values share one cache tensor (B, 2, K, S, H)
            raise ValueError(f"A cache needs value_dim == key_dim. Received: key_dim={self.key_dim}, "
                             f"value_dim={self.value_dim}")

    def build(self, query_shape, value_shape, key_shape=None):
        query_dim, value_dim = query_shape[-1], value_shape[-1]
        key_dim = value_dim if key_shape is None else key_shape[-1]
        n, kv, h, hv = self.num_heads, self._kv_heads, self.key_dim, self._value_dim
        self._q_units, self._k_units, self._v_units = n * h, kv * h, kv * hv
        self._fused = query_dim == value_dim == key_dim
        if self._fused:
            self.qkv_kernel, self.qkv_bias = add_kernel(self, "qkv", query_dim, n * h + kv * h + kv * hv)
        else:
            self.query_kernel, self.query_bias = add_kernel(self, "query", query_dim, n * h)
            self.key_kernel, self.key_bias = add_kernel(self, "key", key_dim, kv * h)
            self.value_kernel, self.value_bias = add_kernel(self, "value", value_dim, kv * hv)
        if self.score == "general":
            self.general_kernel = add_weight(self, "general_kernel", (n, h, h), self.kernel_initializer)
        elif self.score == "additive":
            self.additive_vector = add_weight(self, "additive_vector", (n, 1, h), self.kernel_initializer)
        # The N heads' values back to the output width.
        self.output_kernel, self.output_bias = add_kernel(self, "output", n * hv, self.output_dim or query_dim)
        if self.lora_rank:
            self._add_adapters()
        self.built = True

    # === Low-rank adapters (layer_utils.LowRankProjections) ===
    def _projection_shapes(self):
        if self._fused:
            d = self.qkv_kernel.shape[0]
            shapes = {"query": (d, self._q_units), "key": (d, self._k_units), "value": (d, self._v_units)}
        else:
            shapes = {name: tuple(getattr(self, f"{name}_kernel").shape) for name in ("query", "key", "value")}
        return {**shapes, "output": tuple(self.output_kernel.shape)}

    def _adapted_kernels(self):
        if self._fused:  # the query, key and value adapters side by side, as their columns of the fused kernel
            return {"qkv": ("query", "key", "value"), "output": ("output",)}
        return {name: (name,) for name in ("query", "key", "value", "output")}

    # === Projections ===
    def _split_heads(self, x, heads, head_dim):
        b, t = ops.shape(x)[0], ops.shape(x)[1]
        x = ops.reshape(x, (b, t, heads, head_dim))  # (B, T, N, H)
        return ops.transpose(x, (0, 2, 1, 3))  # (B, N, T, H)

    def _split_stacked_heads(self, x, parts, heads):
        """`(B, T, parts * heads * H)` -> `parts` tensors `(B, heads, T, H)` with one transpose.

        A split of the last axis copies every part before its own transpose; TF's Unpack along the leading axis
        shares the transposed buffer when each part's byte size is a multiple of 64 (else it copies once).
        """
        b, t = ops.shape(x)[0], ops.shape(x)[1]
        x = ops.reshape(x, (b, t, parts, heads, self.key_dim))  # (B, T, parts, N, H)
        x = ops.transpose(x, (2, 0, 3, 1, 4))  # (parts, B, N, T, H)
        return tf.unstack(x, num=parts, axis=0)  # parts x (B, N, T, H)

    def _project_query(self, query, plan):
        if self._fused:
            return plan.dense(query, self._kernel_of("qkv"), self.qkv_bias, 0, self._q_units)
        return plan.dense(query, self._kernel_of("query"), self.query_bias, 0, self._q_units)

    def _project(self, query, value, key, plan, rotary_start=None):
        """Returns q `(B, N, T, H)`, k `(B, K, S, H)`, v `(B, K, S, Hv)`; q and k rotated from position
        `rotary_start` when the layer has rotary positions (and `rotary_start` is not None)."""
        n, kv, h, hv = self.num_heads, self._kv_heads, self.key_dim, self._value_dim
        qu, ku, vu = self._q_units, self._k_units, self._v_units
        rotate = self.rotary is not None and rotary_start is not None
        kernel = self._kernel_of("qkv") if self._fused else None
        if self._fused and value is query and (key is None or key is query):  # self-attention: one matmul
            qkv = plan.dense(query, kernel, self.qkv_bias, 0, qu + ku + vu)  # (B, T, N*H + K*(H+Hv))
            if hv == h and n == kv and not rotate:
                return tuple(self._split_stacked_heads(qkv, 3, n))
            if hv == h:
                heads = self._split_heads(qkv, n + 2 * kv, h)  # (B, N+2K, T, H): every head moved in one transpose
                if not rotate:
                    return tuple(ops.split(heads, [n, n + kv], axis=1))  # (B, N, T, H), (B, K, T, H), (B, K, T, H)
                qk, v = ops.split(heads, [n + kv], axis=1)  # (B, N+K, T, H), (B, K, T, H)
                q, k = ops.split(self.rotary(qk, start_index=rotary_start), [n], axis=1)  # rotated in one pass
                return q, k, v
            # A split, not three slices: its gradient is one concat, a slice's is a zero-filled copy each.
            q, k, v = ops.split(qkv, [qu, qu + ku], axis=-1)
        elif self._fused and (key is None or key is value):  # cross-attention: q, then k and v together
            if gradient_recording():
                # Training: the fused kernel split once into its q and k/v columns. The gradient of a split is
                # one concat; that of two slices is a zero-filled StridedSliceGrad each and their sum.
                kernel_q, kernel_kv = tf.split(kernel, [qu, ku + vu], axis=1)  # (D, N*H), (D, K*(H+Hv))
                bias_q, bias_kv = (None, None) if self.qkv_bias is None else tf.split(self.qkv_bias, [qu, ku + vu])
                q, kv_states = plan.dense(query, kernel_q, bias_q), plan.dense(value, kernel_kv, bias_kv)
            else:
                q = plan.dense(query, kernel, self.qkv_bias, 0, qu)  # (B, T, N*H)
                kv_states = plan.dense(value, kernel, self.qkv_bias, qu, qu + ku + vu)  # (B, S, K*(H+Hv))
            if hv == h:
                q, (k, v) = self._split_heads(q, n, h), self._split_stacked_heads(kv_states, 2, kv)
            else:
                k, v = ops.split(kv_states, [ku], axis=-1)
        elif self._fused:
            q = plan.dense(query, kernel, self.qkv_bias, 0, qu)
            k = plan.dense(key, kernel, self.qkv_bias, qu, qu + ku)
            v = plan.dense(value, kernel, self.qkv_bias, qu + ku, qu + ku + vu)
        else:
            q = self._project_query(query, plan)
            k = plan.dense(value if key is None else key, self._kernel_of("key"), self.key_bias, 0, ku)
            v = plan.dense(value, self._kernel_of("value"), self.value_bias, 0, vu)
        if len(q.shape) == 3:  # (B, T, N*H): not yet split into heads
            q, k, v = self._split_heads(q, n, h), self._split_heads(k, kv, h), self._split_heads(v, kv, hv)
        if rotate:
            q, k = self.rotary(q, start_index=rotary_start), self.rotary(k, start_index=rotary_start)
        return q, k, v

    def compute_cache(self, value, key=None):
        """Keys/values of a fixed memory as a read-only cache `(B, 2, K, S, H)`, projected once (cross-attention)."""
        self._check_cacheable()
        _, k, v = self._project(value[:, :1], value, key, PLAIN)
        return ops.stack([k, v], axis=1)  # (B, 2, K, S, H)

    # === Attention ===
    def call(self, query, value, key=None, query_mask=None, value_mask=None, key_mask=None, attention_mask=None,
             use_causal_mask=False, return_attention_scores=False, cache=None, cache_index=None, training=None,
             plan=None, query_chunk_size=None):
        plan = plan or PLAIN
        check_sequences(query=query, value=value, key=key)
        if cache is not None and cache_index is None:  # read-only: precomputed keys/values of a fixed memory
            q = self._split_heads(self._project_query(query, plan), self.num_heads, self.key_dim)
            k, v = plan.read_cache(cache, q.dtype)
        else:
            q, k, v = self._project(query, value, key, plan, rotary_start=0 if cache_index is None else cache_index)
        if cache is not None and cache_index is not None:
            self._check_cacheable()
            k, v, cache = plan.update_cache(cache, k, v, cache_index)
        k, v = (plan.shared_heads(x, q, self.num_heads // self._kv_heads) for x in (k, v))  # K -> N heads
        mask = plan.shared_mask((use_causal_mask, self.window), lambda: self._mask(
            query, k, query_mask, value_mask, key_mask, attention_mask, use_causal_mask, cache, cache_index))
        x, weights = in_query_chunks(self._attend, q, mask, query_chunk_size, k, v, plan, training,
                                     return_attention_scores)  # (B, N, T, Hv), (B, N, T, S) or None
        # A query that sees no key is zeroed after the mixing, on (B, N, T, Hv), not on the larger weights.
        # Causal masks (and the cache's) leave key 0 to every query; only the others can empty a row.
        may_empty_rows = any(m is not None for m in (self.window, attention_mask, query_mask, value_mask, key_mask))
        if mask is not None and may_empty_rows:
            row_has_key = masks_lib.has_visible_key(mask)  # (B|1, 1, T, 1)
            x = x * ops.cast(row_has_key, x.dtype)
            if weights is not None:
                weights = weights * ops.cast(row_has_key, weights.dtype)
        x = ops.transpose(x, (0, 2, 1, 3))  # (B, T, N, Hv)
        x = ops.reshape(x, (ops.shape(x)[0], ops.shape(query)[1], self.num_heads * self._value_dim))  # (B, T, N*Hv)
        outputs = plan.dense(x, self._kernel_of("output"), self.output_bias, 0, self.output_kernel.shape[-1])
        result = (outputs,) + ((weights,) if return_attention_scores else ()) + ((cache,) if cache is not None else ())
        return result[0] if len(result) == 1 else result

    def _attend(self, q, mask, k, v, plan, training, keep_weights):
        scores = self._scores(q, k, plan)  # (B, N, T, S)
        # Dot-product scores take their scale and mask after the matmul: BatchMatMul + Mul + Add is one
        # oneDNN kernel on CPU, instead of a matmul, a float32 select and a scaled copy of q.
        dot_scores = self.score != "additive"
        if self.score == "scaled_dot":
            scores = scores * ops.cast(1.0 / math.sqrt(self.key_dim), scores.dtype)
        if dot_scores and mask is not None:
            scores = scores + masks_lib.mask_bias(mask, scores.dtype)
        weights = plan.softmax(scores) if dot_scores else masks_lib.masked_softmax(scores, mask, zero_empty_rows=False)
        return plan.mix(self._dropout_layer(weights, training=training), v, q.dtype), weights if keep_weights else None

    def _scores(self, q, k, plan):
        # q (B, N, T, H), k (B, N, S, H) (or a split cache's) -> (B, N, T, S)
        if self.score == "additive":
            k = plan.key_heads(k, q)  # (B, N, S, H)
            w = ops.cast(self.additive_vector, q.dtype)[None, :, :, None, :]  # (1, N, 1, 1, H)
            hidden = ops.tanh(ops.expand_dims(q, 3) + ops.expand_dims(k, 2))  # (B, N, T, S, H)
            return ops.sum(hidden * w, axis=-1)
        # Dot-product scores are (q W) . k: W = I (dot, and scaled_dot before its 1/sqrt(H)), one W per head (general).
        if self.score == "general":
            q = ops.matmul(q, ops.cast(self.general_kernel, q.dtype))  # (B, N, T, H)
        return plan.dot(q, k)

    def _mask(self, query, k, query_mask, value_mask, key_mask, attention_mask, use_causal_mask, cache, cache_index):
        """Every mask ANDed, `(B|1, 1, T, S)` bool, or None."""
        query_length, key_length = ops.shape(query)[1], ops.shape(k)[-2]
        masks_lib.check_mask("attention_mask", attention_mask, "(B, T, S)", (*query.shape[:2], k.shape[-2]))
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
            if cache_index is not None and not use_causal_mask else None,
        )
        return None if mask is None else ops.expand_dims(mask, 1)  # (B|1, 1, T, S)

    def get_config(self):
        config = super().get_config()
        for name in CONFIG:
            value = getattr(self, name)
            config[name] = keras.initializers.serialize(value) if name.endswith("_initializer") else value
        return config
