"""Training throughput: tfformer (float32 and mixed bfloat16) vs keras-hub (float32) and PyTorch, same shapes.

Workloads (the issue's):
- seq2seq: vocab 8192, hidden 256, 4 heads, intermediate 1024, 3+3 layers, length 64, batch 64 (target tokens/s)
- lm: GPT-2-shaped, vocab 8192, 4 layers, hidden 256, 4 heads, intermediate 1024, length 128, batch 32,
  GPT-2's tanh GELU

Every Keras system trains with Adam(1e-4) and tfformer's loss (`training.MaskedSparseCrossEntropy`); tfformer's
systems with its `training.FusedAdam` (the same update as one kernel per variable, what its recipes use),
keras-hub's with `keras.optimizers.Adam`. tfformer's models compute that loss fused with their tied output
projection (`models.TransformerModel.train_step`, the loss's default `fuse_projection=True`), in two micro-batches
that TensorFlow runs side by side (`compile(..., micro_batches=2)`, `MICRO_BATCHES`); keras-hub's models, plain
`keras.Model`s, compute it on their logits. These systems compile no metrics.

Also timed, each library as its documentation compiles it (rows ending in "+metrics", their ratios against
"keras-hub float32 +metrics"): tfformer with its recipes' loss and metrics (`MaskedSparseCrossEntropy`,
`MaskedAccuracy`, `Perplexity`; padding masked by its id); keras-hub with its tasks' defaults
(`CausalLM.compile`, which `Seq2SeqLM` inherits: Keras' `SparseCategoricalCrossentropy(from_logits=True)` and a
weighted `SparseCategoricalAccuracy`, the padding mask as sample weights, as keras-hub's preprocessors hand it
over), the LM as keras-hub's own `GPT2CausalLM`. Both keep the benchmark's optimizers.
Steps are timed one `train_on_batch` at a time (not whole `fit()` calls; see the pitfalls note on tf.data).
FLOPs per step = 6 * N_params_non_embedding * tokens (+ 6 * V * d * predicted tokens for the output projection)
+ 12 * layers * T^2 * d * batch for attention scores and mixing (forward 2x, backward 4x), counted for every
attention sub-layer; achieved GFLOP/s is reported against the float32 and bfloat16 matmul limits (2048^3,
`common.matmul_limit_calls`) timed in the same interleaved rounds as the systems: `fraction_of_f32_limit`, and
`fraction_of_own_limit` against the limit of the dtype the row's matmuls run in (bfloat16 for the bfloat16 rows).

Also timed, rows ending in "+cpu_threads": tfformer float32 and bfloat16 as above, in a worker process
(`benchmarks.keras_worker`) that gave each micro-batch its own share of the cores first
(`training.configure_cpu_threads(MICRO_BATCHES)`: one intra-op thread per micro-batch on 2 cores), against
"keras-hub float32" in this process with TensorFlow's default threads (keras-hub's faster setting). The
setting is process-wide, hence the process of their own; it is timed interleaved with the rest, as the
PyTorch worker is.

Also timed, interleaved with the systems: the matmul floor of each workload, in float32 and bfloat16
(`matmul_floor`): every matmul of one training step, forward and both gradients, at its shape and nothing
else, in one tf.function. Its `ratio_vs_keras_hub` is a ceiling: the most any system could reach in that run
if everything but its matmuls (norms, dropout, softmax, loss, optimizer, casts) were free. `peak_rss_mb` is the
process's peak after each system's first training step, before the floors' operands exist;
`peak_rss_mb_with_floors` the peak at the end.

Which rows the goals are read from (issue 8: tfformer float32 >= 1.25x and bfloat16 >= 2x keras-hub float32):
the "+metrics" rows. The issue compares tfformer with "the keras-hub equivalent" of each workload, and that is
keras-hub as its documentation compiles it: its own loss and metrics, in the same process, with TensorFlow's
default threads. Part of what they compare is the loss and the metrics: keras-hub's defaults (Keras' loss and a
weighted accuracy on the logits) cost its step more than tfformer's two metrics, read from its fused loss pass,
cost tfformer's (docs/performance.md, "Training: fused projection and loss"). The strict rows
hand keras-hub tfformer's loss (an XLA-fused cross-entropy, part of tfformer's work) and compile no metrics, so
they compare tfformer with a keras-hub/tfformer hybrid; the "+cpu_threads" rows need a process-wide setting.
Both are reported beside the goal (the `goal` lines' `other_readings`), so a run shows all three.

PyTorch rows, when an interpreter with torch + transformers exists (`benchmarks.torch_worker`): the LM as
transformers' `GPT2LMHeadModel`, the seq2seq model as `torch.nn.Transformer` with keras-hub's layout (learned
positions, untied output projection), both with dropout 0.1, `F.cross_entropy` on float32 logits and
`torch.optim.Adam(fused=True)`, float32 and under `torch.autocast` bfloat16, on the same token ids, with as many
intra-op threads as TensorFlow's default (the cores this process may use), timed in their worker process and
interleaved with the rest. Their `peak_rss_mb` is the worker's, their FLOPs tfformer's model's of the same shape;
`train_<workload>_vs_pytorch` lines give tfformer / PyTorch per dtype. The PyTorch bfloat16 row runs only on CPUs
with bfloat16 instructions (`avx512_bf16`/`amx_bf16`): elsewhere PyTorch emulates them (82 s a step of the
seq2seq workload on an AMD Zen 2, 190 times its float32 step) and the run says so.
With `--systems peers` (smoke runs only) a run times only the PyTorch rows and the rows they are read against
(tfformer float32 and bfloat16, keras-hub float32) and reads no goals.

    python -m benchmarks.training [--smoke] [--workload seq2seq|lm] [--torch-python PYTHON] [--systems all|peers]
"""

import argparse
import contextlib

import keras
import keras_hub
import numpy as np
import tensorflow as tf

from benchmarks import common, keras_worker, torch_worker
from tfformer import models, training
from tfformer.generation.plan import native_bfloat16_on_this_cpu


def _seq2seq_shape(smoke):
    if smoke:
        return dict(vocab=64, hidden=16, heads=2, intermediate=32, layers=1, length=8, batch=4)
    return dict(vocab=8192, hidden=256, heads=4, intermediate=1024, layers=3, length=64, batch=64)


def _lm_shape(smoke):
    if smoke:
        return dict(vocab=64, hidden=16, heads=2, intermediate=32, layers=1, length=8, batch=4)
    return dict(vocab=8192, hidden=256, heads=4, intermediate=1024, layers=4, length=128, batch=32)


MICRO_BATCHES = 2  # tfformer's `compile(micro_batches=...)` for these shapes on a CPU (see its docstring)


def _compile(model, optimizer, **kwargs):
    model.compile(optimizer=optimizer, loss=training.MaskedSparseCrossEntropy(0.0), jit_compile=False, **kwargs)
    return model


def with_recipe_metrics(model):
    """Compiled as tfformer's recipes compile (`recipes.translation.compile_model`, `recipes.language_model`):
    its loss and the two metrics they report; the benchmark's optimizer, and its micro-batches (2: what
    `recipes.language_model.default_micro_batches` picks for these batches on a CPU)."""
    model.compile(optimizer=training.FusedAdam(1e-4), loss=training.MaskedSparseCrossEntropy(0.0),
                  metrics=[training.MaskedAccuracy(), training.Perplexity()], jit_compile=False,
                  micro_batches=MICRO_BATCHES)
    return model


def with_task_defaults(model):
    """Compiled with keras-hub's task defaults (`CausalLM.compile`, inherited by `Seq2SeqLM`): Keras'
    `SparseCategoricalCrossentropy(from_logits=True)` and a weighted `SparseCategoricalAccuracy`; the benchmark's
    optimizer instead of its AdamW(2e-5), and no XLA (keras-hub's faster setting on this CPU)."""
    model.compile(optimizer=keras.optimizers.Adam(1e-4),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  weighted_metrics=[keras.metrics.SparseCategoricalAccuracy()], jit_compile=False)
    return model


def tfformer_seq2seq(s):
    config = models.TransformerConfig(vocabulary_size=s["vocab"], hidden_dim=s["hidden"], num_heads=s["heads"],
                                      intermediate_dim=s["intermediate"], num_encoder_layers=s["layers"],
                                      num_decoder_layers=s["layers"], dropout=0.1, max_sequence_length=s["length"])
    return _compile(models.build_seq2seq(config), training.FusedAdam(1e-4), micro_batches=MICRO_BATCHES)


def keras_hub_seq2seq(s):
    enc_in = keras.Input((None,), dtype="int32", name="encoder_token_ids")
    dec_in = keras.Input((None,), dtype="int32", name="decoder_token_ids")
    x = keras_hub.layers.TokenAndPositionEmbedding(s["vocab"], s["length"], s["hidden"], mask_zero=True)(enc_in)
    for _ in range(s["layers"]):
        x = keras_hub.layers.TransformerEncoder(s["intermediate"], s["heads"], dropout=0.1)(x)
    y = keras_hub.layers.TokenAndPositionEmbedding(s["vocab"], s["length"], s["hidden"], mask_zero=True)(dec_in)
    for _ in range(s["layers"]):
        y = keras_hub.layers.TransformerDecoder(s["intermediate"], s["heads"], dropout=0.1)(y, x)
    logits = keras.layers.Dense(s["vocab"], dtype="float32")(y)
    model = keras.Model({"encoder_token_ids": enc_in, "decoder_token_ids": dec_in}, logits)
    return _compile(model, keras.optimizers.Adam(1e-4))


def tfformer_lm(s):
    config = models.TransformerConfig(architecture="causal_lm", vocabulary_size=s["vocab"], hidden_dim=s["hidden"],
                                      num_heads=s["heads"], intermediate_dim=s["intermediate"], num_encoder_layers=0,
                                      num_decoder_layers=s["layers"], dropout=0.1, max_sequence_length=s["length"],
                                      activation="gelu_approximate", norm_first=True, position="learned",
                                      scale_embeddings=False)
    return _compile(models.build_causal_lm(config), training.FusedAdam(1e-4), micro_batches=MICRO_BATCHES)


def _gpt2_backbone(s):
    return keras_hub.models.GPT2Backbone(vocabulary_size=s["vocab"], num_layers=s["layers"], num_heads=s["heads"],
                                         hidden_dim=s["hidden"], intermediate_dim=s["intermediate"],
                                         max_sequence_length=s["length"], dropout=0.1)


def keras_hub_causal_lm(s):
    """keras-hub's own task model; `with_task_defaults` compiles it as `GPT2CausalLM.compile()` would."""
    return with_task_defaults(keras_hub.models.GPT2CausalLM(backbone=_gpt2_backbone(s), preprocessor=None))


def keras_hub_lm(s):
    backbone = _gpt2_backbone(s)
    inputs = dict(backbone.input)  # {"token_ids": ..., "padding_mask": ...}; the list order is not the names'
    hidden = backbone(inputs)
    logits = backbone.token_embedding(hidden, reverse=True)
    model = keras.Model(inputs, keras.layers.Activation("linear", dtype="float32")(logits))
    return _compile(model, keras.optimizers.Adam(1e-4))


def _flops(s, attention_layers, dense_params, predicted_tokens, tokens):
    attention = 12 * attention_layers * s["length"] ** 2 * s["hidden"] * s["batch"]
    return 6 * dense_params * tokens + 6 * s["vocab"] * s["hidden"] * predicted_tokens + attention


def _dense_params(model, vocab):
    """Parameters that multiply every token once: everything but embedding tables and the vocab projection."""
    return sum(int(np.prod(w.shape)) for w in model.trainable_weights
               if "embedding" not in w.path and vocab not in w.shape)


def step_matmuls(s, workload):
    """`(batch, M, K, N)` of every forward matmul in one training step of `workload`; batch None for a 2-D one.

    Dense layers `(B*T, in) x (in, out)` (fused q/k/v; cross-attention: q, fused k/v, output); per attention
    sub-layer the scores `(B*N, T, H) x (B*N, H, T)` and the mixing `(B*N, T, T) x (B*N, T, H)`; the vocabulary
    projection `(B*T, d) x (d, V)`. Each has two gradient matmuls of the same FLOPs (dx = dy w^T, dw = x^T dy),
    so `6 * sum(M * K * N * batch)` is `_flops` without the bias and LayerNorm parameters.
    """
    rows, d, i, t = s["batch"] * s["length"], s["hidden"], s["intermediate"], s["length"]
    heads, head_dim = s["batch"] * s["heads"], s["hidden"] // s["heads"]
    attention = [(heads, t, head_dim, t), (heads, t, t, head_dim)]
    self_attention = [(None, rows, d, 3 * d)] + attention + [(None, rows, d, d)]
    cross_attention = [(None, rows, d, d), (None, rows, d, 2 * d)] + attention + [(None, rows, d, d)]
    feedforward = [(None, rows, d, i), (None, rows, i, d)]
    if workload == "lm":
        blocks = (self_attention + feedforward) * s["layers"]
    else:
        encoder_blocks = (self_attention + feedforward) * s["layers"]
        blocks = encoder_blocks + (self_attention + cross_attention + feedforward) * s["layers"]
    return blocks + [(None, rows, d, s["vocab"])]


def floor_operands(shapes, dtype, seed=0):
    """`(x, w, dy)` for each `(batch, M, K, N)` of `shapes`: random `(M, K)`, `(K, N)`, `(M, N)`, the batch in front."""
    rng = tf.random.Generator.from_seed(seed)
    operands = []
    for batch, m, k, n in shapes:
        lead = () if batch is None else (batch,)
        operands.append(tuple(tf.cast(rng.normal(lead + shape), dtype) for shape in ((m, k), (k, n), (m, n))))
    return operands


def floor_matmuls(x, w, dy):
    """A matmul and its two gradients: `y = x w`, `dx = dy w^T`, `dw = x^T dy`."""
    return tf.matmul(x, w), tf.matmul(dy, w, transpose_b=True), tf.matmul(x, dy, transpose_a=True)


def matmul_floor(shapes, dtype):
    """A tf.function running every matmul of `shapes` (`step_matmuls`) forward and both gradients, nothing else.

    Operands are random and made once; the matmuls are independent, so TF may run two at a time as it does
    in a training step. It returns the sum of each product's first element, so that every product is computed
    but none outlives its step (a step's activations do not either). Its time is a step's lower bound at this
    machine's matmul speed for these shapes.
    """
    operands = floor_operands(shapes, dtype)

    @tf.function
    def run():
        products = [p for x, w, dy in operands for p in floor_matmuls(x, w, dy)]
        return tf.add_n([tf.reshape(p, [-1])[0] for p in products])

    return run


def torch_dtypes():
    """The dtypes of the PyTorch rows: bfloat16 only where the CPU has bfloat16 instructions (said otherwise)."""
    if native_bfloat16_on_this_cpu():
        return ("float32", "bfloat16")
    print("PyTorch bfloat16 rows skipped: this CPU has no bfloat16 instructions (avx512_bf16, amx_bf16), so "
          "PyTorch would emulate them", flush=True)
    return ("float32",)


def run(workload, smoke=False, repeats=5, steps=3, torch_python=None, systems="all"):
    """The rows of `workload` ("seq2seq" or "lm"); with `systems="peers"` only the PyTorch rows and the ones they
    are read against (the strict tfformer rows, keras-hub float32), no floors, "+metrics", "+cpu_threads" or goals."""
    peers_only = systems == "peers"
    rng = np.random.default_rng(0)
    if workload == "seq2seq":
        s = _seq2seq_shape(smoke)
        ids = rng.integers(4, s["vocab"], size=(s["batch"], s["length"])).astype("int32")
        x, y = {"encoder_token_ids": ids, "decoder_token_ids": ids}, ids
        builders = {"tfformer float32": (tfformer_seq2seq, "float32"),
                    "tfformer bfloat16": (tfformer_seq2seq, "mixed_bfloat16"),
                    "keras-hub float32": (keras_hub_seq2seq, "float32")}
        documented = {"tfformer": lambda s: with_recipe_metrics(tfformer_seq2seq(s)),
                      "keras-hub": lambda s: with_task_defaults(keras_hub_seq2seq(s))}
        # Encoder weights see the source tokens, decoder weights the target tokens: same count on both sides.
        tokens, predicted, attention_layers = ids.size, ids.size, 3 * s["layers"]
        torch_arrays = {"source": ids, "target": ids, "labels": ids}
    else:
        s = _lm_shape(smoke)
        ids = rng.integers(4, s["vocab"], size=(s["batch"], s["length"] + 1)).astype("int32")
        x, y = {"token_ids": ids[:, :-1]}, ids[:, 1:]
        builders = {"tfformer float32": (tfformer_lm, "float32"), "tfformer bfloat16": (tfformer_lm, "mixed_bfloat16"),
                    "keras-hub float32": (keras_hub_lm, "float32")}
        documented = {"tfformer": lambda s: with_recipe_metrics(tfformer_lm(s)), "keras-hub": keras_hub_causal_lm}
        tokens = predicted = y.size
        attention_layers = s["layers"]
        torch_arrays = {"inputs": x["token_ids"], "labels": y}
    # Each library as its documentation compiles it, beside the strict systems above.
    if not peers_only:
        builders.update({"tfformer float32 +metrics": (documented["tfformer"], "float32"),
                         "tfformer bfloat16 +metrics": (documented["tfformer"], "mixed_bfloat16"),
                         "keras-hub float32 +metrics": (documented["keras-hub"], "float32")})
    # keras-hub's preprocessors hand its tasks the labels' padding mask as sample weights (no padding here).
    sample_weight = {"keras-hub float32 +metrics": np.ones(y.shape, "float32")}
    # The PyTorch worker builds its model while the Keras systems trace.
    # As many intra-op threads as TensorFlow's default here: the cores this process may use.
    spec = {"shape": s, "steps": steps, "threads": common.cores()}
    # tfformer with one intra-op thread per micro-batch (`training.configure_cpu_threads`), a process-wide
    # setting: in a worker process of its own, which builds its systems meanwhile too.
    threaded = contextlib.nullcontext()  # none with --systems peers
    if not peers_only:
        threaded = keras_worker.start(f"train_{workload}", dict(spec, micro_batches=MICRO_BATCHES), ids)
    with threaded, torch_worker.start(f"train_{workload}", spec, torch_arrays, torch_python) as pending:
        built = {}
        for name, (build, policy) in builders.items():
            keras.config.set_dtype_policy(policy)
            model = build(s)
            # The optimizer's variables before the first step (as tfformer's models make them): made while it
            # traces, they would make TensorFlow trace keras-hub's step twice.
            model.optimizer.build(model.trainable_variables)
            inputs = dict(x)
            if name.startswith("keras-hub") and workload == "lm":
                inputs["padding_mask"] = np.ones_like(x["token_ids"], bool)
            model.train_on_batch(inputs, y, sample_weight=sample_weight.get(name))  # trace
            built[name] = (model, inputs)
        keras.config.set_dtype_policy("float32")
        systems_rss = common.peak_rss_mb()  # the systems after a training step each; before the floors' operands

        def step(name):
            model, inputs = built[name]
            weights = sample_weight.get(name)
            return common.timed(lambda: [model.train_on_batch(inputs, y, sample_weight=weights) for _ in range(steps)])

        callables = {name: step(name) for name in built}
        if not peers_only:
            for dtype in ("float32", "bfloat16"):
                floor = matmul_floor(step_matmuls(s, workload), dtype)
                floor_steps = common.timed(lambda floor=floor: [floor().numpy() for _ in range(steps)])
                callables[f"matmul floor {dtype}"] = floor_steps
            threaded_worker = threaded.worker
            if threaded_worker is None:
                raise RuntimeError(threaded.skipped)
            threaded_worker.wait_ready()  # its failure is an error, not a skip: these are tfformer's own systems
            for dtype in ("float32", "bfloat16"):
                callables[f"tfformer {dtype} +cpu_threads"] = lambda dtype=dtype: threaded_worker.run(dtype)
        worker = pending.ready()
        if worker is not None:
            for dtype in torch_dtypes():
                callables[f"pytorch {dtype}"] = lambda dtype=dtype: worker.run(dtype)
        limit_size = common.limit_size(smoke)
        callables.update(common.matmul_limit_calls(limit_size))
        times = common.interleaved(callables, repeats=1 if smoke else repeats, warmup=1, self_timed=True)
    limits = common.matmul_limits(times, limit_size)
    limit32, limit16 = limits["float32"], limits["bfloat16"]
    rows = []
    flops = {name: _flops(s, attention_layers, _dense_params(model, s["vocab"]), predicted, tokens)
             for name, (model, _) in built.items()}
    for name, values in times.items():
        seconds = common.median(values) / steps
        baseline = "keras-hub float32 +metrics" if name.endswith("+metrics") else "keras-hub float32"
        base = common.median(times[baseline]) / steps
        per_round = common.paired_ratio(values, times[baseline])
        rss = {"peak_rss_mb": round(systems_rss), "peak_rss_mb_with_floors": round(common.peak_rss_mb())}
        extra = {}
        if name.startswith("pytorch"):  # its own process's peak; the FLOPs of tfformer's model of the same shape
            rss = {"peak_rss_mb": worker.peak_rss_mb, "peak_rss_mb_with_floors": worker.peak_rss_mb}
            extra = {"torch": worker.info["torch"], "parameters": worker.info["parameters"],
                     "threads": worker.info["threads"]}
        elif name.endswith("+cpu_threads"):  # the worker's own peak, both its models built
            rss = {"peak_rss_mb": threaded_worker.peak_rss_mb, "peak_rss_mb_with_floors": threaded_worker.peak_rss_mb}
            extra = {key: threaded_worker.info[key] for key in ("parameters", "micro_batches", "intra_op_threads")}
        elif name in built:
            extra = {"parameters": built[name][0].count_params()}
            if hasattr(built[name][0], "micro_batches"):  # tfformer's
                extra["micro_batches"] = built[name][0].micro_batches
        step_flops = flops.get(name, flops["tfformer float32"])  # a floor row: the same FLOPs
        gflops = step_flops / seconds / 1e9
        rows.append(common.emit({
            "bench": f"train_{workload}", "system": name, "tokens_per_s": round(predicted / seconds, 1),
            "ms_per_step": round(seconds * 1000, 1), "gflops": common.significant(gflops),
            "fraction_of_f32_limit": round(gflops / limit32, 2),
            "fraction_of_own_limit": round(gflops / (limit16 if "bfloat16" in name else limit32), 2),
            "f32_limit_gflops": common.significant(limit32), "bf16_limit_gflops": common.significant(limit16), **rss,
            "ratio_vs_keras_hub": round(base / seconds, 2), "baseline": baseline,
            "per_round": [common.significant(x) for x in per_round],
            **extra,
        }))
    for dtype in ("float32", "bfloat16"):
        if f"pytorch {dtype}" in times:
            ours, theirs = times[f"tfformer {dtype}"], times[f"pytorch {dtype}"]
            rows.append(common.emit({
                "bench": f"train_{workload}_vs_pytorch", "dtype": dtype,
                "ratio": common.significant(common.median(theirs) / common.median(ours)),
                "per_round": [common.significant(x) for x in common.paired_ratio(ours, theirs)]}))
    if peers_only:
        return rows
    # The training goals, read from the rows that compile each library as its documentation does (see
    # "Which rows the goals are read from" above); the other two readings beside them.
    ratio = {r["system"]: common.median(times[r["baseline"]]) / common.median(times[r["system"]])
             for r in rows if "system" in r}
    for dtype, target in (("float32", 1.25), ("bfloat16", 2)):
        rows.append(common.goal(
            f"training {workload} {dtype} >= {target}x keras-hub float32", ratio[f"tfformer {dtype} +metrics"], target,
            reading="+metrics", rows=[f"tfformer {dtype} +metrics", "keras-hub float32 +metrics"],
            other_readings={"strict": common.significant(ratio[f"tfformer {dtype}"]),
                            "+cpu_threads": common.significant(ratio[f"tfformer {dtype} +cpu_threads"])}))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--workload", choices=["seq2seq", "lm"], action="append")
    torch_worker.add_python_option(parser, "train_lm")  # train_seq2seq asks for the same modules
    common.add_systems_option(parser)
    args = parser.parse_args(argv)
    common.check_systems(parser, args)
    rows = []
    for workload in args.workload or ["seq2seq", "lm"]:
        rows += run(workload, smoke=args.smoke, torch_python=args.torch_python, systems=args.systems)
    print()
    table_rows = [dict(r, per_round=common.ratio_text(r["per_round"])) for r in rows if "system" in r]
    print(common.table(table_rows, ["bench", "system", "tokens_per_s", "ms_per_step", "gflops", "fraction_of_f32_limit",
                                    "fraction_of_own_limit", "ratio_vs_keras_hub", "per_round"]))
    if args.systems == "all":
        print("A matmul floor row's ratio_vs_keras_hub is a ceiling: the most any system could reach in this run if "
              "everything but its matmuls were free. Rows ending in +metrics: each library compiled as its "
              "documentation does (tfformer's recipes' loss and metrics, keras-hub's task defaults), against "
              "keras-hub float32 +metrics. Rows ending in +cpu_threads: tfformer in a process of its own with one "
              "share of the cores per micro-batch (training.configure_cpu_threads), against keras-hub float32 with "
              "TensorFlow's default threads.")
    for r in rows:
        if r["bench"].endswith("_vs_pytorch"):
            print(f"{r['bench']} {r['dtype']}: tfformer / PyTorch = {r['ratio']:.2f}; per round "
                  f"{common.ratio_text(r['per_round'])}")
    if args.systems == "all":
        common.print_goals(rows, "Goals (ratios of the medians; read from the +metrics rows, the strict and "
                                 "+cpu_threads readings after):")


if __name__ == "__main__":
    main()
