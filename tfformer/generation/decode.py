"""The text tasks' decodes: set-up (encoder pass or prompt prefill, per-layer key/value caches) and a `next`
callback over `model.decode_step`, driven by a sampler's loop (`Sampler.run`, `BeamSampler.run`).

Each step feeds one token and attends over the cache, so a new token costs O(current length) instead of a full
re-run. Compiled functions are kept on the model (`reset_compiled` drops them) per sampler, length, decode plan
(`generation.plan.DecodePlan`: under XLA, one for a batch of one, one for larger batches) and place of a causal
prompt pass (under XLA with the loop, or before it in the graph runtime: `generate_ids`' `prefill_jit_compile`);
they take dynamic batch/length shapes, so repeated calls do not retrace.
"""

import warnings

import numpy as np
import tensorflow as tf

from tfformer.checks import check_int
from tfformer.compat import untracked_holder
from tfformer.generation.beam import BeamSampler
from tfformer.generation.plan import DecodePlan, check_kernel_layout, grown, native_bfloat16_on_this_cpu
from tfformer.generation import samplers
from tfformer.layers.layer_utils import split_cache
from tfformer.tokens import END_ID, PAD_ID, START_ID, cut_at_end


def compiled_functions(model):
    """`{key: function}`: the decode functions `generate_ids` made for `model`, by what tells them apart (the
    architecture, the sampler, the plan, what XLA compiles), kept on it out of Keras' sight
    (`compat.untracked_holder`); `reset_compiled` empties it."""
    return vars(untracked_holder(model, "generate_functions"))


def cached_function(model, key, make):
    """`make()`'s function, kept on `model` under `key` (`compiled_functions`)."""
    functions = compiled_functions(model)
    if key not in functions:
        functions[key] = make()
    return functions[key]


def reset_compiled(model):
    """Drops the decode functions kept on `model`; its `compile` calls this, as keras-hub's tasks drop their
    generate function there: a function traced before a change of the model (e.g. quantization) would keep it."""
    compiled_functions(model).clear()


def _check_prefill_jit_compile(prefill_jit_compile, jit_compile, architecture):
    """`generate_ids`' `prefill_jit_compile` as a bool (None: as `jit_compile`), checked."""
    if prefill_jit_compile is None:
        return bool(jit_compile)
    if not isinstance(prefill_jit_compile, bool):
        raise ValueError(f"`prefill_jit_compile` must be a bool or None. Received: "
                         f"prefill_jit_compile={prefill_jit_compile!r}")
    if prefill_jit_compile and not jit_compile:
        raise ValueError("`prefill_jit_compile=True` needs `jit_compile=True` (the prompt's pass runs in the decode "
                         "function). Received: jit_compile=False")
    if not prefill_jit_compile and jit_compile and architecture != "causal_lm":
        raise ValueError("`prefill_jit_compile=False` with `jit_compile=True` is for causal LMs (a prompt's pass "
                         f"before the loop). Received: architecture={architecture!r}")
    return prefill_jit_compile


def _ids_spec():
    return tf.TensorSpec([None, None], tf.int32)


def _seq2seq_fn(model, max_new_tokens, sampler, end_id, plan):
    beams = sampler.beams

    def run(encoder_token_ids):
        step_plan = plan.prepared(model)  # kernels laid out once, before the loop
        batch = tf.shape(encoder_token_ids)[0]
        encoder_outputs, encoder_mask = model.encode(encoder_token_ids)
        if beams > 1:
            encoder_outputs, encoder_mask = tf.repeat(encoder_outputs, beams, 0), tf.repeat(encoder_mask, beams, 0)
        cross = model.cross_attention_caches(encoder_outputs)
        # Each row's beams adjacent, (B*K, ...); grows in the loop.
        cache = step_plan.layer_caches(model, batch * beams, step_plan.first_segment(max_new_tokens), cross.dtype)
        cross = tuple(tf.unstack(cross))

        def next(ids, cache, index, plan=None):
            logits, cache = model.decode_step(ids, cache, index, cross, encoder_mask, plan=plan)  # (B, 1, V)
            return logits[:, -1, :], None, cache

        return sampler.run(next, tf.zeros([batch, max_new_tokens], tf.int32), cache, 0, end_id, max_new_tokens,
                           ids=tf.fill([batch * beams, 1], START_ID), plan=step_plan)

    return run


def _causal_prefill(model, prompt_ids, max_new_tokens, beams, plan, cache_dtype="float32"):
    """A causal decode's prompt pass: `(lengths (B,), logits (B*K, V) at the shortest prompt's last token, per-layer
    caches)`, the caches in `plan`'s layout with slots for the prompt and the first segment (stacked ones in
    `cache_dtype`)."""
    batch, prompt_length = tf.shape(prompt_ids)[0], tf.shape(prompt_ids)[1]
    lengths = tf.reduce_sum(tf.cast(prompt_ids != PAD_ID, tf.int32), axis=1)  # (B,) right padding
    start = tf.reduce_min(lengths)
    # Prompt + the first segment's slots, each row's beams adjacent; grows in the loop.
    cache = plan.layer_caches(model, batch * beams, prompt_length + plan.first_segment(max_new_tokens), cache_dtype)
    # Prefill the part every prompt shares, in one pass. The whole (static-width) prompt goes in: a slice to
    # `start` would make XLA compile once per prompt. The padding's slots stay masked until the loop's step
    # for that position overwrites them.
    prompts = prompt_ids if beams == 1 else tf.repeat(prompt_ids, beams, axis=0)  # (B*K, P)
    logits, cache = model.decode_step(prompts, cache, 0, logits_index=start - 1, plan=plan)  # (B*K, 1, V)
    return lengths, logits[:, -1, :], cache


def _causal_loop(model, prompt_ids, lengths, logits, cache, max_new_tokens, sampler, end_id, plan):
    """A causal decode's loop after `_causal_prefill`: new ids `(B, max_new_tokens)`."""
    tokens = tf.pad(prompt_ids, [[0, 0], [0, max_new_tokens]])  # (B, P + N)

    def next(ids, cache, index, plan=None):
        logits, cache = model.decode_step(ids, cache, index, plan=plan)  # (B, 1, V)
        return logits[:, -1, :], None, cache

    tokens = sampler.run(next, tokens, cache, tf.reduce_min(lengths), end_id, max_new_tokens, logits=logits,
                         prompt_lengths=lengths, plan=plan, prefix=tf.shape(prompt_ids)[1])
    # Each row's continuation starts at its own prompt length.
    index = lengths[:, None] + tf.range(max_new_tokens)[None, :]  # (B, N)
    return tf.gather(tokens, index, batch_dims=1)


def _causal_fn(model, max_new_tokens, sampler, end_id, plan):
    def run(prompt_ids):
        step_plan = plan.prepared(model)  # kernels laid out once, before the loop
        lengths, logits, cache = _causal_prefill(model, prompt_ids, max_new_tokens, sampler.beams, step_plan)
        return _causal_loop(model, prompt_ids, lengths, logits, cache, max_new_tokens, sampler, end_id, step_plan)

    return run


def _xla_loop_causal_fn(model, max_new_tokens, sampler, end_id, plan):
    """`_causal_fn` with only its loop compiled with XLA: for a graph function without XLA, whose prompt pass then
    runs in TensorFlow's graph runtime (its oneDNN matmuls run bfloat16 natively; XLA's CPU backend multiplies
    bfloat16 at about the float32 rate). The prompt pass fills stacked caches (its batched attention's fast form);
    the loop splits them first if its plan keeps split caches. They hold the keys and values in the compute dtype,
    as the attention makes them (no casts in the pass); split ones are float32 in the loop. On CPUs with bfloat16
    instructions the pass takes bfloat16 softmax and SiLU as they are (`DecodePlan.native_bfloat16`: a property of
    oneDNN's kernels there, not claimed for GPU ones or other CPUs)."""
    prefill_plan = DecodePlan(cache_segments=plan.cache_segments, native_bfloat16=native_bfloat16_on_this_cpu())

    def loop(prompt_ids, lengths, logits, cache):
        step_plan = plan.prepared(model)  # kernels laid out once, before the loop
        if step_plan.split_caches:
            # (B, 2, N, S, H) -> 2 x (B*N, S', H) float32 per layer, S' = split_slots(S): what the plan's own would be.
            cache = grown(tuple(split_cache(tf.cast(c, tf.float32)) for c in cache), tf.shape(cache[0])[-2])
        return _causal_loop(model, prompt_ids, lengths, logits, cache, max_new_tokens, sampler, end_id, step_plan)

    loop = tf.function(loop, jit_compile=True, reduce_retracing=True)

    def first_token(prompt_ids, lengths, logits, cache):
        # The prompt's logits give every token asked for: the sampler's choice, no decode step, no kernel layout.
        return _causal_loop(model, prompt_ids, lengths, logits, cache, max_new_tokens, sampler, end_id, None)

    def run(prompt_ids):
        lengths, logits, cache = _causal_prefill(model, prompt_ids, max_new_tokens, sampler.beams, prefill_plan,
                                                 model.compute_dtype)
        if sampler.beams > 1:
            return loop(prompt_ids, lengths, logits, cache)
        # The loop's steps fill the columns after the shortest prompt's first new token, up to the longest
        # prompt's last one.
        steps = tf.reduce_max(lengths) + max_new_tokens - (tf.reduce_min(lengths) + 1)
        return tf.cond(steps > 0, lambda: loop(prompt_ids, lengths, logits, cache),
                       lambda: first_token(prompt_ids, lengths, logits, cache))

    return run


def _method(sampler, beam_size, length_penalty):
    """The `Sampler` that decodes: a `BeamSampler` for a `beam_size`, else `sampler` (None: greedy)."""
    return BeamSampler(beam_size, length_penalty) if beam_size else samplers.get(sampler)


def decode_fn(model, max_new_tokens, sampler=None, beam_size=None, length_penalty=0.6, end_id=END_ID,
              kernel_layout=None, plan=None):
    """The (untraced) decoding function `ids (B, L) int32 -> new ids (B, max_new_tokens)` of `model`.

    Traceable into any graph: `generate_ids` compiles it, the SavedModel exporter
    embeds it in its serving signature. `end_id=-1` never stops early (benchmarks).
    `sampler`: a `Sampler` (`BeamSampler` included) or what `samplers.get` takes (None: greedy);
    a `beam_size` takes `BeamSampler(beam_size, length_penalty)` instead.
    `plan` (a `generation.plan.DecodePlan`) picks the loop's fast forms; by default
    `DecodePlan(kernel_layout)`, which without a layout runs in any graph (SavedModel without
    XLA, TFLite). `kernel_layout` ("rows" for a batch
    of one, "halves" for more; greedy or sampling, beam search ignores it) is for code
    compiled with XLA: the decode steps' matmuls then use kernels laid out once before
    the loop, and "rows" also keeps split float32 caches (see `generation.plan`). Pass
    one of `kernel_layout` and `plan`.
    """
    check_kernel_layout(kernel_layout)
    if plan is None:
        plan = DecodePlan(kernel_layout)
    elif kernel_layout is not None and kernel_layout != plan.kernel_layout:
        raise ValueError(f"Pass `kernel_layout` or a `plan`, not both. Received: kernel_layout={kernel_layout!r}, "
                         f"plan={plan!r}")
    sampler = _method(sampler, beam_size, length_penalty)
    if isinstance(sampler, BeamSampler):
        plan = DecodePlan(in_place_cache_writes=plan.in_place_cache_writes, cache_segments=plan.cache_segments)
    architecture = model.config.architecture
    if architecture == "seq2seq":
        return _seq2seq_fn(model, max_new_tokens, sampler, end_id, plan)
    if architecture == "causal_lm":
        return _causal_fn(model, max_new_tokens, sampler, end_id, plan)
    raise ValueError(f"Decoding needs a seq2seq or causal_lm model. Received architecture={architecture!r}")


def _as_ids(token_ids, vocabulary_size):
    """`token_ids` as a checked `(B, L)` int32 numpy array.

    Checked and padded in numpy: each eager TensorFlow op costs as much as a few decode
    steps (docs/performance.md). Out-of-range ids are
    an error here: under XLA a gather clamps them to the table's edge silently.
    """
    ids = token_ids.numpy() if tf.is_tensor(token_ids) else np.asarray(token_ids)
    if ids.dtype.kind not in "iu":
        raise ValueError(f"`token_ids` must be integer ids. Received: token_ids of dtype {ids.dtype}")
    if ids.ndim != 2:
        raise ValueError(f"`token_ids` must be 2-D, (batch, length). Received: token_ids of shape {ids.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= vocabulary_size):
        raise ValueError(f"`token_ids` must lie in [0, vocabulary_size={vocabulary_size}). "
                         f"Received: ids from {ids.min()} to {ids.max()}")
    return ids.astype(np.int32, copy=False)


def generate_ids(model, token_ids, max_new_tokens=32, sampler=None, beam_size=None, length_penalty=0.6,
                 jit_compile=True, end_id=END_ID, plan=None, prefill_jit_compile=None):
    """Decode from a `Seq2SeqTransformer` (token_ids = source ids) or a `CausalLM` (token_ids = right-padded prompts).

    Returns new ids `(B, max_new_tokens)` int32; after a row's end token (id 3) the rest is padding (0).
    Greedy by default; pass a `Sampler` for temperature/top-k/top-p sampling, or `beam_size` (or a
    `BeamSampler`) for beam search with the GNMT `length_penalty`.

    XLA is on by default: it makes batch-1 decoding several times faster on CPU (docs/performance.md).
    Inputs are right-padded to a multiple of 16 tokens, and batches to `batch_bucket(B)` rows (copies of the
    first row, dropped from the result), so that XLA compiles a handful of shapes, not one per length or
    batch size (each compilation takes seconds and stays in memory). A batch of one under XLA compiles its
    own function whose matmuls read the weights in the compute dtype but multiply and sum in float32
    (`decode_fn`'s `kernel_layout`): a bfloat16 model can then decode a prompt alone slightly differently from
    the same prompt in a batch.

    `plan` (a `generation.plan.DecodePlan`) overrides that choice of fast forms; by default, under XLA,
    `DecodePlan("rows" or "halves", in_place_cache_writes=True)`, without it `DecodePlan()`.

    `prefill_jit_compile` (causal LMs, with `jit_compile`): False runs the prompt's pass outside XLA, in
    TensorFlow's graph runtime, and only the decode loop under XLA. XLA's CPU backend multiplies bfloat16 at
    about the float32 rate, while the graph runtime's oneDNN matmuls use the CPU's bfloat16 units: a bfloat16
    model's long prompts are read faster so (`CausalLM.generate` chooses it by its dtype policy). The same
    tokens either way, up to the order of the prompt pass's float sums. None (default): as `jit_compile`.
    """
    check_int("max_new_tokens", max_new_tokens)
    check_int("beam_size", beam_size, allow_none=True)
    prefill_jit_compile = _check_prefill_jit_compile(prefill_jit_compile, jit_compile, model.config.architecture)
    sampler = _method(sampler, beam_size, length_penalty)
    beam = isinstance(sampler, BeamSampler)
    token_ids = _as_ids(token_ids, model.config.vocabulary_size)  # (B, L) int32
    limit = model.config.max_sequence_length
    architecture = model.config.architecture
    if architecture == "seq2seq":
        if max_new_tokens > limit and model.config.position == "learned":
            raise ValueError(f"`max_new_tokens`={max_new_tokens} exceeds max_sequence_length={limit}.")
        if token_ids.shape[1] > limit:
            warnings.warn(f"Source of {token_ids.shape[1]} tokens truncated to max_sequence_length={limit}.")
            token_ids = token_ids[:, :limit]
    elif architecture == "causal_lm":
        if token_ids.shape[1] + max_new_tokens > limit:
            raise ValueError(
                f"Prompt of {token_ids.shape[1]} tokens + max_new_tokens={max_new_tokens} exceeds "
                f"max_sequence_length={limit}; shorten the prompt or ask for fewer tokens."
            )
        if not (token_ids != PAD_ID).any(axis=1).all():
            raise ValueError("Every prompt needs at least one token; received an empty prompt.")
    rows = token_ids.shape[0]
    if jit_compile:
        length = token_ids.shape[1]
        bucket = -(-length // 16) * 16
        if architecture == "causal_lm":
            bucket = min(bucket, limit - max_new_tokens)
        # And the batch: copies of the first row up to `batch_bucket` rows, sliced off the result.
        extra = batch_bucket(rows) - rows if rows else 0
        if bucket > length or extra:
            token_ids = np.pad(token_ids, [[0, 0], [0, max(bucket - length, 0)]])
            token_ids = np.concatenate([token_ids, np.repeat(token_ids[:1], extra, axis=0)], axis=0)  # (B', L')
    if plan is None:
        # Under XLA, kernels laid out for the decode loop (a batch of one gets its own compiled function), and
        # cache writes that cost O(new tokens), not O(cache size).
        kernel_layout = None
        if jit_compile and not beam:
            kernel_layout = "rows" if token_ids.shape[0] == 1 else "halves"
        plan = DecodePlan(kernel_layout, in_place_cache_writes=jit_compile)
    if plan.kernels is not None:
        raise ValueError("`plan` must not hold prepared kernels: `generate_ids` lays them out inside the compiled "
                         f"function. Received: plan={plan!r}")
    if beam:
        plan = DecodePlan(in_place_cache_writes=plan.in_place_cache_writes, cache_segments=plan.cache_segments)
    # What XLA compiles: nothing, the whole function, or only its loop (the prompts' pass in the graph runtime).
    compiled = "loop" if jit_compile and not prefill_jit_compile else jit_compile
    key = (architecture, max_new_tokens, sampler.key(), compiled, end_id, *plan.key())

    def make():
        if compiled == "loop":  # a graph function around the XLA loop
            run = _xla_loop_causal_fn(model, max_new_tokens, sampler, end_id, plan)
            return tf.function(run, input_signature=[_ids_spec()], reduce_retracing=True)
        run = decode_fn(model, max_new_tokens, sampler, end_id=end_id, plan=plan)
        return tf.function(run, input_signature=[_ids_spec()], jit_compile=jit_compile, reduce_retracing=True)

    new_ids = cached_function(model, key, make)(token_ids)  # (B', max_new_tokens)
    return new_ids if new_ids.shape[0] == rows else new_ids[:rows]  # (B, max_new_tokens)


def batch_bucket(rows):
    """The batch size `generate_ids` compiles for under XLA: the next power of two up to 64, then a multiple of 64."""
    return 1 << (rows - 1).bit_length() if rows <= 64 else -(-rows // 64) * 64


def strip_after_end(ids):
    """Python lists of ids with the end token and everything after it removed."""
    rows = []
    for row in tf.convert_to_tensor(ids).numpy().tolist():
        if END_ID not in row:
            row = [t for t in row if t != PAD_ID]  # a row that never ended: its padding goes
        rows.append(cut_at_end(row, END_ID))
    return rows
