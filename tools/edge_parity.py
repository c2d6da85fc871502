"""Edge == SavedModel parity of a translation run on the recipe's test split, and decoding comparisons.

Parity: the float32 and dynamic-range int8 TFLite decoders run by `tfformer.edge.Generator` against the
SavedModel's `serving_default` (loaded with `tf.saved_model.load`, batches of 64), on the whole split the recipe
scores (`translation.evaluation_pairs`):

    TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python tools/edge_parity.py --run RUN [--work DIR] [--beam-size 4]

prints and writes `DIR/parity.json` (exact-match rates against the SavedModel, BLEU and chrF of each against the
references, seconds) and `DIR/differences.txt`: each float32 translation that differs, with where it parts:
`mask` (the graph's placeholder masking differs from Python's), `tokenize` (different source ids), `batch` (the
SavedModel gives the edge's string for the text alone: padding in a batch moved a near tie), `decoding`
(different new ids; greedy: the edge's logit margin at the first one) or `text` (same ids, different string).
The SavedModel and the decoder files are written to DIR once and reused.

Decodings: the run's Keras model with each decoding, same weights, so the comparison does not depend on the
machine's load:

    .venv/bin/python tools/edge_parity.py --run RUN --decodings greedy beam4:0.6 beam4:1.0 [--weights FILE]

`--weights` loads other weights first (e.g. RUN/last.weights.h5, the final weights of an averaged run).
"""

import argparse
import json
import os
import platform
import re
import sys
import tempfile
import time


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tfformer import edge, export, training
from tfformer.data import placeholders
from tfformer.recipes import rundir, translation
from tfformer.tokens import START_ID

QUANTIZATIONS = {"float32": None, "int8": "dynamic"}


def cpu_model():
    try:
        with open("/proc/cpuinfo") as handle:
            found = re.search(r"^model name\s*:\s*(.+)$", handle.read(), re.M)
        return found.group(1).strip() if found else platform.processor()
    except OSError:
        return platform.processor()


def parse_decoding(text):
    """'greedy' -> (None, 0.6); 'beam4:0.6' -> (4, 0.6)."""
    if text == "greedy":
        return None, translation.LENGTH_PENALTY
    found = re.fullmatch(r"beam([0-9]+):([0-9]*\.?[0-9]+)", text)
    if not found or int(found.group(1)) < 1:
        raise ValueError(f"A decoding is 'greedy' or 'beam<K>:<length penalty>' (e.g. beam4:0.6). Received: {text!r}")
    return int(found.group(1)), float(found.group(2))


# printf conversions as C reads them (flags, width, precision, length, conversion; `%%`), written apart from
# tfformer.data.placeholders so that this check does not share its patterns.
PRINTF = re.compile(r"%(?:[0-9]+\$)?[-+ #0']*(?:[0-9]+|\*)?(?:\.(?:[0-9]+|\*)?)?(?:hh|h|ll|l|L|q|j|z|t)?"
                    r"[diouxXeEfFgGaAcsCSpnm%]")


def kept(source, output):
    """Whether `output` holds every printf conversion of `source` (as a multiset) and its leading and trailing
    newlines."""
    return (sorted(PRINTF.findall(source)) == sorted(PRINTF.findall(output))
            and source.startswith("\n") == output.startswith("\n") and source.endswith("\n") == output.endswith("\n"))


def scores(hypotheses, references):
    return {"bleu": round(training.corpus_bleu(hypotheses, references), 2),
            "chrf": round(translation.corpus_chrf(hypotheses, references), 2)}


def work_dir(work, tool, run):
    """`work` (made if missing), else a new scratch directory from `tempfile` named after `tool` and the run;
    exports found in a `work` that is given again are reused (`build`)."""
    if work is None:
        return tempfile.mkdtemp(prefix=f"{tool}-{os.path.basename(os.path.normpath(run))}-")
    os.makedirs(work, exist_ok=True)
    return work


def build(run, work, beam_size=None, printer=print):
    """The SavedModel (version dir) and the float32/int8 decoder files of `run` under `work`, written if missing."""
    model = translation.load_run(run)
    max_length = rundir.read_json(os.path.join(run, translation.RUN_FILE))["max_length"]
    base = os.path.join(work, f"saved_model-beam{beam_size}" if beam_size else "saved_model")
    versions = sorted(int(v) for v in os.listdir(base) if v.isdigit()) if os.path.isdir(base) else []
    if versions:
        saved = os.path.join(base, str(versions[-1]))
    else:
        start = time.monotonic()
        saved = export.saved_model(model, base, tokenizer=model.preprocessor, max_new_tokens=max_length,
                                   beam_size=beam_size)
        printer(f"SavedModel written in {time.monotonic() - start:.0f}s: {saved}")
    decoders = {}
    for name, quantize in QUANTIZATIONS.items():
        path = os.path.join(work, f"decoder-{name}.tflite")
        if not os.path.exists(path):
            start = time.monotonic()
            export.tflite_decoder(model, path, tokenizer=model.preprocessor, quantize=quantize)
            printer(f"{name} decoder written in {time.monotonic() - start:.0f}s: {path}")
        decoders[name] = path
    return saved, decoders


def saved_model_translations(serve, texts, batch_size=64):
    import tensorflow as tf

    out = []
    for start in range(0, len(texts), batch_size):
        batch = tf.constant(texts[start:start + batch_size])
        out += [s.decode("utf-8") for s in serve(text=batch)["translation"].numpy()]
    return out


def _first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def explain(text, edge_text, serve, generate_ids, gen, tokenizer, max_new_tokens, beam_size, length_penalty):
    """Where the edge's translation of `text` parts from the SavedModel's (see the module docstring)."""
    import tensorflow as tf

    masked = placeholders.mask(text)
    in_graph = placeholders.mask_tf(tf.constant([text]))["text"].numpy()[0].decode("utf-8")
    if in_graph != masked.text:
        return {"where": "mask", "mask": masked.text, "mask_tf": in_graph}
    host = tokenizer.tokenize([masked.text]).to_list()[0][: gen.source_length]
    on_edge = gen.tokenize(masked.text)[: gen.source_length]
    if host != on_edge:
        return {"where": "tokenize", "position": _first_difference(host, on_edge)}
    alone = serve(text=tf.constant([text]))["translation"].numpy()[0].decode("utf-8")
    if alone == edge_text:
        return {"where": "batch"}
    served = generate_ids(encoder_token_ids=tf.constant([host + [0]], tf.int32))["token_ids"].numpy()[0].tolist()
    served = served[: served.index(3) + 1] if 3 in served else [t for t in served if t]
    new = gen.translate(host, max_new_tokens=max_new_tokens, beam_size=beam_size, length_penalty=length_penalty)
    if served == new:
        return {"where": "text"}
    position = _first_difference(served, new)
    result = {"where": "decoding", "position": position, "saved_model_ids": served, "edge_ids": new}
    if not beam_size and position < len(served) and position < len(new):
        # The edge's logits at the parting step, fed the tokens both chose before it.
        logits = gen.next_logits([START_ID] + served[:position], source_ids=host)
        result["edge_logit_margin"] = float(logits[new[position]] - logits[served[position]])
    return result


def compare(run, texts, references=None, work=None, beam_size=None, length_penalty=None, explain_differences=True,
            printer=print):
    """Translations of `texts` by the run's SavedModel and its float32/int8 edge decoders, and how they agree.

    Returns a dict: `n`, `exact_match` (`{"float32": rate, "int8": rate}` of strings equal to the SavedModel's),
    `seconds`, `translations` (`{"saved_model", "float32", "int8"}` lists), `differences` (float32's, explained),
    and with `references`, `scores` (BLEU and chrF of each).
    """
    import tensorflow as tf

    work = work_dir(work, "edge-parity", run)
    length_penalty = translation.LENGTH_PENALTY if length_penalty is None else length_penalty
    max_length = rundir.read_json(os.path.join(run, translation.RUN_FILE))["max_length"]
    saved, decoders = build(run, work, beam_size, printer)
    loaded = tf.saved_model.load(saved)
    serve = loaded.signatures["serving_default"]
    results, seconds = {}, {}
    start = time.monotonic()
    results["saved_model"] = saved_model_translations(serve, texts)
    seconds["saved_model"] = round(time.monotonic() - start, 1)
    generators = {}
    for name, path in decoders.items():
        generators[name] = gen = edge.Generator(path)
        start = time.monotonic()
        results[name] = [gen.translate_text(t, max_new_tokens=max_length, beam_size=beam_size,
                                            length_penalty=length_penalty) for t in texts]
        seconds[name] = round(time.monotonic() - start, 1)
        printer(f"{name} edge: {seconds[name]}s for {len(texts)} texts")
    report = {
        "n": len(texts),
        "beam_size": beam_size,
        "length_penalty": length_penalty if beam_size else None,
        "exact_match": {name: round(sum(a == b for a, b in zip(results[name], results["saved_model"]))
                                    / max(len(texts), 1), 4) for name in decoders},
        "seconds": seconds,
        # the share of texts whose printf conversions and edge newlines survive (issue 43: all of them)
        "printf_and_newlines_kept": {name: round(sum(kept(t, o) for t, o in zip(texts, outs)) / max(len(texts), 1), 4)
                                     for name, outs in results.items()},
        "translations": results,
    }
    if references is not None:
        report["scores"] = {name: scores(hyps, references) for name, hyps in results.items()}
    differences = []
    if explain_differences:
        tokenizer = translation.load_run(run).preprocessor
        for text, served, mine in zip(texts, results["saved_model"], results["float32"]):
            if served != mine:
                why = explain(text, mine, serve, loaded.signatures["generate_ids"], generators["float32"], tokenizer,
                              max_length, beam_size, length_penalty)
                differences.append({"source": text, "saved_model": served, "float32": mine, **why})
    report["differences"] = differences
    report["difference_kinds"] = {kind: sum(d["where"] == kind for d in differences)
                                  for kind in ("mask", "tokenize", "batch", "decoding", "text")}
    return report


def compare_decodings(run, pairs, decodings, weights=None, printer=print):
    """BLEU/chrF of the run's Keras model on `pairs` for each decoding ('greedy', 'beam4:0.6', ...)."""
    model = translation.load_run(run)
    if weights:
        model.load_weights(weights)
    max_length = rundir.read_json(os.path.join(run, translation.RUN_FILE))["max_length"]
    references = [t for _, t in pairs]
    report = {}
    for decoding in decodings:
        beam_size, length_penalty = parse_decoding(decoding)
        start = time.monotonic()
        _, hypotheses = translation.evaluate_bleu(model, pairs, max_new_tokens=max_length, beam_size=beam_size,
                                                  length_penalty=length_penalty)
        report[decoding] = {**scores(hypotheses, references), "seconds": round(time.monotonic() - start, 1)}
        printer(f"{decoding}: BLEU {report[decoding]['bleu']:.2f}, chrF {report[decoding]['chrf']:.2f} "
                f"({report[decoding]['seconds']}s)")
    return report


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True, help="a translation run directory")
    parser.add_argument("--work", help="where the exports and results go (default: a new temporary directory; "
                                       "given again, its exports are reused)")
    parser.add_argument("--split", default="test", choices=["train", "validation", "test"])
    parser.add_argument("--limit", type=int, help="only the first N pairs (a quick look)")
    parser.add_argument("--beam-size", type=int, help="parity of a SavedModel exported with this beam size")
    parser.add_argument("--decodings", nargs="+", help="compare decodings of the Keras model instead of parity")
    parser.add_argument("--weights", help="with --decodings: weights to load first (e.g. RUN/last.weights.h5)")
    args = parser.parse_args(argv)
    work = work_dir(args.work, "edge-parity", args.run)
    print(f"work directory: {work}")
    pairs = translation.evaluation_pairs(args.run, args.split)[: args.limit]
    header = {"run": os.path.abspath(args.run), "split": args.split, "pairs": len(pairs), "cpu": cpu_model(),
              "command": " ".join([os.path.basename(sys.executable), *sys.argv])}
    print(f"{len(pairs)} {args.split} pairs, CPU {header['cpu']}")
    if args.decodings:
        result = {**header, "weights": args.weights,
                  "decodings": compare_decodings(args.run, pairs, args.decodings, args.weights)}
        name = "decodings" + ("-" + os.path.basename(args.weights).split(".")[0] if args.weights else "")
        rundir.write_json(os.path.join(work, name + ".json"), result)
        print(f"written: {os.path.join(work, name + '.json')}")
        return 0
    report = compare(args.run, [s for s, _ in pairs], [t for _, t in pairs], work, args.beam_size)
    suffix = f"-beam{args.beam_size}" if args.beam_size else ""
    with open(os.path.join(work, f"differences{suffix}.txt"), "w") as handle:
        for d in report["differences"]:
            handle.write(json.dumps(d, ensure_ascii=False) + "\n")
    summary = {**header, **{k: v for k, v in report.items() if k not in ("translations", "differences")}}
    rundir.write_json(os.path.join(work, f"parity{suffix}.json"), summary)
    print(json.dumps({k: summary[k] for k in ("exact_match", "scores", "printf_and_newlines_kept", "difference_kinds",
                                          "seconds")}, indent=1))
    print(f"written: {os.path.join(work, f'parity{suffix}.json')}, differences{suffix}.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
