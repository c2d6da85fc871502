"""Causal language modelling on plain text (default: the Python standard library's sources)."""

import os
import time

import tensorflow as tf

from tfformer import data, models, training
from tfformer.checks import check_int
from tfformer.recipes import rundir
from tfformer.recipes.translation import CONFIG_FILE, TOKENIZER_FILE


def default_micro_batches(tokens_per_replica, on_gpu):
    """`compile(micro_batches=...)` for a replica's batch of `tokens_per_replica` tokens: 2 on CPUs from 4,096
    tokens (below that, the parts cost more than they overlap; docs/performance.md, "Training: micro-batches"),
    else 1."""
    return 2 if not on_gpu and tokens_per_replica >= 4096 else 1


def _compiled_model(config, dtype, strategy, warmup_steps, micro_batches):
    """The run's model in dtype policy `dtype`, built in `strategy`'s scope and compiled for training."""
    with strategy.scope():
        model = models.build_model(config, dtype)
        model.compile(
            optimizer=training.transformer_optimizer(config.hidden_dim, warmup_steps=warmup_steps, clipnorm=1.0),
            loss=training.MaskedSparseCrossEntropy(0.0),
            metrics=[training.MaskedAccuracy(), training.Perplexity()],
            jit_compile=False,
            micro_batches=micro_batches,
        )
    return model


def _test_perplexity(model, lines, tokenizer, sequence_length, batch_size, printer):
    """The model's perplexity on the test `lines`; None (and said why) when they are none or shorter than one
    window of `sequence_length + 1` tokens."""
    if not lines:
        printer("no test perplexity: the test split is empty")
        return None
    try:
        test_ds = data.make_lm_dataset(lines, tokenizer, sequence_length, batch_size, shuffle=False)
    except ValueError as error:  # shorter than one window
        printer(f"no test perplexity: {len(lines)} test lines; {error}")
        return None
    return float(model.evaluate(test_ds, verbose=0, return_dict=True)["perplexity"])


def train_lm(out, preset="gpt-mini", text_files=None, time_budget="10m", batch_size=32, sequence_length=128,
             vocabulary_size=8192, warmup_steps=500, overwrite=False, replicas=None, mixed_precision=False,
             eval_every=200, seed=0, printer=print, micro_batches=None, cpu_threads=False, max_steps=None,
             **overrides):
    """Train a causal LM; writes model, tokenizer, config, metrics (perplexity) and a sample under `out`.

    `time_budget` covers vocabulary learning and training, with 5% of it left for the final evaluations and the
    sample (which may run over). `micro_batches`: the model's `compile(micro_batches=...)`; None picks
    `default_micro_batches`. `cpu_threads=True` first calls `training.configure_cpu_threads` for those micro-batches
    and replicas (one share of the cores per part, docs/performance.md, "Training: CPU threads"; process-wide, so
    only in a process whose TensorFlow runtime has not started: it raises otherwise; the `tfformer train lm` command
    passes it). The returned metrics hold the validation and test perplexities (`test_perplexity`
    is None when the test split is empty or shorter than one window of `sequence_length + 1` tokens), `steps`
    (the optimizer's, a resumed run's earlier ones included), `train_seconds` (this call's `fit`) and
    `dtype_policy` (the model's: mixed with `mixed_precision`, else float32; the global dtype policy is left
    alone). `max_steps`: end this call's training after this many steps (None: the time budget alone).
    """
    check_int("max_steps", max_steps, allow_none=True)
    # Before `begin`, whose overwrite deletes a finished run.
    rundir.check_options(replicas, batch_size=batch_size, sequence_length=sequence_length, eval_every=eval_every)
    budget = training.parse_duration(time_budget)
    start = time.monotonic()
    # Refused before the run directory is written (a corrected retry would find a run there).
    config = rundir.preset_config(preset, "causal_lm", "Language modelling", vocabulary_size, sequence_length,
                                  overrides)
    lines = data.text_corpus(text_files)

    def default_for(replica_count):
        tokens_per_replica = batch_size // replica_count * sequence_length
        return default_micro_batches(tokens_per_replica, on_gpu=bool(tf.config.list_physical_devices("GPU")))

    if cpu_threads:  # before rundir.begin: its strategy starts TensorFlow's runtime
        if micro_batches is None:  # chosen here, once, so that the model compiles with what the threads are set for
            micro_batches = default_for(replicas or 1)  # CPU replicas
        training.configure_cpu_threads(micro_batches, replicas=replicas or 1)
    state, strategy, dtype = rundir.begin(out, overwrite, replicas, mixed_precision, seed)
    splits = {"train": [], "validation": [], "test": []}
    for line in lines:
        splits[data.split_of(line)].append(line)
    tokenizer_path = os.path.join(out, TOKENIZER_FILE)
    if state == "resume" and os.path.exists(tokenizer_path):
        tokenizer = data.SubwordTokenizer.load(tokenizer_path)
    else:
        tokenizer = data.SubwordTokenizer.train(splits["train"], vocabulary_size)
        tokenizer.save(tokenizer_path)
    printer("lines: " + ", ".join(f"{k} {len(v)}" for k, v in splits.items())
            + f"; vocabulary {tokenizer.vocabulary_size}")
    config = config.replace(vocabulary_size=tokenizer.vocabulary_size)
    rundir.write_json(os.path.join(out, CONFIG_FILE), config.to_dict())
    train_ds = data.make_lm_dataset(splits["train"], tokenizer, sequence_length, batch_size, seed=seed)
    val_ds = data.make_lm_dataset(splits["validation"] or splits["train"][:50], tokenizer, sequence_length,
                                  batch_size, shuffle=False)
    if micro_batches is None:
        micro_batches = default_for(strategy.num_replicas_in_sync)
    model = _compiled_model(config, dtype, strategy, warmup_steps, micro_batches)
    evaluator = training.EvaluateEvery(val_ds, every=eval_every, printer=printer)
    remaining = budget - (time.monotonic() - start)
    fit_start = time.monotonic()
    callbacks = [evaluator] + ([training.StopAfterSteps(max_steps)] if max_steps else [])
    training.fit(model, train_ds, validation_data=val_ds, epochs=1000, callbacks=callbacks, strategy=strategy,
                 run_dir=out, time_budget=max(remaining - 0.05 * budget, 1.0), backup_every=eval_every, verbose=0)
    train_seconds = time.monotonic() - fit_start
    model.preprocessor = tokenizer
    model.save_to_preset(out, overwrite=True)  # the run directory is a preset: model, config, tokenizer
    val = model.evaluate(val_ds, verbose=0, return_dict=True)
    test_perplexity = _test_perplexity(model, splits["test"], tokenizer, sequence_length, batch_size, printer)
    sample = model.generate("def ", max_new_tokens=min(48, sequence_length - 8))
    metrics = {"val_perplexity": float(val["perplexity"]), "val_loss": float(val["loss"]),
               "test_perplexity": test_perplexity, "steps": int(model.optimizer.iterations.numpy()),
               "train_seconds": round(train_seconds, 1), "parameters": model.count_params(), "curve": evaluator.rows,
               "dtype_policy": model.dtype_policy.name, "sample": "def " + sample,
               "seconds": round(time.monotonic() - start, 1)}
    rundir.write_json(os.path.join(out, rundir.FINISHED_MARKER), metrics)
    printer(f"validation perplexity {metrics['val_perplexity']:.2f}"
            + ("" if test_perplexity is None else f", test perplexity {test_perplexity:.2f}")
            + f"\nsample: {metrics['sample']!r}")
    return metrics
