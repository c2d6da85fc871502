"""English -> X translation: learn a vocabulary, train with model.fit, report BLEU. The main job (`make demo`)."""

import os
import time

import keras

from tfformer import data, generation, models, training
from tfformer.recipes import rundir

MODEL_FILE, TOKENIZER_FILE, CONFIG_FILE, RUN_FILE = "model.keras", "tokenizer.model", "config.json", "run.json"


def load_pairs(target_language="de", data_file=None, locale_dir=data.corpora.DEFAULT_LOCALE_DIR):
    if data_file:
        return data.read_tsv_pairs(data_file)
    return data.gettext_pairs(target_language, locale_dir=locale_dir)


def filter_by_length(pairs, tokenizer, max_length):
    """Keep pairs whose source and target both fit in `max_length` tokens (target + end token)."""
    if not pairs:
        return []
    src = tokenizer.tokenize([s for s, _ in pairs]).row_lengths().numpy()
    tgt = tokenizer.tokenize([t for _, t in pairs]).row_lengths().numpy()
    return [p for p, a, b in zip(pairs, src, tgt) if a <= max_length and b + 1 <= max_length]


def compile_model(model, config, warmup_steps, label_smoothing=0.1, clipnorm=1.0, jit_compile=False):
    model.compile(
        optimizer=training.transformer_optimizer(config.hidden_dim, warmup_steps=warmup_steps, clipnorm=clipnorm),
        loss=training.MaskedSparseCrossEntropy(label_smoothing),
        metrics=[training.MaskedAccuracy(), training.Perplexity()],
        jit_compile=jit_compile,
    )


def evaluate_bleu(model, tokenizer, pairs, max_new_tokens, batch_size=64):
    hypotheses = generation.translate(model, tokenizer, [s for s, _ in pairs], max_new_tokens=max_new_tokens,
                                      batch_size=batch_size)
    return training.corpus_bleu(hypotheses, [t for _, t in pairs]), hypotheses


def plot_curves(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in rows]
    ax.plot(steps, [r.get("loss") for r in rows], label="train loss")
    ax.plot(steps, [r.get("val_loss") for r in rows], label="validation loss")
    ax.set_xlabel("training step")
    ax.set_ylabel("label-smoothed cross-entropy")
    ax.set_title("English→German, transformer-tiny")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


@rundir.restores_dtype_policy
def train_translation(out, preset="transformer-tiny", target_language="de", data_file=None, time_budget="15m",
                      batch_size=64, max_length=64, vocabulary_size=8192, warmup_steps=1000, overwrite=False,
                      replicas=None, mixed_precision=False, eval_every=200, seed=0, printer=print, **overrides):
    """Train English -> `target_language`; writes model, tokenizer, config, curves, BLEU and samples under `out`.

    `time_budget` counts everything: vocabulary learning, training and the final
    evaluation (about 10% of it is reserved for the latter). Returns what it writes
    to `metrics.json`: `bleu_test`, `test_pairs`, `steps` (this call's), `epochs_started`,
    `seconds` (the whole call), `train_seconds` (this call's `fit`), `curve`, `parameters` and `dtype_policy`
    (the model's). The run trains under mixed_bfloat16 (mixed_float16 on GPUs) with `mixed_precision`, else
    float32; the caller's global dtype policy is back when it returns.
    """
    budget = training.parse_duration(time_budget)
    start = time.monotonic()
    state, strategy = rundir.begin(out, overwrite, replicas, mixed_precision, seed)
    splits = load_pairs(target_language, data_file)
    printer(f"pairs: train {len(splits['train'])}, validation {len(splits['validation'])}, test {len(splits['test'])}")

    tokenizer_path = os.path.join(out, TOKENIZER_FILE)
    if state == "resume" and os.path.exists(tokenizer_path):
        tokenizer = data.SubwordTokenizer.load(tokenizer_path)
        printer(f"resuming the run in {out}")
    else:
        t = time.monotonic()
        tokenizer = data.SubwordTokenizer.train([s for pair in splits["train"] for s in pair], vocabulary_size)
        tokenizer.save(tokenizer_path)
        printer(f"vocabulary: {tokenizer.vocabulary_size} pieces learned in {time.monotonic() - t:.1f}s")
    splits = {name: filter_by_length(pairs, tokenizer, max_length) for name, pairs in splits.items()}
    printer(f"pairs that fit in {max_length} tokens: " + ", ".join(f"{k} {len(v)}" for k, v in splits.items()))

    config = models.get_preset(preset, vocabulary_size=tokenizer.vocabulary_size,
                               max_sequence_length=max(max_length, 64), **overrides)
    if config.architecture != "seq2seq":
        raise ValueError(f"Translation needs a seq2seq preset; {preset!r} is {config.architecture!r}.")
    rundir.write_json(os.path.join(out, CONFIG_FILE), config.to_dict())
    rundir.write_json(os.path.join(out, RUN_FILE), dict(preset=preset, target_language=target_language,
                                                        data_file=data_file, max_length=max_length, seed=seed))
    train_ds = data.make_translation_dataset(splits["train"], tokenizer, batch_size, max_length, seed=seed)
    val_ds = data.make_translation_dataset(splits["validation"], tokenizer, batch_size, max_length, shuffle=False)
    with strategy.scope():
        model = models.build_model(config)
        compile_model(model, config, warmup_steps)
    printer(f"model: {preset}, {model.count_params():,} parameters, {strategy.num_replicas_in_sync} replica(s), "
            f"policy {keras.config.dtype_policy().name}")

    remaining = budget - (time.monotonic() - start)
    train_seconds = max(remaining - 0.1 * budget, 1.0)
    evaluator = training.EvaluateEvery(val_ds, every=eval_every, printer=printer)
    fit_start = time.monotonic()
    history = training.fit(model, train_ds, validation_data=val_ds, epochs=1000, callbacks=[evaluator],
                           strategy=strategy, run_dir=out, time_budget=train_seconds, backup_every=eval_every,
                           verbose=0)
    fit_seconds = time.monotonic() - fit_start
    model.save(os.path.join(out, MODEL_FILE))

    test = splits["test"]
    bleu, hypotheses = evaluate_bleu(model, tokenizer, test, max_new_tokens=max_length)
    metrics = {
        "bleu_test": bleu,
        "test_pairs": len(test),
        "steps": evaluator.rows[-1]["step"] if evaluator.rows else 0,
        "epochs_started": len(history.get("loss", [])),
        "seconds": round(time.monotonic() - start, 1),
        "train_seconds": round(fit_seconds, 1),
        "curve": evaluator.rows,
        "parameters": model.count_params(),
        "dtype_policy": model.dtype_policy.name,
    }
    if evaluator.rows:
        plot_curves(evaluator.rows, os.path.join(out, "loss.png"))
    with open(os.path.join(out, "samples.txt"), "w") as handle:
        for (source, reference), hypothesis in list(zip(test, hypotheses))[:10]:
            handle.write(f"EN  {source!r}\nREF {reference!r}\nOUT {hypothesis!r}\n\n")
    rundir.write_json(os.path.join(out, rundir.FINISHED_MARKER), metrics)
    printer(f"BLEU on the test split ({len(test)} pairs): {bleu:.2f}")
    for (source, reference), hypothesis in list(zip(test, hypotheses))[:10]:
        printer(f"  EN  {source!r}\n  REF {reference!r}\n  OUT {hypothesis!r}")
    return metrics


def load_run(run_dir):
    """(model, tokenizer) of a finished translation run."""
    path = os.path.join(run_dir, MODEL_FILE)
    if not os.path.exists(path):
        raise ValueError(f"No trained model in {run_dir!r} (expected {MODEL_FILE}); train one with `tfformer train`.")
    model = keras.models.load_model(path, safe_mode=True)
    return model, data.SubwordTokenizer.load(os.path.join(run_dir, TOKENIZER_FILE))
