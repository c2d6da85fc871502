"""Sentence-encoder throughput: tfformer's all-MiniLM-L6-v2 vs keras-hub BertBackbone vs sentence-transformers.

Sentences per second at batch 32, sequence 128 (every position a real token), the forward pass of a
sentence embedder (encoder, mean pooling, L2 norm) on 2 threads:

- tfformer: `from_preset("all-minilm-l6-v2")`, float32 and built under `mixed_bfloat16`;
- keras-hub: `BertBackbone` of the same shape (vocab 30522, 6 layers, hidden 384, 12 heads, intermediate
  1536; random weights) plus the same pooling, float32 and `mixed_bfloat16`;
- PyTorch: sentence-transformers' `SentenceTransformer` of the same checkpoint on CPU, float32 and under
  `torch.autocast("cpu", dtype=torch.bfloat16)`. It runs in a worker process: this interpreter if it has
  torch and sentence-transformers, else the peers' `.venv-peers/bin/python` (or `--torch-python`); without either,
  the PyTorch rows are skipped.

Also timed, the whole path a user runs (rows "tfformer encode" and "pytorch encode"): `SentenceEncoder.encode`
and sentence-transformers' `SentenceTransformer.encode` of the same 512 English sentences (the gettext
catalogs' English->German training split, 4-114 tokens, ~10 on average), tokenization included, batches of 32,
float32 and bfloat16 as above (keras-hub has no sentence-embedding task, so no row).

Keras models run through a `tf.function` (no XLA). Repeats are interleaved across all systems (the
PyTorch worker waits on a pipe while the others run), after warm-up; medians are reported. Prints one JSON
line per system and a markdown table with the ratios tfformer / keras-hub and tfformer / PyTorch
(> 1: tfformer is faster). The forward rows also give achieved GFLOP/s (`forward_flops`: the matmuls of one
pass, the same for every system) and its fraction of the matmul limit of their dtype, a 2048^3 matmul timed in
the same interleaved rounds (`common.matmul_limit_calls`).

    python -m benchmarks.encoder [--smoke] [--repeats 5]

`--smoke`: one repeat on tiny shapes (tiny random Keras models, the 16 `SMOKE_TEXTS` for the encode rows with a
64-word vocabulary; PyTorch gets batch 2, sequence 8); the numbers mean nothing. Without the gettext catalogs
the encode rows are skipped, and the output says so.
"""

import argparse
import sys
import time

import numpy as np

from benchmarks import torch_worker

THREADS = 2
SHAPE = dict(vocab=30522, layers=6, hidden=384, heads=12, intermediate=1536)
SMOKE_SHAPE = dict(vocab=64, layers=1, hidden=16, heads=2, intermediate=32)
ENCODE_BATCH = 32


SMOKE_TEXTS = ["the file is not a directory", "a", "to the end of the file", "not in the file"] * 4


def _texts(smoke):
    """English sentences for the encode rows: the start of the gettext catalogs' English->German training split
    (smoke: `SMOKE_TEXTS`); None, after saying why, without catalogs."""
    from tfformer.recipes import translation

    if smoke:
        return SMOKE_TEXTS
    try:
        return [source for source, _ in translation.load_pairs("de")["train"][:512]]
    except ValueError as error:
        print(f"encode rows skipped: {error}", flush=True)
        return None


def _smoke_tokenizer(vocab):
    from tfformer import convert

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "a", "to", "of", "and", "in", "is", "file", "not"]
    return convert.BertTokenizer(words + [f"##{i}" for i in range(vocab - len(words))], max_length=64)


def forward_flops(shape, batch, length):
    """Matmul FLOPs of one forward pass: 2 FLOPs per multiply-add; per layer and token the q, k, v and output
    projections (4 h^2) and the feed-forward (2 h i), per layer and sequence the scores and the mixing
    (2 length^2 h). Biases, norms, softmax and pooling are left out."""
    h, i, layers = shape["hidden"], shape["intermediate"], shape["layers"]
    return 2 * batch * length * layers * (4 * h * h + 2 * h * i) + 4 * layers * batch * length**2 * h


def _token_ids(vocab, batch, length, seed=0):
    return np.random.default_rng(seed).integers(1000 if vocab > 2000 else 4, vocab,
                                                size=(batch, length)).astype("int32")


# === Keras systems ===


def _pooled(sequence, padding_mask):
    """Mean over real tokens + L2 norm (what SentenceEncoder and sentence-transformers do)."""
    import tensorflow as tf

    weights = tf.cast(padding_mask, sequence.dtype)[:, :, None]
    pooled = tf.reduce_sum(sequence * weights, 1) / tf.maximum(tf.reduce_sum(weights, 1), 1e-9)
    return pooled / tf.maximum(tf.norm(pooled, axis=-1, keepdims=True), 1e-12)


def _keras_systems(smoke, batch, length, texts):
    import keras
    import keras_hub
    import tensorflow as tf

    from tfformer import models

    shape = SMOKE_SHAPE if smoke else SHAPE
    ids = _token_ids(shape["vocab"], batch, length)
    mask = np.ones_like(ids)
    systems = {}
    for dtype, policy in (("float32", "float32"), ("bfloat16", "mixed_bfloat16")):
        keras.config.set_dtype_policy(policy)
        try:
            if smoke:
                config = models.TransformerConfig(
                    architecture="encoder", vocabulary_size=shape["vocab"], hidden_dim=shape["hidden"],
                    num_heads=shape["heads"], intermediate_dim=shape["intermediate"],
                    num_encoder_layers=shape["layers"], num_decoder_layers=0, dropout=0.0, max_sequence_length=64,
                )
                tokenizer = _smoke_tokenizer(shape["vocab"])
                ours = models.SentenceEncoder(models.build_model(config), tokenizer=tokenizer)
            else:
                ours = models.from_preset("all-minilm-l6-v2")
            theirs = keras_hub.models.BertBackbone(
                vocabulary_size=shape["vocab"], num_layers=shape["layers"], num_heads=shape["heads"],
                hidden_dim=shape["hidden"], intermediate_dim=shape["intermediate"], max_sequence_length=512,
            )
        finally:
            keras.config.set_dtype_policy("float32")

        @tf.function
        def run_ours(token_ids, padding_mask, model=ours):
            return model({"token_ids": token_ids, "padding_mask": padding_mask}, training=False)

        @tf.function
        def run_theirs(token_ids, padding_mask, model=theirs):
            outputs = model({"token_ids": token_ids, "segment_ids": tf.zeros_like(token_ids),
                             "padding_mask": padding_mask}, training=False)
            return _pooled(outputs["sequence_output"], padding_mask)

        for system, fn in (("tfformer", run_ours), ("keras-hub", run_theirs)):
            def call(fn=fn):
                start = time.perf_counter()
                np.asarray(fn(ids, mask))
                return time.perf_counter() - start

            systems[(system, dtype)] = call

        def encode(model=ours):
            start = time.perf_counter()
            model.encode(texts, batch_size=ENCODE_BATCH)
            return time.perf_counter() - start

        if texts:
            systems[("tfformer encode", dtype)] = encode
    return systems


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.encoder", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="one repeat, tiny shapes; numbers mean nothing")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    torch_worker.add_python_option(parser, "encoder")
    args = parser.parse_args(argv)
    if args.repeats < 5 or args.warmup < 1:
        parser.error(f"--repeats must be >= 5 and --warmup >= 1 (medians of >= 5 repeats after warm-up). "
                     f"Received: --repeats {args.repeats} --warmup {args.warmup}")

    batch, length = (2, 8) if args.smoke else (32, 128)
    repeats, warmup = (1, 1) if args.smoke else (args.repeats, args.warmup)

    texts = _texts(args.smoke)
    # Start the PyTorch worker first: it loads while the Keras models are built.
    from tfformer.convert import pretrained

    try:
        model_dir = pretrained.all_minilm_l6_v2_path()
    except ValueError as error:
        pending = torch_worker.Pending(skipped=str(error))
    else:
        pending = torch_worker.start("encoder", {"model_dir": model_dir, "threads": THREADS, "texts": texts},
                                     {"ids": _token_ids(30522, batch, length)}, args.torch_python)

    from benchmarks import common

    threads_set = common.set_tf_threads(THREADS, inter=1)  # False: the runtime was already up with others
    with pending:
        systems = _keras_systems(args.smoke, batch, length, texts)
        worker = pending.ready()
        if worker is not None:
            for dtype in ("float32", "bfloat16"):
                systems[("pytorch", dtype)] = lambda dtype=dtype: worker.run(dtype)
                if texts:
                    systems[("pytorch encode", dtype)] = lambda dtype=dtype: worker.run(f"encode {dtype}")
        limit_size = common.limit_size(args.smoke)
        systems.update(common.matmul_limit_calls(limit_size))
        times = common.interleaved(systems, repeats=repeats, warmup=warmup, self_timed=True)
    limits = common.matmul_limits(times, limit_size)
    # PyTorch always runs the real checkpoint (with --smoke too, where the Keras models are tiny).
    flops = {"keras": forward_flops(SMOKE_SHAPE if args.smoke else SHAPE, batch, length),
             "pytorch": forward_flops(SHAPE, batch, length)}

    rows = {}
    for (system, dtype), values in times.items():
        seconds = common.median(values)
        encode = system.endswith(" encode")
        sentences = len(texts) if encode else batch
        record = {"bench": "encoder", "system": system, "dtype": dtype, "batch": ENCODE_BATCH if encode else batch,
                  "sequence_length": "longest in batch" if encode else length, "sentences": sentences,
                  "sentences_per_s": common.significant(sentences / seconds), "seconds": round(seconds, 4),
                  "repeats": [round(v, 4) for v in values], "threads": THREADS if threads_set else "preset",
                  "peak_rss_mb": round(common.peak_rss_mb())}
        if not encode:  # the encode rows' lengths vary by batch: no FLOP count
            gflops = flops["pytorch" if system == "pytorch" else "keras"] / seconds / 1e9
            record.update(gflops=common.significant(gflops), limit_gflops=common.significant(limits[dtype]),
                          fraction_of_own_limit=round(gflops / limits[dtype], 2))
        if system.startswith("pytorch"):
            record.update(torch=worker.info["torch"], peak_rss_mb=worker.peak_rss_mb)  # the worker's own process
        rows[(system, dtype)] = common.emit(record)

    table_rows, goals = [], []
    for (system, dtype), record in rows.items():
        row = dict(record)
        suffix = system[len("tfformer"):]  # "" or " encode"
        for other in ("keras-hub", "pytorch"):
            if system.startswith("tfformer") and (other + suffix, dtype) in rows:
                ratio = common.median(times[(other + suffix, dtype)]) / common.median(times[(system, dtype)])
                per_round = common.paired_ratio(times[(system, dtype)], times[(other + suffix, dtype)])
                common.emit({"bench": "encoder_ratio", "system": system, "dtype": dtype, "tfformer_vs": other,
                             "ratio": common.significant(ratio),
                             "per_round": [common.significant(x) for x in per_round]})
                if other == "pytorch" and not suffix:  # the issue's: each dtype at least PyTorch's speed
                    theirs = "bfloat16 autocast" if dtype == "bfloat16" else dtype
                    goals.append(common.goal(f"encoder {dtype} >= 1x PyTorch {theirs}", ratio, 1,
                                             rows=[system, other]))
                row[f"tfformer/{other}"] = f"{ratio:.2f}"
                row[f"tfformer/{other} per round"] = common.ratio_text(per_round)
        table_rows.append(row)
    print()
    print(common.table(table_rows, ["system", "dtype", "batch", "sequence_length", "sentences_per_s", "seconds",
                                    "gflops", "fraction_of_own_limit", "tfformer/keras-hub",
                                    "tfformer/keras-hub per round", "tfformer/pytorch", "tfformer/pytorch per round"]))
    print(f"\nbatch {batch}, sequence {length} (encode rows: {len(texts or [])} sentences, tokenization included), "
          f"{f'{THREADS} threads' if threads_set else 'the threads TensorFlow already had'}, medians of {repeats} "
          f"interleaved repeats after {warmup} warm-up round(s); ratios are sentences/s, > 1 means tfformer is "
          f"faster; matmul limits ({limit_size}^3 in these rounds) float32 {limits['float32']:.1f}, bfloat16 "
          f"{limits['bfloat16']:.1f} GFLOP/s.")
    if worker is None:
        print(f"PyTorch rows skipped: {pending.skipped} (so no goal lines: the goals are against PyTorch)")
    else:
        common.print_goals(goals, "Goals (ratios of the medians):")
    return 0


if __name__ == "__main__":
    sys.exit(main())
