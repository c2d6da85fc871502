"""English -> X translation: learn a vocabulary, train with model.fit, report BLEU. The main job (`make demo`).

The run directory is a preset (`tfformer.models.from_preset(run)`). `translate_catalog` (a .pot/.po in, a .po
with fuzzy machine translations out) translates through the task's `translate`, which protects placeholders, edge
whitespace and accelerator marks with `tfformer.data.placeholders`, as the SavedModel does.
"""

import codecs
import os
import re
import sys
import time
import warnings

import keras

from tfformer import data, models, training
from tfformer.checks import check_int
from tfformer.data import placeholders
from tfformer.recipes import rundir

MODEL_FILE, TOKENIZER_FILE, CONFIG_FILE, RUN_FILE = "model.keras", "tokenizer.model", "config.json", "run.json"
LAST_WEIGHTS_FILE = "last.weights.h5"  # the final weights of a run whose model holds averaged ones
# How the recipe's evaluation and `translate_catalog` decode: beam search with the GNMT length penalty, which
# scores above greedy decoding on the test split (`tools/edge_parity.py --run RUN --decodings greedy beam4:0.6`);
# 0.6 is also the penalty of an export with `beam_size` (`generation.decode_fn`'s default).
BEAM_SIZE, LENGTH_PENALTY = 4, 0.6
LANGUAGE_NAMES = {"de": "German", "fr": "French", "es": "Spanish", "it": "Italian", "nl": "Dutch", "sv": "Swedish",
                  "pt_BR": "Brazilian Portuguese", "ja": "Japanese", "zh_CN": "Chinese", "ru": "Russian",
                  "pl": "Polish"}  # for plot titles


def load_pairs(target_language="de", data_file=None, locale_dir=data.corpora.DEFAULT_LOCALE_DIR):
    if data_file:
        return data.read_tsv_pairs(data_file)
    return data.gettext_pairs(target_language, locale_dir=locale_dir)


def mask_pairs(pairs):
    """Training pairs with placeholders masked (`placeholders.mask_pair`); pairs left with no text are dropped."""
    masked = (placeholders.mask_pair(source, target) for source, target in pairs)
    return [(source, target) for source, target in masked if source.strip() and target.strip()]


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


def evaluate_bleu(translator, pairs, max_new_tokens, batch_size=64, beam_size=BEAM_SIZE,
                  length_penalty=LENGTH_PENALTY):
    """`(BLEU, hypotheses)` of a `Seq2SeqTransformer` task (with its preprocessor) on `(source, reference)` pairs,
    decoded with `beam_size` (None or 1: greedy) and the GNMT `length_penalty`."""
    hypotheses = translator.translate([s for s, _ in pairs], max_new_tokens=max_new_tokens, batch_size=batch_size,
                                      beam_size=beam_size, length_penalty=length_penalty)
    return training.corpus_bleu(hypotheses, [t for _, t in pairs]), hypotheses


def corpus_chrf(hypotheses, references):
    """Corpus chrF (sacreBLEU's defaults: character 6-grams, beta 2) of detokenized strings."""
    import sacrebleu

    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references.")
    return sacrebleu.corpus_chrf(list(hypotheses), [list(references)]).score


def evaluation_pairs(run_dir, split="test"):
    """The `(source, reference)` pairs of `split` that a run's final evaluation scores: the run's corpus and
    language (run.json), raw (not masked) texts that fit in its `max_length` tokens."""
    if split not in ("train", "validation", "test"):
        raise ValueError(f"`split` must be 'train', 'validation' or 'test'. Received: split={split!r}")
    path = os.path.join(run_dir, RUN_FILE)
    if not os.path.exists(path):
        raise ValueError(f"No {RUN_FILE} in {run_dir!r}: not a translation run directory.")
    run = rundir.read_json(path)
    tokenizer = data.SubwordTokenizer.load(os.path.join(run_dir, TOKENIZER_FILE))
    pairs = load_pairs(run["target_language"], run.get("data_file"))[split]
    return filter_by_length(pairs, tokenizer, run["max_length"])


class WeightSnapshots(keras.callbacks.Callback):
    """Keeps the model's weights every `every` training steps and at the end, the last `keep` of them;
    `average()` is their mean (checkpoint averaging, Vaswani et al. 2017, section 6.1)."""

    def __init__(self, every, keep):
        super().__init__()
        self.every, self.keep, self.seen, self.snapshots = every, keep, 0, []

    def _take(self):
        self.snapshots = (self.snapshots + [self.model.get_weights()])[-self.keep:]

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen % self.every == 0:
            self._take()

    def on_train_end(self, logs=None):
        if self.seen % self.every:
            self._take()

    def average(self):
        """The element-wise mean of the kept snapshots (a non-float weight keeps its last value)."""
        import numpy as np

        return [np.mean(values, axis=0).astype(values[-1].dtype) if np.issubdtype(values[-1].dtype, np.floating)
                else values[-1] for values in zip(*self.snapshots)]


def plot_curves(rows, path, target_language="de"):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in rows]
    ax.plot(steps, [r.get("loss") for r in rows], label="train loss")
    ax.plot(steps, [r.get("val_loss") for r in rows], label="validation loss")
    ax.set_xlabel("training step")
    ax.set_ylabel("label-smoothed cross-entropy")
    ax.set_title(f"English→{LANGUAGE_NAMES.get(target_language, target_language)}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _run_tokenizer(out, state, texts, vocabulary_size, printer):
    """The run's tokenizer: the saved one when the run resumes, else learned from `texts` and saved."""
    path = os.path.join(out, TOKENIZER_FILE)
    if state == "resume" and os.path.exists(path):
        printer(f"resuming the run in {out}")
        return data.SubwordTokenizer.load(path)
    start = time.monotonic()
    tokenizer = data.SubwordTokenizer.train(texts, vocabulary_size)
    tokenizer.save(path)
    printer(f"vocabulary: {tokenizer.vocabulary_size} pieces learned in {time.monotonic() - start:.1f}s")
    return tokenizer


def _evaluate_and_report(model, test, max_length, out, printer):
    """BLEU and chrF on the `test` pairs (restored translations of the raw sources), the first 10 translations in
    `samples.txt` and printed; returns the metrics of the model and its decoding."""
    bleu, hypotheses = evaluate_bleu(model, test, max_new_tokens=max_length)
    metrics = {"bleu_test": bleu, "chrf_test": corpus_chrf(hypotheses, [t for _, t in test]), "beam_size": BEAM_SIZE,
               "length_penalty": LENGTH_PENALTY, "test_pairs": len(test), "parameters": model.count_params(),
               "dtype_policy": model.dtype_policy.name}
    samples = list(zip(test, hypotheses))[:10]
    with open(os.path.join(out, "samples.txt"), "w") as handle:
        for (source, reference), hypothesis in samples:
            handle.write(f"EN  {source!r}\nREF {reference!r}\nOUT {hypothesis!r}\n\n")
    printer(f"BLEU on the test split ({len(test)} pairs): {bleu:.2f}, chrF {metrics['chrf_test']:.2f}")
    for (source, reference), hypothesis in samples:
        printer(f"  EN  {source!r}\n  REF {reference!r}\n  OUT {hypothesis!r}")
    return metrics


def train_translation(out, preset="transformer-tiny", target_language="de", data_file=None, time_budget="15m",
                      batch_size=64, max_length=64, vocabulary_size=8192, warmup_steps=1000, overwrite=False,
                      replicas=None, mixed_precision=False, eval_every=200, seed=0, printer=print, max_steps=None,
                      average_last=4, **overrides):
    """Train English -> `target_language`; writes model, tokenizer, config, curves, BLEU and samples under `out`.

    `time_budget` counts everything: vocabulary learning, training and the final
    evaluation (about 10% of it is reserved for the latter). Returns what it writes
    to `metrics.json`: `bleu_test`, `chrf_test` (decoded with `beam_size`, `length_penalty`: the recipe's
    `BEAM_SIZE`, `LENGTH_PENALTY`), `test_pairs`, `steps` (this call's), `epochs_started`,
    `seconds` (the whole call), `train_seconds` (this call's `fit`), `curve`, `parameters`, `dtype_policy`
    (the model's) and `averaged_checkpoints`. The run trains under mixed_bfloat16 (mixed_float16 on GPUs) with
    `mixed_precision`, else float32, given to the model (the global dtype policy is left alone).

    `max_steps`: end training after this many steps (None: the time budget alone). `average_last`: with 2 or more,
    the saved model holds the mean of the weights at the last `average_last` evaluations (every `eval_every`
    steps, and the end), and the final weights go to `last.weights.h5` beside it (compare them with
    `tools/edge_parity.py --decodings ... --weights RUN/last.weights.h5`); 0 or 1 keeps the final weights.
    """
    check_int("max_steps", max_steps, allow_none=True)
    check_int("average_last", average_last, minimum=0)
    # Before `begin`, whose overwrite deletes a finished run.
    rundir.check_options(replicas, batch_size=batch_size, max_length=max_length, eval_every=eval_every)
    budget = training.parse_duration(time_budget)
    start = time.monotonic()
    # Everything that can be refused is, before the run directory is written (a corrected retry would find a run).
    config = rundir.preset_config(preset, "seq2seq", "Translation", vocabulary_size, max_length, overrides)
    splits = load_pairs(target_language, data_file)
    state, strategy, dtype = rundir.begin(out, overwrite, replicas, mixed_precision, seed)
    # The model learns on masked text (placeholders as reserved pieces it copies); BLEU is measured on the
    # restored translations of the raw test sources.
    splits = {name: pairs if name == "test" else mask_pairs(pairs) for name, pairs in splits.items()}
    printer(f"pairs: train {len(splits['train'])}, validation {len(splits['validation'])}, test {len(splits['test'])}")

    tokenizer = _run_tokenizer(out, state, [s for pair in splits["train"] for s in pair], vocabulary_size, printer)
    splits = {name: filter_by_length(pairs, tokenizer, max_length) for name, pairs in splits.items()}
    printer(f"pairs that fit in {max_length} tokens: " + ", ".join(f"{k} {len(v)}" for k, v in splits.items()))

    config = config.replace(vocabulary_size=tokenizer.vocabulary_size)
    rundir.write_json(os.path.join(out, CONFIG_FILE), config.to_dict())
    rundir.write_json(os.path.join(out, RUN_FILE), dict(preset=preset, target_language=target_language,
                                                        data_file=data_file, max_length=max_length, seed=seed))
    train_ds = data.make_translation_dataset(splits["train"], tokenizer, batch_size, max_length, seed=seed)
    val_ds = data.make_translation_dataset(splits["validation"], tokenizer, batch_size, max_length, shuffle=False)
    with strategy.scope():
        model = models.build_model(config, dtype)
        compile_model(model, config, warmup_steps)
    printer(f"model: {preset}, {model.count_params():,} parameters, {strategy.num_replicas_in_sync} replica(s), "
            f"policy {model.dtype_policy.name}")

    remaining = budget - (time.monotonic() - start)
    train_seconds = max(remaining - 0.1 * budget, 1.0)
    evaluator = training.EvaluateEvery(val_ds, every=eval_every, printer=printer)
    callbacks = [evaluator] + ([training.StopAfterSteps(max_steps)] if max_steps else [])
    snapshots = WeightSnapshots(eval_every, average_last) if average_last >= 2 else None
    if snapshots:
        callbacks.append(snapshots)
    fit_start = time.monotonic()
    history = training.fit(model, train_ds, validation_data=val_ds, epochs=1000, callbacks=callbacks,
                           strategy=strategy, run_dir=out, time_budget=train_seconds, backup_every=eval_every,
                           verbose=0)
    fit_seconds = time.monotonic() - fit_start
    averaged = len(snapshots.snapshots) if snapshots and len(snapshots.snapshots) >= 2 else 0
    if averaged:
        model.save_weights(os.path.join(out, LAST_WEIGHTS_FILE))
        model.set_weights(snapshots.average())
        printer(f"model weights: the mean of the last {averaged} evaluations' (final ones in {LAST_WEIGHTS_FILE})")
    model.preprocessor = tokenizer
    model.save_to_preset(out, overwrite=True)  # the run directory is a preset: model, config, tokenizer

    metrics = _evaluate_and_report(model, splits["test"], max_length, out, printer)
    metrics.update(averaged_checkpoints=averaged, steps=evaluator.rows[-1]["step"] if evaluator.rows else 0,
                   epochs_started=len(history.get("loss", [])), seconds=round(time.monotonic() - start, 1),
                   train_seconds=round(fit_seconds, 1), curve=evaluator.rows)
    if evaluator.rows:
        plot_curves(evaluator.rows, os.path.join(out, "loss.png"), target_language)
    rundir.write_json(os.path.join(out, rundir.FINISHED_MARKER), metrics)
    return metrics


def load_run(run_dir):
    """The translator (a `Seq2SeqTransformer` with its tokenizer as `preprocessor`) of a finished translation run."""
    path = os.path.join(run_dir, MODEL_FILE)
    if not os.path.exists(path):
        raise ValueError(f"No trained model in {run_dir!r} (expected {MODEL_FILE}); train one with `tfformer train`.")
    translator = models.from_preset(run_dir)
    if not isinstance(translator, models.Seq2SeqTransformer):
        raise ValueError(f"The run in {run_dir!r} holds a {type(translator).__name__}, not a translator (the "
                         "Seq2SeqTransformer of `tfformer train translation`).")
    tokenizer = translator.require_preprocessor("translate")
    if data.UNK_ID in tokenizer.tokenize([placeholders.RESERVED_SYMBOLS[0]]).flat_values.numpy():
        # Translation masks placeholders; a model that never saw the masked pieces translates much worse.
        warnings.warn(f"The run in {run_dir!r} was trained before placeholder masking (its vocabulary lacks the "
                      "reserved pieces); retrain it for good translations.", stacklevel=2)
    return translator


# Plural-Forms headers (GNU gettext manual, "Plural forms") for catalogs that do not carry one yet (a .pot).
PLURAL_FORMS = {
    "de": "nplurals=2; plural=(n != 1);",
    "en": "nplurals=2; plural=(n != 1);",
    "es": "nplurals=2; plural=(n != 1);",
    "it": "nplurals=2; plural=(n != 1);",
    "nl": "nplurals=2; plural=(n != 1);",
    "sv": "nplurals=2; plural=(n != 1);",
    "fr": "nplurals=2; plural=(n > 1);",
    "pt_BR": "nplurals=2; plural=(n > 1);",
    "ja": "nplurals=1; plural=0;",
    "zh_CN": "nplurals=1; plural=0;",
    "ru": "nplurals=3; plural=(n%10==1 && n%100!=11 ? 0 : n%10>=2 && n%10<=4 && (n%100<10 || n%100>=20) ? 1 : 2);",
    "pl": "nplurals=3; plural=(n==1 ? 0 : n%10>=2 && n%10<=4 && (n%100<10 || n%100>=20) ? 1 : 2);",
}


_PO_LINE = re.compile(r'\s*(?:(?:msgctxt|msgid|msgid_plural|msgstr(?:\[[0-9]+\])?)\s+)?"(?:[^"\\]|\\.)*"\s*')


def read_catalog(path):
    """A `polib.POFile` of a .po or .pot; errors name the file and the line."""
    import polib

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such file; expected a .po or .pot catalog.")
    with open(path, "rb") as handle:
        raw = handle.read()
    encoding = "utf-8"
    match = re.search(rb'"Content-Type:[^"]*?charset=([^"\\\s;]+)', raw)
    if match:
        name = match.group(1).decode("ascii", "replace")
        line = raw[: match.start()].count(b"\n") + 1
        if name.upper() != "CHARSET":  # a template's placeholder: read it as UTF-8
            try:
                codecs.lookup(name)
            except LookupError:
                raise ValueError(f"{path}:{line}: unknown encoding {name!r} in the Content-Type header; "
                                 "expected a charset such as UTF-8 or ISO-8859-1.") from None
            encoding = name
    try:
        text = raw.decode(encoding)
    except UnicodeDecodeError as error:
        line = raw[: error.start].count(b"\n") + 1
        raise ValueError(f"{path}:{line}: byte {raw[error.start]:#04x} is not valid {encoding}; "
                         "fix the file or its Content-Type charset.") from None
    # polib skips some broken lines (an unterminated string) without a word: check every line first.
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip() and not line.lstrip().startswith("#") and not _PO_LINE.fullmatch(line):
            raise ValueError(f"{path}:{number}: malformed PO file (expected a keyword and a quoted string, "
                             f"found {line.strip()[:60]!r}).")
    try:
        return polib.pofile(text, encoding=encoding)
    except (OSError, ValueError) as error:
        found = re.search(r"line (\d+)", str(error))
        where = f"{path}:{found.group(1)}" if found else path
        detail = str(error).split(": ", 1)[1] if ": " in str(error) else str(error)
        raise ValueError(f"{where}: malformed PO file ({detail}).") from None


def _nplurals(catalog, target_language, path):
    header = catalog.metadata.get("Plural-Forms", "")
    found = re.search(r"nplurals\s*=\s*([0-9]+)", header)
    if found and int(found.group(1)) >= 1:
        return int(found.group(1))
    language = catalog.metadata.get("Language") or target_language
    forms = PLURAL_FORMS.get(language) or PLURAL_FORMS.get(str(language).split("_")[0])
    if forms is None:
        raise ValueError(f"{path}: the catalog has plural messages but no Plural-Forms header, and tfformer knows no "
                         f"default for language {language!r}; add e.g. 'Plural-Forms: nplurals=2; plural=(n != 1);'.")
    catalog.metadata["Plural-Forms"] = forms
    return int(re.search(r"nplurals=([0-9]+)", forms).group(1))


def _progress(done, total, stream):
    width = 30
    filled = width * done // max(total, 1)
    stream.write(f"\rtranslating [{'#' * filled}{'.' * (width - filled)}] {done}/{total} messages")
    if done >= total:
        stream.write("\n")
    stream.flush()


def translate_catalog(run, po, out, overwrite=False, batch_size=32, max_new_tokens=None, beam_size=None,
                      progress=None, translator=None, target_language=None):
    """Fill the untranslated entries of a .pot or .po with machine translations, marked `fuzzy`; write `out`.

    Existing translations, comments, flags, references, contexts and the order of entries are kept. A plural entry
    gets `msgstr[1..n-1]` from `msgid_plural` and `msgstr[0]` from `msgid`, or from `msgid_plural` too when the two
    differ in placeholders and form 0 serves more than n == 1 ("One file" is wrong for 21 in Russian); n comes
    from the catalog's Plural-Forms, or a default for the target language, then written to the header.
    Placeholders, leading/trailing whitespace and accelerator marks are protected (`Seq2SeqTransformer.translate`).
    Returns a
    dict: `translated` (entries filled), `messages` (texts sent to the model), `written` (the path, or None when
    there was nothing to translate: then nothing is written).

    Args:
        run: a translation run directory (a preset with run.json), or None with `translator`.
        translator: a `Seq2SeqTransformer` with its preprocessor, instead of `run`.
        po, out: the input catalog and the output path. An existing `out` is replaced only with `overwrite`.
        progress: a progress bar on stderr; None shows one when there is more than one batch.
        beam_size: beam search (1: greedy); None decodes as the recipe's evaluation does (`BEAM_SIZE`).
    """
    out = os.fspath(out)
    if os.path.isdir(out):
        raise ValueError(f"`out` must be the path of a .po file to write. Received a directory: {out!r}")
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"`out` {out!r} cannot be written: {folder!r} is not a writable directory.")
    if os.path.exists(out) and not overwrite:
        raise ValueError(f"{out}: the output file exists; pass --overwrite (overwrite=True) to replace it.")
    check_int("batch_size", batch_size)
    check_int("max_new_tokens", max_new_tokens, allow_none=True)
    catalog = read_catalog(po)
    todo = catalog.untranslated_entries()
    if not todo:
        return {"translated": 0, "messages": 0, "written": None}
    if translator is None:
        if run is None:
            raise ValueError("Give `run` (a translation run directory) or `translator`.")
        translator = load_run(run)
    if target_language is None and run is not None and os.path.exists(os.path.join(run, RUN_FILE)):
        target_language = rundir.read_json(os.path.join(run, RUN_FILE)).get("target_language")
    nplurals = _nplurals(catalog, target_language, po) if any(e.msgid_plural for e in todo) else None
    if str(catalog.metadata.get("Content-Type", "")).upper().endswith("CHARSET"):
        catalog.metadata["Content-Type"] = "text/plain; charset=UTF-8"
        catalog.encoding = "utf-8"
    if catalog.metadata.get("Content-Transfer-Encoding", "").upper() == "ENCODING":
        catalog.metadata["Content-Transfer-Encoding"] = "8bit"
    if not catalog.metadata.get("Language") and target_language:
        catalog.metadata["Language"] = target_language
    max_new_tokens = translator.config.max_sequence_length if max_new_tokens is None else max_new_tokens
    beam_size = BEAM_SIZE if beam_size is None else beam_size

    texts = list(dict.fromkeys(t for e in todo for t in ([e.msgid, e.msgid_plural] if e.msgid_plural else [e.msgid])))
    show = progress if progress is not None else len(texts) > batch_size
    translated = {}
    for start in range(0, len(texts), batch_size):
        batch = texts[start : start + batch_size]
        translated.update(zip(batch, translator.translate(batch, max_new_tokens=max_new_tokens, batch_size=batch_size,
                                                          beam_size=beam_size, length_penalty=LENGTH_PENALTY)))
        if show:
            _progress(start + len(batch), len(texts), sys.stderr)
    only_one = re.search(r"plural=\(?n!=1\)?;?$", re.sub(r"\s", "", catalog.metadata.get("Plural-Forms", "")))
    for entry in todo:
        if entry.msgid_plural:
            singular, plural = translated[entry.msgid], translated[entry.msgid_plural]
            # msgstr[0] serves n == 1 alone only under `n != 1`; elsewhere it must hold msgid_plural's placeholders.
            same = sorted(placeholders.find_placeholders(entry.msgid)) == sorted(
                placeholders.find_placeholders(entry.msgid_plural))
            first = singular if nplurals > 1 and (same or only_one) else plural
            entry.msgstr_plural = {i: first if i == 0 else plural for i in range(nplurals)}
        else:
            entry.msgstr = translated[entry.msgid]
        if "fuzzy" not in entry.flags:
            entry.flags.insert(0, "fuzzy")
    catalog.save(out)
    return {"translated": len(todo), "messages": len(texts), "written": out}
