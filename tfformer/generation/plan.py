"""The decode plan: the fast forms a compiled decode loop takes, chosen by the caller and passed to the layers.

A `DecodePlan` is the layers' `decode_forms.DecodeForms` (the forms of a step: matmuls on laid-out kernels,
in-place cache writes, one-query fusions, split caches, native bfloat16; described there) plus what belongs to the
loop around the steps, in one place where a signature shows it:

- `prepared(model)` lays the kernels out in `kernel_layout` once, before the loop (`prepared_kernels`): XLA does not
  hoist a lone transpose or slice out of a loop. "rows" are in the compute dtype of the layer that owns the kernel
  (bfloat16 under mixed_bfloat16: half the bytes read a step); the loop carries non-float32 rows through an
  optimization barrier (`while_loop`), else XLA would hoist their conversion and read a float32 copy every step.
- `split_caches` (with "rows", a batch of one): per-layer caches as float32 `(keys, values)` pairs
  (`layer_caches`). At larger batches the stacked cache's fused one-step form is faster, which "halves" keeps.
- `cache_segments`: the loop runs in up to this many segments whose caches grow (`segment_sizes`), so a step
  attends over at most about twice the positions filled so far, not the whole buffer.
- `native_bfloat16` only where oneDNN gives the casts' numbers: CPUs with bfloat16 instructions
  (`native_bfloat16_on_this_cpu`); on an AMD Zen 2 without them the outputs differed by several bfloat16 units.

docs/performance.md has the measurements behind each choice.
"""

import keras
import tensorflow as tf
from keras import ops

from tfformer import compat
from tfformer.checks import check_int
from tfformer.layers.decode_forms import DecodeForms, check_kernel_layout
from tfformer.layers.layer_utils import split_cache
from tfformer.layers.token_embedding import TokenEmbedding

# A segment smaller than MIN_SEGMENT slots saves less than its extra loop costs to trace and compile.
CACHE_SEGMENTS = 4
MIN_SEGMENT = 16
# XLA's CPU backend emits each one-query attention dot over a split cache, (B*N, 1, H) x (B*N, S, H), as one kernel
# that spreads the heads over the cores only when one head's buffer is larger than this; up to it, one core reads
# every head. A split cache of 3/4 of that size or more is allocated past it: up to a third more (masked) slots, read
# on every core (docs/performance.md).
PARALLEL_HEAD_BYTES = 128 * 1024


def native_bfloat16_on_this_cpu(cpuinfo="/proc/cpuinfo"):
    """Whether a CPU prompt pass may take `DecodePlan(native_bfloat16=True)`: no GPU visible, and the CPU has
    bfloat16 instructions (`avx512_bf16` or `amx_bf16` in /proc/cpuinfo's flags; False where it cannot be read)."""
    if tf.config.list_physical_devices("GPU"):
        return False
    try:
        with open(cpuinfo) as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def prepared_kernels(model, kernel_layout, transposed_embeddings=False):
    """`{id(kernel): (parts, id(bias) or None)}` for `DecodePlan`, in `kernel_layout` ("rows" or "halves").

    Every float 2-D weight of `model` named `*kernel`; its bias is the weight of the same layer named
    with `bias` for `kernel`. "rows": parts = `[kernel^T | bias]` `(units, input_dim + 1)` (zeros for a
    missing bias) in the compute dtype of the innermost layer holding the kernel; "halves": parts =
    `(kernel[:, :units // 2], kernel[:, units // 2:])`. Quantized (integer) kernels are left out. With
    `transposed_embeddings`, also each `TokenEmbedding`'s table as float32 columns `(hidden_dim, vocabulary_size)`
    (parts), for its logits (`TokenEmbedding.attend`).
    """
    check_kernel_layout(kernel_layout, allow_none=False)
    by_path = {w.path: w for w in model.weights}
    compute_dtype = {}
    if kernel_layout == "rows":
        for layer in compat.flatten_layers(model):  # outer first: the innermost wins
            compute_dtype.update((id(w), layer.compute_dtype) for w in layer.weights)
    kernels = {}
    for w in model.weights:
        if len(w.shape) != 2 or not w.name.endswith("kernel") or not keras.backend.is_float_dtype(w.dtype):
            continue
        bias = by_path.get(w.path[: -len("kernel")] + "bias")
        if kernel_layout == "rows":
            dtype = compute_dtype.get(id(w), model.compute_dtype)
            column = ops.zeros((w.shape[1],), dtype) if bias is None else ops.cast(bias, dtype)
            # (units, input_dim + 1)
            parts = ops.concatenate([ops.transpose(ops.cast(w, dtype)), column[:, None]], axis=1)
        else:
            half = w.shape[1] // 2
            parts = (tf.identity(w[:, :half]), tf.identity(w[:, half:]))  # (input_dim, units/2), (input_dim, rest)
        kernels[id(w)] = parts, None if bias is None else id(bias)
    if transposed_embeddings:
        for layer in compat.flatten_layers(model):
            if isinstance(layer, TokenEmbedding):
                kernels[id(layer.embeddings)] = ops.transpose(ops.cast(layer.embeddings, "float32")), None  # (D, V)
    return kernels


def segment_sizes(max_new_tokens, segments=CACHE_SEGMENTS):
    """Slots for new tokens in each segment's cache: with 4 segments N/8, N/4, N/2, N (rounded up; N always, the
    others only from MIN_SEGMENT slots up)."""
    sizes = [-(-max_new_tokens // 2**k) for k in reversed(range(1, segments))]
    return [size for size in sizes if size >= MIN_SEGMENT] + [max_new_tokens]


def split_slots(slots, head_dim, itemsize=4):
    """The slots to allocate for a split cache that must hold `slots` (an int or an int32 scalar tensor).

    `slots` itself, or, from 3/4 of `PARALLEL_HEAD_BYTES` per head on, the first multiple of 8 slots past it.
    """
    edge = PARALLEL_HEAD_BYTES // (head_dim * itemsize)  # the most slots whose heads XLA reads on one core
    past = -(-(edge + 1) // 8) * 8
    if isinstance(slots, int):
        return past if edge * 3 // 4 <= slots <= edge else slots
    return tf.where(tf.logical_and(slots >= edge * 3 // 4, slots <= edge), past, slots)


def grown(cache, size):
    """Per-layer caches (split, `(B*N, S, H)` pairs, or stacked) zero-padded along S to `size` slots (split ones to
    `split_slots(size)`)."""
    def pad(c):  # S is the second-to-last axis in both forms
        target = split_slots(size, c.shape[-1], c.dtype.size) if len(c.shape) == 3 else size
        return tf.pad(c, [[0, 0]] * (len(c.shape) - 2) + [[0, target - tf.shape(c)[-2]], [0, 0]])

    return tf.nest.map_structure(pad, cache)


def layer_caches(model, batch, slots, split=False, dtype="float32"):
    """Per-layer empty caches (no re-stacking each step): split (`split_cache`, `split_slots(slots)` of them) or
    stacked `(B, 2, K, S, H)`."""
    if split:
        slots = split_slots(slots, model.config.head_dim, tf.as_dtype(dtype).size)
    caches = tf.unstack(model.empty_cache(batch, slots, dtype=dtype))
    return tuple(split_cache(c) for c in caches) if split else tuple(caches)


class DecodePlan(DecodeForms):
    """The fast forms of a decode loop (module docstring; the layers apply them as `DecodeForms`).

    Args:
        kernel_layout: `"rows"` (a batch of one), `"halves"` (larger batches) or None (plain matmuls).
            XLA only.
        in_place_cache_writes: bool. In-place cache writes and one-step attention forms. XLA only.
        cache_segments: int >= 1. Segments of growing caches in a decode loop (1: one loop over the full cache).
        kernels: the prepared kernels (`prepared_kernels`); set by `prepared`, inside the traced function.
        native_bfloat16: bool. bfloat16 softmax and SiLU without float32 casts around them. Graph runtime only.
        transposed_embeddings: bool. With "rows": the token embedding tables laid out too, as float32 columns
            `(D, V)` for the logits: XLA's CPU dot of one row reads them 1.6x faster than the transposed product
            from the `(V, D)` table (whisper-tiny's 80 MB table: 1.8 against 2.8 ms a step, AMD EPYC Zen 2), for
            one transposed copy a call (about 40 ms): for loops of more than about 40 steps.

    Example:
    ```python
    plan = DecodePlan("rows", in_place_cache_writes=True)  # chosen outside; inside the traced function:
    step_plan = plan.prepared(model)
    logits, cache = model.decode_step(tokens, cache, index, plan=step_plan)
    ```
    """

    def __init__(self, kernel_layout=None, in_place_cache_writes=False, cache_segments=CACHE_SEGMENTS, kernels=None,
                 native_bfloat16=False, transposed_embeddings=False):
        check_int("cache_segments", cache_segments)
        if transposed_embeddings and kernel_layout != "rows":
            raise ValueError("`transposed_embeddings` lays the logits' table out for the \"rows\" layout. Received: "
                             f"kernel_layout={kernel_layout!r}")
        super().__init__(kernel_layout, in_place_cache_writes, native_bfloat16, kernels)
        self.cache_segments = cache_segments
        self.transposed_embeddings = bool(transposed_embeddings)

    def __repr__(self):
        return (f"DecodePlan(kernel_layout={self.kernel_layout!r}, in_place_cache_writes={self.in_place_cache_writes}, "
                f"cache_segments={self.cache_segments}, native_bfloat16={self.native_bfloat16}, "
                f"transposed_embeddings={self.transposed_embeddings}, prepared={self.kernels is not None})")

    def key(self):
        """What tells compiled decode functions apart (not the prepared kernels, which are made inside them); the
        kernel layout last."""
        return (self.in_place_cache_writes, self.native_bfloat16, self.transposed_embeddings, self.cache_segments,
                self.kernel_layout)

    @property
    def split_caches(self):
        """Whether decode loops keep split, float32 per-layer caches (the batch-1 "rows" layout)."""
        return self.kernel_layout == "rows"

    def _replace(self, **changes):
        fields = dict(kernel_layout=self.kernel_layout, in_place_cache_writes=self.in_place_cache_writes,
                      cache_segments=self.cache_segments, kernels=self.kernels, native_bfloat16=self.native_bfloat16,
                      transposed_embeddings=self.transposed_embeddings)
        return DecodePlan(**{**fields, **changes})

    def with_kernels(self, kernels):
        """This plan on `kernels` laid out beforehand (`prepared(model).kernels`, e.g. an argument of a traced loop
        that runs many times on the same weights)."""
        return self._replace(kernels=kernels)

    def prepared(self, model):
        """This plan with `model`'s kernels laid out (call it inside the traced function, before the loop)."""
        if self.kernel_layout is None:
            return self
        return self._replace(kernels=prepared_kernels(model, self.kernel_layout, self.transposed_embeddings))

    # === Loops ===
    def while_loop(self, cond, body, loop_vars):
        """`tf.while_loop(cond, lambda *state: body(plan, *state), loop_vars)`, where `plan` is this one or, in the
        "rows" layout, this one on its non-float32 rows carried in the loop state through an XLA optimization
        barrier each step.

        The rows are loop-invariant, so XLA would hoist their conversion to float32 out of the loop and read a
        float32 copy every step; behind the barrier they are loop state, and each step's fused product reads the
        narrow rows and converts them in registers.
        """
        carried = []
        if self.kernels is not None and self.kernel_layout == "rows":
            carried = [key for key, (rows, _) in self.kernels.items() if rows.dtype != tf.float32]
        if not carried:
            return tf.while_loop(cond, lambda *state: body(self, *state), loop_vars)

        def carrying_body(*state):
            *state, rows = state
            rows = list(compat.optimization_barrier(*rows))
            kernels = {**self.kernels, **{key: (r, self.kernels[key][1]) for key, r in zip(carried, rows)}}
            return (*body(self._replace(kernels=kernels), *state), rows)

        state = (*loop_vars, [self.kernels[key][0] for key in carried])
        return tf.while_loop(lambda *state: cond(*state[:-1]), carrying_body, state)[:-1]

    def segmented_loop(self, cond, body, loop_vars, cache_at, prefix, max_new_tokens):
        """`self.while_loop(cond, body, loop_vars)` over growing caches.

        `loop_vars` is `(i, ...)` with the per-layer caches at index `cache_at`; step `i` writes cache slot `i`.
        Segment k runs while `i < prefix + segment_sizes(N)[k]` on caches of that many slots (split ones:
        `split_slots` of them); between segments the caches are zero-padded to the next size. Sizes come from
        static shapes, so XLA compiles each loop with a fixed cache length.
        """
        for size in segment_sizes(max_new_tokens, self.cache_segments):
            stop = prefix + size
            loop_vars = (*loop_vars[:cache_at], grown(loop_vars[cache_at], stop), *loop_vars[cache_at + 1:])
            loop_vars = self.while_loop(lambda i, *rest, stop=stop: tf.logical_and(i < stop, cond(i, *rest)), body,
                                        loop_vars)
        return loop_vars

    def first_segment(self, max_new_tokens):
        """Slots for new tokens in the first segment's cache."""
        return segment_sizes(max_new_tokens, self.cache_segments)[0]

    def layer_caches(self, model, batch, slots, dtype="float32"):
        """Empty per-layer caches for `slots` positions: split float32 pairs with `split_caches`, else stacked in
        `dtype`."""
        if self.split_caches:
            return layer_caches(model, batch, slots, split=True)
        return layer_caches(model, batch, slots, dtype=dtype)
