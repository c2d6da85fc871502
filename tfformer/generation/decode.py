"""The text tasks' decodes: the set-up (an encoder pass or a prompt's prefill, per-layer key/value caches) and a
`next` callback over `model.decode_step` (one token a step, on the cache) that a sampler's loop drives."""

import warnings

import numpy as np
import tensorflow as tf

from tfformer.checks import check_int
from tfformer.compat import untracked_holder
from tfformer.generation import samplers
from tfformer.generation.beam import BeamSampler
from tfformer.generation.plan import DecodePlan, check_kernel_layout, grown, native_bfloat16_on_this_cpu
from tfformer.layers.layer_utils import split_cache
from tfformer.tokens import END_ID, PAD_ID, START_ID, cut_at_end


def compiled_functions(model):
    """`{key: function}`: the decode functions made for `model`, kept on it out of Keras' sight."""
    return vars(untracked_holder(model, "generate_functions"))


def cached_function(model, key, make):
    """`make()`'s function, kept on `model` under `key` (`compiled_functions`)."""
    functions = compiled_functions(model)
    return functions[key] if key in functions else functions.setdefault(key, make())


def reset_compiled(model):
    """Drops the decode functions kept on `model`, traced before a change of it (its `compile` calls this)."""
    compiled_functions(model).clear()


def decode_next(model, *context, bias=None):
    """`Sampler.run`'s `next` over `model.decode_step(ids, cache, index, *context)`, `bias` `(V,)` added."""
    def next(ids, cache, index, plan=None):
        logits, cache = model.decode_step(ids, cache, index, *context, plan=plan)  # (B, 1, V)
        return (logits[:, -1, :] if bias is None else logits[:, -1, :] + bias), None, cache

    return next


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
        next = decode_next(model, tuple(tf.unstack(cross)), encoder_mask)
        return sampler.run(next, tf.zeros([batch, max_new_tokens], tf.int32), cache, 0, end_id, max_new_tokens,
                           ids=tf.fill([batch * beams, 1], START_ID), plan=step_plan)

    return run


def _causal_fn(model, max_new_tokens, sampler, end_id, plan, xla_loop=False):
    """A causal LM's decode: a prompt pass, then the loop. `xla_loop`: the pass in the graph runtime (stacked caches
    in the compute dtype, bfloat16 as `native_bfloat16_on_this_cpu` allows), the loop under XLA."""
    beams = sampler.beams

    def prefill(prompt_ids, plan, cache_dtype="float32"):  # -> lengths (B,), logits (B*K, V), per-layer caches
        batch, prompt_length = tf.shape(prompt_ids)[0], tf.shape(prompt_ids)[1]
        lengths = tf.reduce_sum(tf.cast(prompt_ids != PAD_ID, tf.int32), axis=1)  # (B,) right padding
        start = tf.reduce_min(lengths)  # the logits at the shortest prompt's last token
        slots = prompt_length + plan.first_segment(max_new_tokens)
        # The whole (static-width) prompt goes in, each row's beams adjacent: a slice to `start` would make XLA
        # compile once per prompt. The padding's slots stay masked until the loop's step there overwrites them.
        prompts = prompt_ids if beams == 1 else tf.repeat(prompt_ids, beams, axis=0)  # (B*K, P)
        cache = plan.layer_caches(model, batch * beams, slots, cache_dtype)
        logits, cache = model.decode_step(prompts, cache, 0, logits_index=start - 1, plan=plan)  # (B*K, 1, V)
        return lengths, logits[:, -1, :], cache

    def loop(prompt_ids, lengths, logits, cache, plan):  # -> new ids (B, N), each row's after its prompt
        tokens = tf.pad(prompt_ids, [[0, 0], [0, max_new_tokens]])  # (B, P + N)
        tokens = sampler.run(decode_next(model), tokens, cache, tf.reduce_min(lengths), end_id, max_new_tokens,
                             logits=logits, prompt_lengths=lengths, plan=plan, prefix=tf.shape(prompt_ids)[1])
        index = lengths[:, None] + tf.range(max_new_tokens)[None, :]  # (B, N)
        return tf.gather(tokens, index, batch_dims=1)

    def run(prompt_ids):
        step_plan = plan.prepared(model)  # kernels laid out once, before the loop
        return loop(prompt_ids, *prefill(prompt_ids, step_plan), step_plan)

    if not xla_loop:
        return run
    prefill_plan = DecodePlan(cache_segments=plan.cache_segments, native_bfloat16=native_bfloat16_on_this_cpu())

    @tf.function(jit_compile=True, reduce_retracing=True)
    def xla(prompt_ids, lengths, logits, cache):
        step_plan = plan.prepared(model)
        if step_plan.split_caches:
            # (B, 2, N, S, H) -> 2 x (B*N, S', H) float32 per layer, S' = split_slots(S): what the plan's own would be.
            cache = grown(tuple(split_cache(tf.cast(c, tf.float32)) for c in cache), tf.shape(cache[0])[-2])
        return loop(prompt_ids, lengths, logits, cache, step_plan)

    def run_xla_loop(prompt_ids):
        lengths, logits, cache = prefill(prompt_ids, prefill_plan, model.compute_dtype)
        state = (prompt_ids, lengths, logits, cache)
        if beams > 1:
            return xla(*state)
        # The loop's steps fill the columns after the shortest prompt's first new token, up to the longest prompt's
        # last one. Without any, the prompt's logits give every token: no decode step, no kernel layout.
        steps = tf.reduce_max(lengths) + max_new_tokens - (tf.reduce_min(lengths) + 1)
        return tf.cond(steps > 0, lambda: xla(*state), lambda: loop(*state, None))

    return run_xla_loop


def _method(sampler, beam_size, length_penalty, plan, kernel_layout=None, in_place_cache_writes=False):
    """The `Sampler` that decodes (a `beam_size`'s `BeamSampler`, else `samplers.get(sampler)`) and its plan: `plan` or
    `DecodePlan(kernel_layout, in_place_cache_writes)`, without a layout for beam search (it reorders caches)."""
    check_int("beam_size", beam_size, allow_none=True)
    sampler = BeamSampler(beam_size, length_penalty) if beam_size else samplers.get(sampler)
    beam = isinstance(sampler, BeamSampler)
    if plan is None:
        return sampler, DecodePlan(None if beam else kernel_layout, in_place_cache_writes=in_place_cache_writes)
    if beam and plan.kernel_layout is not None:
        plan = DecodePlan(in_place_cache_writes=plan.in_place_cache_writes, cache_segments=plan.cache_segments)
    return sampler, plan


def decode_fn(model, max_new_tokens, sampler=None, beam_size=None, length_penalty=0.6, end_id=END_ID,
              kernel_layout=None, plan=None):
    """The (untraced) decoding function `ids (B, L) int32 -> new ids (B, max_new_tokens)` of `model`, for any graph.

    `sampler`: a `Sampler` or what `samplers.get` takes; a `beam_size` takes `BeamSampler(beam_size,
    length_penalty)`. `end_id=-1` never stops early. `plan` (or `kernel_layout`, not both): the loop's fast forms,
    by default `DecodePlan(kernel_layout)`; a layout ("rows" for a batch of one, "halves") is for XLA only.
    """
    check_kernel_layout(kernel_layout)
    if plan is not None and kernel_layout not in (None, plan.kernel_layout):
        raise ValueError(f"Pass `kernel_layout` or a `plan`, not both. Received: kernel_layout={kernel_layout!r}, "
                         f"plan={plan!r}")
    sampler, plan = _method(sampler, beam_size, length_penalty, plan, kernel_layout)
    architecture = model.config.architecture
    if architecture not in ("seq2seq", "causal_lm"):
        raise ValueError(f"Decoding needs a seq2seq or causal_lm model. Received architecture={architecture!r}")
    return (_seq2seq_fn if architecture == "seq2seq" else _causal_fn)(model, max_new_tokens, sampler, end_id, plan)


def _checked(model, token_ids, max_new_tokens, jit_compile, prefill_jit_compile, plan):
    """`generate_ids`' checks. Returns `token_ids` as `(B, L)` int32 numpy, a seq2seq source cut to the model's length
    (checked in numpy, as an eager op costs a few decode steps; ids out of range are an error, which XLA's gather would
    clamp silently), and what XLA compiles: nothing (False), all (True) or "loop" (a causal LM's loop alone)."""
    check_int("max_new_tokens", max_new_tokens)
    config = model.config
    compiled = jit_compile
    if prefill_jit_compile is False and jit_compile and config.architecture == "causal_lm":
        compiled = "loop"
    elif prefill_jit_compile is not None and prefill_jit_compile is not bool(jit_compile):
        raise ValueError("`prefill_jit_compile` must be a bool or None (True needs `jit_compile=True`; False with it "
                         f"is for causal LMs). Received: prefill_jit_compile={prefill_jit_compile!r}, "
                         f"jit_compile={jit_compile!r}, architecture={config.architecture!r}")
    if plan is not None and plan.kernels is not None:
        raise ValueError("`plan` must not hold prepared kernels: `generate_ids` lays them out inside the compiled "
                         f"function. Received: plan={plan!r}")
    ids = token_ids.numpy() if tf.is_tensor(token_ids) else np.asarray(token_ids)
    if ids.dtype.kind not in "iu" or ids.ndim != 2:
        raise ValueError("`token_ids` must be 2-D integer ids, (batch, length). Received: token_ids of dtype "
                         f"{ids.dtype} and shape {ids.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= config.vocabulary_size):
        raise ValueError(f"`token_ids` must lie in [0, vocabulary_size={config.vocabulary_size}). "
                         f"Received: ids from {ids.min()} to {ids.max()}")
    limit = config.max_sequence_length
    if config.architecture == "seq2seq":
        if max_new_tokens > limit and config.position == "learned":
            raise ValueError(f"`max_new_tokens`={max_new_tokens} exceeds max_sequence_length={limit}.")
        if ids.shape[1] > limit:
            warnings.warn(f"Source of {ids.shape[1]} tokens truncated to max_sequence_length={limit}.")
            ids = ids[:, :limit]
    elif config.architecture == "causal_lm":
        if ids.shape[1] + max_new_tokens > limit:
            raise ValueError(f"Prompt of {ids.shape[1]} tokens + max_new_tokens={max_new_tokens} exceeds "
                             f"max_sequence_length={limit}; shorten the prompt or ask for fewer tokens.")
        real = ids != PAD_ID
        rows = sorted(set(np.nonzero(real[:, 1:] & ~real[:, :-1])[0].tolist()))  # a token after padding
        if rows:  # a prompt's length is its count of non-padding ids
            raise ValueError(f"`token_ids` must be right-padded: padding (id {PAD_ID}) only after a prompt's tokens. "
                             f"Received left or inner padding in rows {rows}")
    kind = "prompt" if config.architecture == "causal_lm" else "source"
    if not (ids != PAD_ID).any(axis=1).all():
        raise ValueError(f"Every {kind} needs at least one token; received an empty {kind}.")
    return ids.astype(np.int32, copy=False), compiled


def batch_bucket(rows):
    """The batch size `generate_ids` compiles for under XLA: the next power of two up to 64, then a multiple of 64."""
    return 1 << (rows - 1).bit_length() if rows <= 64 else -(-rows // 64) * 64


def _bucketed(ids, max_new_tokens, config):
    """`ids` `(B, L)` right-padded to a multiple of 16 tokens (a prompt to at most what leaves room for
    `max_new_tokens`) and to `batch_bucket(B)` rows (copies of the first): XLA then compiles a handful of shapes."""
    rows, length = ids.shape
    bucket = -(-length // 16) * 16
    if config.architecture == "causal_lm":
        bucket = min(bucket, config.max_sequence_length - max_new_tokens)
    extra = batch_bucket(rows) - rows if rows else 0
    if bucket > length or extra:
        ids = np.pad(ids, [[0, 0], [0, max(bucket - length, 0)]])
        ids = np.concatenate([ids, np.repeat(ids[:1], extra, axis=0)], axis=0)  # (B', L')
    return ids


def generate_ids(model, token_ids, max_new_tokens=32, sampler=None, beam_size=None, length_penalty=0.6,
                 jit_compile=True, end_id=END_ID, plan=None, prefill_jit_compile=None):
    """New ids `(B, max_new_tokens)` int32 of a `Seq2SeqTransformer` (`token_ids`: sources) or a `CausalLM`
    (right-padded prompts), padding (0) after a row's `end_id`; `sampler`, `beam_size`, `plan` as `decode_fn`'s.

    Under XLA (`jit_compile`, several times faster at batch 1 on CPU) inputs are padded to a multiple of 16 tokens
    and `batch_bucket(B)` rows, so that XLA compiles a handful of shapes; a batch of one gets its own function,
    whose matmuls sum in float32 ("rows"), so a bfloat16 model may decode a prompt alone slightly differently.
    `prefill_jit_compile=False` (causal LMs) reads prompts in the graph runtime, whose oneDNN matmuls use a CPU's
    bfloat16 units, before the XLA loop: the same tokens up to the order of float sums. None: as `jit_compile`.
    """
    token_ids, compiled = _checked(model, token_ids, max_new_tokens, jit_compile, prefill_jit_compile, plan)
    rows = token_ids.shape[0]
    token_ids = _bucketed(token_ids, max_new_tokens, model.config) if jit_compile else token_ids  # (B', L')
    # By default, under XLA: kernels laid out for the loop (a batch of one its own), cache writes of O(new tokens).
    layout = None if not jit_compile else "rows" if token_ids.shape[0] == 1 else "halves"
    sampler, plan = _method(sampler, beam_size, length_penalty, plan, layout, in_place_cache_writes=jit_compile)
    key = (model.config.architecture, max_new_tokens, sampler.key(), compiled, end_id, *plan.key())

    def make():  # `decode_fn`'s `_method` keeps the sampler and plan made here
        spec = [tf.TensorSpec([None, None], tf.int32)]
        if compiled == "loop":  # a graph function around the XLA loop
            run = _causal_fn(model, max_new_tokens, sampler, end_id, plan, xla_loop=True)
            return tf.function(run, input_signature=spec, reduce_retracing=True)
        run = decode_fn(model, max_new_tokens, sampler, end_id=end_id, plan=plan)
        return tf.function(run, input_signature=spec, jit_compile=compiled, reduce_retracing=True)

    new_ids = cached_function(model, key, make)(token_ids)  # (B', max_new_tokens)
    return new_ids if new_ids.shape[0] == rows else new_ids[:rows]  # (B, max_new_tokens)


def strip_after_end(ids):
    """Python lists of ids without the end token and what follows it (a row that never ended: without padding)."""
    rows = tf.convert_to_tensor(ids).numpy().tolist()
    return [cut_at_end(row, END_ID) if END_ID in row else [t for t in row if t != PAD_ID] for row in rows]
