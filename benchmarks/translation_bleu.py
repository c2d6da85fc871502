"""BLEU after the same wall-clock budget: tfformer's recipe vs the keras.io KerasHub translation recipe.

Both systems get the same English->German gettext split, the same SentencePiece
tokenizer (learned by tfformer's run, inside its budget) and the same training
time; BLEU is sacreBLEU on the detokenized test split, greedy decoding.

    python -m benchmarks.translation_bleu [--minutes 15] [--out DIR [--overwrite]] [--mixed-precision]
                                          [--data FILE.tsv] [--smoke]

Run directories: `--out` (default: a new temporary directory) and `--out`-bf16; an existing run there is replaced
only with `--overwrite`.

With `--mixed-precision` tfformer also trains under mixed_bfloat16 for the same
budget (its own run directory and tokenizer, learned the same way).

The baseline is the keras.io "English-to-Spanish translation with KerasHub"
model: TokenAndPositionEmbedding(mask_zero) + 1 TransformerEncoder + 1
TransformerDecoder (embed 256, intermediate 2048, 8 heads), Dropout(0.5),
softmax Dense, rmsprop, sparse categorical cross-entropy, batch 64, greedy
decoding with keras_hub.samplers.GreedySampler (no cache, full re-run per token).
It trains in float32 (the goal's reference) for as many seconds as tfformer
float32's `fit` took. Each row records its system's dtype policy.

The systems train one after another (a budget each, not interleaved), so a drift of the machine's speed between
them changes what a budget buys: each row records the float32 and bfloat16 matmul limits measured right before
and right after its system (`matmul_limit_gflops`, `common.with_matmul_limits`).

`--data FILE.tsv`: source<TAB>target pairs instead of the gettext catalogs (both systems). `--smoke`: 1000
generated word-for-word pairs, both models of width 16; tfformer stops after 60 steps (2 minutes at most) and
keras-hub trains as long, but at least 20 steps (CI runs it on a loaded machine, where a budget of seconds can go
to tracing alone; its numbers mean nothing).
"""

import argparse
import functools
import os
import random
import tempfile
import time

import keras
import keras_hub
import tensorflow as tf

from benchmarks import common
from tfformer import data, generation, training
from tfformer.recipes import translation

FULL = dict(minutes=15, vocabulary_size=8192, max_length=64, batch_size=64, warmup_steps=1000, eval_every=200,
            max_steps=None, min_baseline_steps=0, overrides={},
            baseline=dict(hidden_dim=256, intermediate_dim=2048, num_heads=8))  # the keras.io recipe
SMOKE = dict(minutes=2, vocabulary_size=8192, max_length=16, batch_size=8, warmup_steps=50, eval_every=100,
             max_steps=60, min_baseline_steps=20,
             overrides=dict(hidden_dim=16, num_heads=2, intermediate_dim=32, num_encoder_layers=1,
                            num_decoder_layers=1),
             baseline=dict(hidden_dim=16, intermediate_dim=32, num_heads=2))
SMOKE_WORDS = [("open", "öffnen"), ("close", "schließen"), ("the", "die"), ("file", "Datei"), ("new", "neue"),
               ("folder", "Ordner"), ("save", "speichern"), ("old", "alte"), ("delete", "löschen"), ("a", "eine")]


def write_smoke_pairs(path, count=1000, seed=0):
    """`count` source<TAB>target lines of 2-5 words translated word for word (so a tiny model learns some)."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as handle:
        for _ in range(count):
            words = [rng.choice(SMOKE_WORDS) for _ in range(rng.randint(2, 5))]
            handle.write(" ".join(e for e, _ in words) + "\t" + " ".join(g for _, g in words) + "\n")
    return path


def keras_hub_baseline(vocabulary_size, max_length, hidden_dim, intermediate_dim, num_heads):
    def embedding():
        return keras_hub.layers.TokenAndPositionEmbedding(vocabulary_size, max_length, hidden_dim, mask_zero=True)

    encoder_inputs = keras.Input(shape=(None,), dtype="int32", name="encoder_token_ids")
    x = embedding()(encoder_inputs)
    encoder_outputs = keras_hub.layers.TransformerEncoder(intermediate_dim=intermediate_dim, num_heads=num_heads)(x)
    decoder_inputs = keras.Input(shape=(None,), dtype="int32", name="decoder_token_ids")
    y = embedding()(decoder_inputs)
    y = keras_hub.layers.TransformerDecoder(intermediate_dim=intermediate_dim, num_heads=num_heads)(
        decoder_sequence=y, encoder_sequence=encoder_outputs
    )
    y = keras.layers.Dropout(0.5)(y)
    outputs = keras.layers.Dense(vocabulary_size, activation="softmax")(y)
    model = keras.Model({"encoder_token_ids": encoder_inputs, "decoder_token_ids": decoder_inputs}, outputs)
    model.compile("rmsprop", loss="sparse_categorical_crossentropy", metrics=["accuracy"], jit_compile=False)
    return model


def keras_hub_translate(model, tokenizer, sources, max_length, batch_size=64):
    sampler = keras_hub.samplers.GreedySampler()
    results = []
    for start in range(0, len(sources), batch_size):
        enc = tokenizer.tokenize(sources[start : start + batch_size]).to_tensor(shape=[None, max_length])
        batch = tf.shape(enc)[0]
        prompt = tf.concat([tf.fill([batch, 1], data.START_ID), tf.zeros([batch, max_length - 1], tf.int32)], 1)

        def next_fn(prompt, cache, index):
            logits = model({"encoder_token_ids": enc, "decoder_token_ids": prompt})[:, index - 1, :]
            return logits, None, cache

        ids = sampler(next_fn, prompt=prompt, stop_token_ids=[data.END_ID], index=1)
        results += generation.strip_after_end(ids[:, 1:])
    texts = tokenizer.detokenize(tf.ragged.constant(results, dtype=tf.int32, ragged_rank=1)).numpy()
    return [t.decode("utf-8") for t in texts]


def run_tfformer(out, shape, data_file, mixed_precision, overwrite):
    metrics = translation.train_translation(
        out, data_file=data_file, time_budget=f"{shape['minutes']}m", batch_size=shape["batch_size"],
        max_length=shape["max_length"], vocabulary_size=shape["vocabulary_size"],
        warmup_steps=shape["warmup_steps"], overwrite=overwrite, mixed_precision=mixed_precision,
        eval_every=shape["eval_every"], max_steps=shape["max_steps"], printer=lambda *_: None, **shape["overrides"])
    return {"bench": "translation_bleu", "system": "tfformer " + ("bfloat16" if mixed_precision else "float32"),
            "bleu_test": metrics["bleu_test"], "steps": metrics["steps"], "train_seconds": metrics["train_seconds"],
            "seconds_total": metrics["seconds"], "parameters": metrics["parameters"],
            "test_pairs": metrics["test_pairs"], "dtype_policy": metrics["dtype_policy"]}


def run_baseline(run_dir, train_seconds, shape, data_file=None, seed=0):
    """Train the keras.io recipe on tfformer's run's tokenizer and pairs for `train_seconds` (and at least
    `shape["min_baseline_steps"]` steps); its JSON row."""
    keras.config.set_dtype_policy("float32")  # not the policy a bfloat16 run before it left behind
    keras.utils.set_random_seed(seed)
    max_length, batch_size = shape["max_length"], shape["batch_size"]
    tokenizer = data.SubwordTokenizer.load(os.path.join(run_dir, translation.TOKENIZER_FILE))
    splits = translation.load_pairs("de", data_file)
    splits = {k: translation.filter_by_length(v, tokenizer, max_length) for k, v in splits.items()}
    train_ds = data.make_translation_dataset(splits["train"], tokenizer, batch_size, max_length, seed=seed)
    model = keras_hub_baseline(tokenizer.vocabulary_size, max_length, **shape["baseline"])
    start = time.monotonic()
    budget = common.BudgetWithFloor(train_seconds, shape["min_baseline_steps"])
    model.fit(train_ds, epochs=1000, callbacks=[budget], verbose=0)
    trained = time.monotonic() - start
    steps = int(model.optimizer.iterations.numpy())
    hypotheses = keras_hub_translate(model, tokenizer, [s for s, _ in splits["test"]], max_length, batch_size)
    return {"bench": "translation_bleu", "system": "keras-hub",
            "bleu_test": training.corpus_bleu(hypotheses, [t for _, t in splits["test"]]),
            "steps": steps, "train_seconds": round(trained, 1), "parameters": model.count_params(),
            "test_pairs": len(splits["test"]), "dtype_policy": model.dtype_policy.name}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, help="each system's budget (default: 15; smoke: 2, a ceiling)")
    parser.add_argument("--out", help="run directory (default: a new temporary one); bfloat16 runs in OUT-bf16")
    parser.add_argument("--overwrite", action="store_true", help="replace runs already in OUT and OUT-bf16")
    parser.add_argument("--mixed-precision", action="store_true", help="also train tfformer under mixed_bfloat16")
    parser.add_argument("--data", help="source<TAB>target pairs (default: the gettext catalogs; smoke: generated)")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    shape = dict(SMOKE if args.smoke else FULL)
    if args.minutes is not None:
        if not args.minutes > 0:
            parser.error(f"--minutes must be > 0. Received: {args.minutes}")
        shape["minutes"] = args.minutes
    if args.data and not os.path.isfile(args.data):
        parser.error(f"--data: {args.data!r} is not a file (expected source<TAB>target lines).")
    base = args.out or tempfile.mkdtemp(prefix="bleu-bench-")
    dtypes = (False, True) if args.mixed_precision else (False,)
    for path in [base + ("-bf16" if mixed else "") for mixed in dtypes]:  # before any training
        if not args.overwrite and os.path.isdir(path) and os.listdir(path):
            parser.error(f"--out: {path!r} already holds a run; pass --overwrite to replace it, or choose --out.")
    data_file = args.data
    if args.smoke and not data_file:
        data_file = write_smoke_pairs(os.path.join(tempfile.mkdtemp(prefix="bleu-smoke-"), "pairs.tsv"))
    print(f"run directories: {base}" + (f", {base}-bf16" if args.mixed_precision else ""), flush=True)
    rows = []
    limit_size = common.limit_size(args.smoke)
    for mixed in dtypes:
        out = base + ("-bf16" if mixed else "")
        run = functools.partial(run_tfformer, out, shape, data_file, mixed, args.overwrite)
        rows.append(common.emit(common.with_matmul_limits(run, limit_size)))
    # keras-hub trains as long as tfformer float32's fit took, on its tokenizer (learned inside tfformer's budget).
    run = functools.partial(run_baseline, base, rows[0]["train_seconds"], shape, data_file)
    rows.append(common.emit(common.with_matmul_limits(run, limit_size)))
    theirs = rows[-1]["bleu_test"]
    print("\n| system | BLEU (test) | steps | train seconds | BLEU vs keras-hub |\n|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['system']} | {row['bleu_test']:.2f} | {row['steps']} | {row['train_seconds']} | "
              f"{row['bleu_test'] / max(theirs, 1e-9):.2f} |")
    # The issue's: the training speed-ups hold "at equal or better BLEU after the same wall-clock budget".
    goals = [common.goal(f"translation_bleu {row['system']} BLEU >= 1x keras-hub float32's (same budget)",
                         row["bleu_test"] / max(theirs, 1e-9), 1, rows=[row["system"], rows[-1]["system"]])
             for row in rows[:-1]]
    common.print_goals(goals, "Goals:")
    return rows


if __name__ == "__main__":
    main()
