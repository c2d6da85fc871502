"""BLEU after the same wall-clock budget: tfformer's recipe vs the keras.io KerasHub translation recipe.

Both systems get the same English->German gettext split, the same SentencePiece
tokenizer (learned by tfformer's run, inside its budget) and the same training
time; BLEU is sacreBLEU on the detokenized test split, greedy decoding.

    python -m benchmarks.translation_bleu [--minutes 15] [--out DIR [--overwrite]] [--mixed-precision]

Run directories: `--out` (default: a new temporary directory) and `--out`-bf16; an existing run there is replaced
only with `--overwrite`.

With `--mixed-precision` tfformer also trains under mixed_bfloat16 for the same
budget (its own run directory and tokenizer, learned the same way).

The baseline is the keras.io "English-to-Spanish translation with KerasHub"
model: TokenAndPositionEmbedding(mask_zero) + 1 TransformerEncoder + 1
TransformerDecoder (embed 256, intermediate 2048, 8 heads), Dropout(0.5),
softmax Dense, rmsprop, sparse categorical cross-entropy, batch 64, greedy
decoding with keras_hub.samplers.GreedySampler (no cache, full re-run per token).
"""

import argparse
import json
import os
import tempfile
import time

import keras
import keras_hub
import tensorflow as tf

from tfformer import data, training
from tfformer.recipes import translation

EMBED_DIM, INTERMEDIATE_DIM, NUM_HEADS = 256, 2048, 8


def keras_hub_baseline(vocabulary_size, max_length):
    encoder_inputs = keras.Input(shape=(None,), dtype="int32", name="encoder_token_ids")
    x = keras_hub.layers.TokenAndPositionEmbedding(vocabulary_size, max_length, EMBED_DIM, mask_zero=True)(encoder_inputs)
    encoder_outputs = keras_hub.layers.TransformerEncoder(intermediate_dim=INTERMEDIATE_DIM, num_heads=NUM_HEADS)(x)
    decoder_inputs = keras.Input(shape=(None,), dtype="int32", name="decoder_token_ids")
    y = keras_hub.layers.TokenAndPositionEmbedding(vocabulary_size, max_length, EMBED_DIM, mask_zero=True)(decoder_inputs)
    y = keras_hub.layers.TransformerDecoder(intermediate_dim=INTERMEDIATE_DIM, num_heads=NUM_HEADS)(
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
        results += translation.generation.strip_after_end(ids[:, 1:])
    texts = tokenizer.detokenize(tf.ragged.constant(results, dtype=tf.int32, ragged_rank=1)).numpy()
    return [t.decode("utf-8") for t in texts]


def run_baseline(run_dir, train_seconds, max_length=64, batch_size=64, printer=print):
    tokenizer = data.SubwordTokenizer.load(os.path.join(run_dir, translation.TOKENIZER_FILE))
    splits = translation.load_pairs("de")
    splits = {k: translation.filter_by_length(v, tokenizer, max_length) for k, v in splits.items()}
    train_ds = data.make_translation_dataset(splits["train"], tokenizer, batch_size, max_length, seed=0)
    model = keras_hub_baseline(tokenizer.vocabulary_size, max_length)
    start = time.monotonic()
    model.fit(train_ds, epochs=1000, callbacks=[training.TimeBudget(train_seconds)], verbose=0)
    trained = time.monotonic() - start
    hypotheses = keras_hub_translate(model, tokenizer, [s for s, _ in splits["test"]], max_length)
    bleu = training.corpus_bleu(hypotheses, [t for _, t in splits["test"]])
    printer(json.dumps({"system": "keras-hub", "bleu_test": bleu, "train_seconds": round(trained, 1),
                        "parameters": model.count_params(), "test_pairs": len(splits["test"])}))
    return bleu


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--minutes", type=float, default=15)  # the demo budget (DEMO_MINUTES default)
    parser.add_argument("--out", help="run directory (default: a new temporary one); bfloat16 runs in OUT-bf16")
    parser.add_argument("--overwrite", action="store_true", help="replace runs already in OUT and OUT-bf16")
    parser.add_argument("--mixed-precision", action="store_true", help="also train tfformer under mixed_bfloat16")
    args = parser.parse_args(argv)
    base = args.out or tempfile.mkdtemp(prefix="bleu-bench-")
    dtypes = (False, True) if args.mixed_precision else (False,)
    for path in [base + ("-bf16" if mixed else "") for mixed in dtypes]:  # before any training
        if not args.overwrite and os.path.isdir(path) and os.listdir(path):
            parser.error(f"--out: {path!r} already holds a run; pass --overwrite to replace it, or choose --out.")
    print(f"run directories: {base}" + (f", {base}-bf16" if args.mixed_precision else ""), flush=True)
    rows = []
    for mixed in dtypes:
        out = base + ("-bf16" if mixed else "")
        metrics = translation.train_translation(out, time_budget=f"{args.minutes}m", overwrite=args.overwrite,
                                                mixed_precision=mixed)
        ours = {"system": "tfformer" + (" bfloat16" if mixed else ""), "bleu_test": metrics["bleu_test"],
                "seconds_total": metrics["seconds"], "steps": metrics["steps"],
                "parameters": metrics["parameters"], "test_pairs": metrics["test_pairs"]}
        print(json.dumps(ours), flush=True)
        rows.append(ours)
        if not mixed:
            train_seconds = metrics["curve"][-1]["seconds"] if metrics["curve"] else 60
    theirs = run_baseline(base, train_seconds)
    print("\n| system | BLEU (test) | ratio vs keras-hub |\n|---|---|---|")
    for row in rows:
        print(f"| {row['system']} transformer-tiny | {row['bleu_test']:.2f} | {row['bleu_test'] / max(theirs, 1e-9):.2f} |")
    print(f"| keras-hub keras.io recipe | {theirs:.2f} | 1.00 |")


if __name__ == "__main__":
    main()
