"""Perplexity after the same wall-clock budget: tfformer's language-model recipe vs keras-hub's GPT2CausalLM.

Both train the issue's GPT-2-shaped LM (tfformer's `gpt-mini`: 4 layers, hidden 256, 4 heads, intermediate 1024,
GPT-2's tanh GELU, dropout 0.1, learned positions, tied embeddings) on the same windows of the same text (default:
the Python standard library's sources, the recipe's line split; 32 windows of 128 tokens per batch; the
SentencePiece vocabulary of 8192 that tfformer's float32 run learns inside its budget) for the same training time.
Perplexity is exp(mean cross-entropy per token) on the test split, computed for every system by one function
(`perplexity_on`: `training.Perplexity` on each model's float32 logits).

    python -m benchmarks.lm_perplexity [--minutes 10] [--out DIR [--overwrite]] [--smoke]

Run directories: `--out` (default: a new temporary directory) and `--out`-bf16; an existing run there is replaced
only with `--overwrite`.

- tfformer: `recipes.language_model.train_lm`, in float32 and under mixed_bfloat16 (each its own run directory and
  the same budget; the bfloat16 run learns its vocabulary again, and its row says whether the file came out the
  same, `same_vocabulary`). The budget counts its vocabulary learning and its validation every 200 steps and at
  each epoch's end, as a user's run does.
- keras-hub: `GPT2CausalLM(GPT2Backbone(the same shape), preprocessor=None)` compiled with its task's loss and
  metric (`CausalLM.compile`'s defaults but the optimizer), no XLA, trained for as many seconds as tfformer
  float32's `fit` took. Two runs, one per optimizer, since keras-hub's default (AdamW 2e-5) is a fine-tuning rate:
  "recipe schedule": Keras' Adam with the recipe's warm-up schedule and settings (500 steps to 2.8e-3 at hidden
  256, beta_2 0.98, epsilon 1e-9, clipnorm 1.0; tfformer's FusedAdamW without weight decay does the same update);
  "keras.io": `"adam"` (1e-3), as keras.io's "GPT text generation from scratch with KerasHub" trains.
  Ratios are against the better keras-hub run (the lower test perplexity); < 1 means tfformer's is lower.

The systems train one after another (a budget each, not interleaved), so a drift of the machine's speed between
them changes what a budget buys: each row records the float32 and bfloat16 matmul limits measured right before
and right after its system (`matmul_limit_gflops`, `common.with_matmul_limits`).

`--smoke`: one small text file and a one-layer model of width 16; tfformer stops after 150 steps (2 minutes at
most) and keras-hub trains as long, but at least 100 steps (CI runs it on a loaded machine, where a budget of seconds
can go to tracing alone; its numbers mean nothing).
"""

import argparse
import filecmp
import json
import os
import tempfile
import time

import keras
import keras_hub
import tensorflow as tf

from benchmarks import common
from tfformer import data, training
from tfformer.recipes import language_model
from tfformer.recipes.translation import CONFIG_FILE, MODEL_FILE, TOKENIZER_FILE

SMOKE = dict(minutes=2, max_steps=150, min_baseline_steps=100,
             text_files=[os.path.join(os.path.dirname(os.__file__), "argparse.py")],
             vocabulary_size=256, sequence_length=16, batch_size=8, warmup_steps=50, eval_every=20,
             overrides=dict(hidden_dim=16, num_heads=2, intermediate_dim=32, num_decoder_layers=1))
FULL = dict(minutes=10, max_steps=None, min_baseline_steps=0, text_files=None,
            vocabulary_size=8192, sequence_length=128, batch_size=32, warmup_steps=500,
            eval_every=200, overrides={})
KERAS_HUB_OPTIMIZERS = ("recipe schedule", "keras.io")


def with_padding_mask(x):
    """tfformer's LM inputs `{"token_ids"}` as keras-hub's GPT-2 takes them (windows have no padding)."""
    return {"token_ids": x["token_ids"], "padding_mask": tf.ones_like(x["token_ids"], tf.bool)}


def perplexity_on(model, dataset, keras_hub_inputs=False):
    """exp(mean cross-entropy per token) of `model`'s logits on `dataset`, batch by batch, without dropout."""
    metric = training.Perplexity()
    for x, y in dataset:
        metric.update_state(y, model(with_padding_mask(x) if keras_hub_inputs else x, training=False))  # (B, T, V)
    return float(metric.result())


def test_windows(tokenizer, shape):
    """The test split's windows, unshuffled: `({"token_ids": (B, L)}, labels (B, L))` batches."""
    lines = [line for line in data.text_corpus(shape["text_files"]) if data.split_of(line) == "test"]
    return data.make_lm_dataset(lines, tokenizer, shape["sequence_length"], shape["batch_size"], shuffle=False)


def keras_hub_optimizer(name, hidden_dim, warmup_steps):
    if name == "keras.io":
        return keras.optimizers.Adam(1e-3)
    return keras.optimizers.Adam(training.TransformerSchedule(hidden_dim, warmup_steps), beta_1=0.9, beta_2=0.98,
                                 epsilon=1e-9, clipnorm=1.0)


def keras_hub_lm(config, optimizer):
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=config["vocabulary_size"], num_layers=config["num_decoder_layers"],
        num_heads=config["num_heads"], hidden_dim=config["hidden_dim"], intermediate_dim=config["intermediate_dim"],
        max_sequence_length=config["max_sequence_length"], dropout=config["dropout"])
    model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    model.compile(optimizer=optimizer, jit_compile=False)  # the task's loss and weighted accuracy
    return model


def run_keras_hub(run_dir, optimizer_name, train_seconds, shape, seed=0):
    """Train keras-hub's GPT-2 on tfformer's run's tokenizer and data for `train_seconds` (and at least
    `shape["min_baseline_steps"]` steps); its JSON row."""
    keras.config.set_dtype_policy("float32")
    keras.utils.set_random_seed(seed)
    tokenizer = data.SubwordTokenizer.load(os.path.join(run_dir, TOKENIZER_FILE))
    with open(os.path.join(run_dir, CONFIG_FILE)) as handle:
        config = json.load(handle)
    lines = [line for line in data.text_corpus(shape["text_files"]) if data.split_of(line) == "train"]
    train_ds = data.make_lm_dataset(lines, tokenizer, shape["sequence_length"], shape["batch_size"],
                                    seed=seed).map(lambda x, y: (with_padding_mask(x), y))  # train_lm's windows
    model = keras_hub_lm(config, keras_hub_optimizer(optimizer_name, config["hidden_dim"], shape["warmup_steps"]))
    start = time.monotonic()
    budget = common.BudgetWithFloor(train_seconds, shape["min_baseline_steps"])
    model.fit(train_ds, epochs=1000, callbacks=[budget], verbose=0)
    trained = time.monotonic() - start
    return {"bench": "lm_perplexity", "system": f"keras-hub float32 ({optimizer_name})",
            "test_perplexity": perplexity_on(model, test_windows(tokenizer, shape), keras_hub_inputs=True),
            "steps": int(model.optimizer.iterations.numpy()), "train_seconds": round(trained, 1),
            "parameters": model.count_params()}


def run_tfformer(out, shape, mixed_precision, overwrite):
    metrics = language_model.train_lm(
        out, text_files=shape["text_files"], time_budget=f"{shape['minutes']}m", batch_size=shape["batch_size"],
        sequence_length=shape["sequence_length"], vocabulary_size=shape["vocabulary_size"],
        warmup_steps=shape["warmup_steps"], overwrite=overwrite, mixed_precision=mixed_precision,
        eval_every=shape["eval_every"], max_steps=shape["max_steps"], printer=lambda *_: None, **shape["overrides"])
    # The saved model, evaluated as keras-hub's is (train_lm's own test_perplexity is the same metric).
    model = keras.models.load_model(os.path.join(out, MODEL_FILE), safe_mode=True)
    tokenizer = data.SubwordTokenizer.load(os.path.join(out, TOKENIZER_FILE))
    return {"bench": "lm_perplexity", "system": "tfformer " + ("bfloat16" if mixed_precision else "float32"),
            "test_perplexity": perplexity_on(model, test_windows(tokenizer, shape)),
            "recipe_test_perplexity": metrics["test_perplexity"],
            "steps": metrics["steps"], "train_seconds": metrics["train_seconds"],
            "seconds_total": metrics["seconds"], "parameters": metrics["parameters"]}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, help="each system's budget (default: 10; smoke: 2, a ceiling)")
    parser.add_argument("--out", help="run directory (default: a new temporary one); bfloat16 runs in OUT-bf16")
    parser.add_argument("--overwrite", action="store_true", help="replace runs already in OUT and OUT-bf16")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    shape = dict(SMOKE if args.smoke else FULL)
    if args.minutes is not None:
        if not args.minutes > 0:
            parser.error(f"--minutes must be > 0. Received: {args.minutes}")
        shape["minutes"] = args.minutes
    rows = []

    def emit(row):
        rows.append(common.emit(row))

    limit_size = common.limit_size(args.smoke)

    out = args.out or tempfile.mkdtemp(prefix="lm-bench-")
    for path in (out, out + "-bf16"):  # checked before any training, not after the first run's 10 minutes
        if not args.overwrite and os.path.isdir(path) and os.listdir(path):
            parser.error(f"--out: {path!r} already holds a run; pass --overwrite to replace it, or choose --out.")
    print(f"run directories: {out}, {out}-bf16", flush=True)
    ours = common.with_matmul_limits(lambda: run_tfformer(out, shape, False, args.overwrite), limit_size)
    emit(ours)
    for name in KERAS_HUB_OPTIMIZERS:
        emit(common.with_matmul_limits(lambda: run_keras_hub(out, name, ours["train_seconds"], shape), limit_size))
    bf16 = common.with_matmul_limits(lambda: run_tfformer(out + "-bf16", shape, True, args.overwrite), limit_size)
    bf16["same_vocabulary"] = filecmp.cmp(os.path.join(out, TOKENIZER_FILE),
                                          os.path.join(out + "-bf16", TOKENIZER_FILE), shallow=False)
    if not bf16["same_vocabulary"]:
        print("WARNING: the bfloat16 run learned another vocabulary; its perplexity does not compare", flush=True)
    emit(bf16)
    best = min((r for r in rows if r["system"].startswith("keras-hub")), key=lambda r: r["test_perplexity"])
    print("\n| system | test perplexity | steps | train seconds | steps/s | perplexity vs best keras-hub | steps/s vs "
          "best keras-hub |\n|---|---|---|---|---|---|---|")
    for row in rows:
        speed = row["steps"] / max(row["train_seconds"], 1e-9)
        best_speed = best["steps"] / max(best["train_seconds"], 1e-9)
        print(f"| {row['system']} | {row['test_perplexity']:.2f} | {row['steps']} | {row['train_seconds']} | "
              f"{speed:.2f} | {row['test_perplexity'] / best['test_perplexity']:.2f} | {speed / best_speed:.2f} |")
    # The issue's: the training speed-ups hold "at equal or better perplexity after the same wall-clock budget",
    # against the better of keras-hub's two runs.
    goals = []
    for dtype in ("float32", "bfloat16"):
        ours = next(r for r in rows if r["system"] == f"tfformer {dtype}")
        goals.append(common.goal(
            f"lm_perplexity tfformer {dtype} test perplexity <= 1x keras-hub float32's (same budget)",
            ours["test_perplexity"] / best["test_perplexity"], 1, at_least=False,
            rows=[ours["system"], best["system"]]))
    common.print_goals(goals, "Goals (lower perplexity is better):")
    return rows


if __name__ == "__main__":
    main()
