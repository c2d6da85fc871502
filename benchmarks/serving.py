"""Serving under load (issue 54): `tfformer serve` with and without `--enable_batching`, in one run.

    python -m benchmarks.serving [--run DIR] [--minutes 15] [--seconds 60] [--clients 32] [--rounds 2]
                                 [--batching_parameters_file FILE] [--smoke]

The model is the demo translator: `--run DIR`, a run directory of `tfformer demo` / `make demo`
(`translation.train_translation`); without it, this benchmark trains one first with the same recipe for
`--minutes` (default 15, `tfformer demo`'s DEMO_MINUTES) in a temporary directory, and says so. It is
exported as `tfformer export RUN --format saved_model` exports it (beam search as the run was evaluated, the
tokenizer in the graph, TF Serving's warm-up records), then served by two `tfformer serve` subprocesses on the
same directory: one plain, one with `--enable_batching` and `--batching_parameters_file` (default:
`BATCHING_PARAMETERS`, written to a temporary file; its text goes into every row).

Each round, in a shuffled order per round, each server gets `--clients` concurrent clients, each sending
one-sentence REST requests (`{"instances": [sentence]}`, the run's test sources in turn) back to back for
`--seconds`, after an untimed warm-up of the same load; then one client alone sends `--single` requests. Rows
(JSON lines, `bench: serving`): sentences/s, median and p90 latency under load, one-client median latency,
failed requests, and for the batched server its mean batch size (from its Prometheus metrics page). A
`serving_agreement` row: the fraction of batched answers (up to `agreement` sentences) that equal what one
client alone gets from the plain server. Then the issue's goals, from the medians over rounds: batched
throughput >= 2.5x plain, batched median latency <= 0.5x plain, and one client with batching at most
`batch_timeout_micros` + 10% slower than without.

`--smoke`: an untrained tiny translator (no training), 4 clients for 2 seconds, one round; the numbers mean
nothing (CI runs it so the benchmark cannot rot).
"""

import argparse
import http.client
import json
import os
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from benchmarks import common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The parameters the README recommends for a CPU machine (measured with this benchmark on 2 cores): one batch
# thread per model call at a time (TensorFlow's ops already use every core), no waiting for more requests.
BATCHING_PARAMETERS = """max_batch_size { value: 32 }
batch_timeout_micros { value: 0 }
max_enqueued_batches { value: 32 }
num_batch_threads { value: 1 }
"""
FULL = dict(seconds=60.0, warmup_seconds=10.0, clients=32, single=30, rounds=2, agreement=100)
SMOKE = dict(seconds=2.0, warmup_seconds=1.0, clients=4, single=3, rounds=1, agreement=5)
READY = re.compile(r"tfformer serve: .*REST at (http://\S+)")
SMOKE_WORDS = ["open", "close", "the", "file", "new", "folder", "save", "old", "delete", "a"]


def _smoke_translator(out):
    """An untrained tiny translator and a tokenizer learned on `SMOKE_WORDS` (the smoke run trains nothing)."""
    import keras

    from tfformer import data, models

    texts = [" ".join(random.Random(i).choices(SMOKE_WORDS, k=4)) for i in range(200)]
    tokenizer = data.SubwordTokenizer.train(texts, vocabulary_size=60)
    config = models.TransformerConfig(vocabulary_size=tokenizer.vocabulary_size, hidden_dim=16, num_heads=2,
                                      intermediate_dim=32, num_encoder_layers=1, num_decoder_layers=1, dropout=0.0,
                                      max_sequence_length=16)
    keras.utils.set_random_seed(0)
    model = models.build_seq2seq(config)
    model.preprocessor = tokenizer
    model.save_to_preset(out)
    return texts[:50]


def translator_run(args, scratch):
    """`(run directory, test sentences, what it is)`: `--run`, or a new run of the demo recipe (or the smoke's)."""
    from tfformer.recipes import rundir, translation

    if args.smoke and not args.run:
        out = os.path.join(scratch, "smoke-run")
        return out, _smoke_translator(out), "an untrained tiny translator (smoke)"
    if args.run:
        out, what = args.run, f"the demo translator in {args.run}"
    else:
        out = os.path.join(scratch, "demo-run")
        print(f"No --run given: training the demo translator with `tfformer demo`'s recipe for {args.minutes:g} "
              f"minutes in {out} (pass --run RUN to serve a `make demo` run instead).", flush=True)
        translation.train_translation(out, time_budget=f"{args.minutes}m")
        what = f"the demo translator trained here for {args.minutes:g} minutes"
    run = rundir.read_json(os.path.join(out, translation.RUN_FILE))
    sources = [source for source, _ in translation.load_pairs(run["target_language"], run["data_file"])["test"]]
    return out, sources, what


def export_run(run, base):
    """`tfformer export RUN --format saved_model --out BASE`: version 1 of the translator under `base`."""
    from tfformer import export, models
    from tfformer.recipes import translation

    model = models.from_preset(run)
    beam_size = translation.BEAM_SIZE if isinstance(model, models.Seq2SeqTransformer) else None
    return export.saved_model(model, base, version=1, tokenizer=model.preprocessor, beam_size=beam_size)


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn_server(base, log_path, *flags):
    """`tfformer serve` on `base` in a subprocess (returns at once: `wait_ready` waits until it serves)."""
    command = [sys.executable, "-m", "tfformer.cli", "serve", "--model_name", "translator", "--model_base_path",
               base, "--port", "0", "--rest_api_port", str(_free_port()), "--access_log", "",
               "--file_system_poll_wait_seconds", "0", *flags]
    with open(log_path, "w") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})


def wait_ready(process, log_path, timeout=600):
    """The REST url of a `spawn_server` process once it serves (its version loaded and warmed up)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        with open(log_path) as handle:
            match = READY.search(handle.read())
        if match:
            return match.group(1)
        time.sleep(0.2)
    process.kill()
    with open(log_path) as handle:
        raise RuntimeError(f"tfformer serve did not start:\n{handle.read()[-3000:]}")


class _Sender:
    """One client: a keep-alive connection sending `{"instances": [sentence]}` to the translator."""

    def __init__(self, url):
        host, port = url.split("://", 1)[1].split(":")
        self.connection = http.client.HTTPConnection(host, int(port), timeout=300)

    def send(self, sentence):
        """`(seconds, translation)` of one request (translation None if it failed)."""
        body = json.dumps({"instances": [sentence]}).encode()
        start = time.perf_counter()
        try:
            self.connection.request("POST", "/v1/models/translator:predict", body,
                                    {"Content-Type": "application/json"})
            response = self.connection.getresponse()
            reply = json.loads(response.read())
            (translation,) = reply["predictions"] if response.status == 200 else [None]
        except (OSError, http.client.HTTPException, ValueError, KeyError):
            self.connection.close()
            translation = None
        return time.perf_counter() - start, translation


def load(url, sentences, clients, seconds):
    """`clients` clients sending back to back for `seconds`: `(elapsed, [(sentence index, latency, translation)])`."""
    results, lock = [], threading.Lock()
    counter = iter(range(10**9))
    end = time.perf_counter() + seconds

    def client():
        sender = _Sender(url)
        while time.perf_counter() < end:
            with lock:
                index = next(counter)
            result = sender.send(sentences[index % len(sentences)])
            with lock:
                results.append((index % len(sentences), *result))
        sender.connection.close()

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    [thread.start() for thread in threads]
    [thread.join() for thread in threads]
    return time.perf_counter() - start, results


def one_client(url, sentences, count):
    sender = _Sender(url)
    latencies = [sender.send(sentences[index % len(sentences)])[0] for index in range(count)]
    sender.connection.close()
    return statistics.median(latencies)


def mean_batch_size(url):
    """Rows per model call so far, from the server's `:tensorflow:serving:batching_session:processed_batch_size`."""
    host, port = url.split("://", 1)[1].split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    connection.request("GET", "/monitoring/prometheus/metrics")
    page = connection.getresponse().read().decode()
    connection.close()
    name = ":tensorflow:serving:batching_session:processed_batch_size"
    values = dict(re.findall(rf"^{name}_(sum|count)\{{\}} (\S+)$", page, re.MULTILINE))
    return float(values["sum"]) / float(values["count"]) if values.get("count", "0") != "0" else None


def measure(system, url, sentences, shape, batched):
    """One round of one server: warm-up load, timed load, one client alone: `(row, {sentence index: translation})`."""
    load(url, sentences, shape["clients"], shape["warmup_seconds"])
    elapsed, results = load(url, sentences, shape["clients"], shape["seconds"])
    latencies = [seconds for _, seconds, translation in results if translation is not None]
    row = {"bench": "serving", "system": system, "clients": shape["clients"], "seconds": round(elapsed, 2),
           "requests": len(results), "failed": len(results) - len(latencies),
           "sentences_per_s": round(len(latencies) / elapsed, 2),
           "median_ms": round(1000 * float(np.median(latencies)), 1) if latencies else None,
           "p90_ms": round(1000 * float(np.percentile(latencies, 90)), 1) if latencies else None,
           "one_client_median_ms": round(1000 * one_client(url, sentences, shape["single"]), 1)}
    if batched:
        row["mean_batch_size"] = mean_batch_size(url)
    return row, {index: translation for index, _, translation in results if translation is not None}


def agreement(url, sentences, answers, count):
    """`{"sentences": n, "equal": fraction}`: how many of (up to `count` of) the batched server's `answers`
    (`{sentence index: translation}`) one client alone gets from the plain server at `url`, word for word."""
    sender = _Sender(url)
    checked = sorted(answers)[:count]
    same = sum(sender.send(sentences[index])[1] == answers[index] for index in checked)
    sender.connection.close()
    return {"bench": "serving_agreement", "sentences": len(checked), "equal": round(same / max(len(checked), 1), 4)}


def _goals(rows, timeout_micros):
    def median_of(system, field):
        return statistics.median(row[field] for row in rows if row["system"] == system)

    plain, batched = "tfformer serve", "tfformer serve --enable_batching"
    one_plain, one_batched = median_of(plain, "one_client_median_ms"), median_of(batched, "one_client_median_ms")
    return [
        common.goal("serving: batched throughput >= 2.5x unbatched",
                    median_of(batched, "sentences_per_s") / median_of(plain, "sentences_per_s"), 2.5),
        common.goal("serving: batched median latency <= 0.5x unbatched",
                    median_of(batched, "median_ms") / median_of(plain, "median_ms"), 0.5, at_least=False),
        common.goal("serving: one client batched <= (unbatched + batch_timeout_micros) x 1.1",
                    one_batched / (one_plain + timeout_micros / 1000), 1.1, at_least=False,
                    one_client_ms={"unbatched": one_plain, "batched": one_batched}),
    ]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", help="a `tfformer demo` run directory (default: train one here)")
    parser.add_argument("--minutes", type=float, default=float(os.environ.get("DEMO_MINUTES", "15")),
                        help="training budget without --run (default: DEMO_MINUTES or 15)")
    parser.add_argument("--seconds", type=float, help="timed load per server and round (default: 60)")
    parser.add_argument("--clients", type=int, help="concurrent clients (default: 32)")
    parser.add_argument("--rounds", type=int, help="rounds (default: 2)")
    parser.add_argument("--batching_parameters_file", help="default: BATCHING_PARAMETERS of this module")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    shape = dict(SMOKE if args.smoke else FULL)
    shape.update({key: value for key, value in (("seconds", args.seconds), ("clients", args.clients),
                                                ("rounds", args.rounds)) if value is not None})
    scratch = tempfile.mkdtemp(prefix="serving-bench-")
    run, sentences, what = translator_run(args, scratch)
    base = os.path.join(scratch, "translator")
    export_run(run, base)
    parameters_file = args.batching_parameters_file or os.path.join(scratch, "batching.config")
    if not args.batching_parameters_file:
        with open(parameters_file, "w") as handle:
            handle.write(BATCHING_PARAMETERS)
    with open(parameters_file) as handle:
        parameters = handle.read()
    monitoring = os.path.join(scratch, "monitoring.config")
    with open(monitoring, "w") as handle:
        handle.write("prometheus_config { enable: true }\n")
    from tfformer.serving.server import batching_options

    timeout_micros = batching_options(True, parameters_file).batch_timeout_micros
    print(f"model: {what}; {len(sentences)} test sentences; load: {shape}", flush=True)
    flags = {"tfformer serve": [], "tfformer serve --enable_batching": [
        "--enable_batching", "--batching_parameters_file", parameters_file, "--monitoring_config_file", monitoring]}
    servers = {}
    try:
        for index, (system, system_flags) in enumerate(flags.items()):  # both load at once
            log_path = os.path.join(scratch, f"server-{index}.log")
            servers[system] = (spawn_server(base, log_path, *system_flags), log_path)
        servers = {system: (process, wait_ready(process, log_path)) for system, (process, log_path) in servers.items()}
        rows, answers = [], {}
        order = random.Random(0)
        for round_index in range(shape["rounds"]):
            for system in order.sample(list(servers), len(servers)):
                batched = system.endswith("batching")
                row, translations = measure(system, servers[system][1], sentences, shape, batched)
                answers.update(translations if batched else {})
                rows.append(common.emit(dict(row, round=round_index, model=what,
                                             batching_parameters=parameters if batched else None)))
        # Batched answers against unbatched ones (beam search over padded batches may differ in the last bits).
        common.emit(agreement(servers["tfformer serve"][1], sentences, answers, shape["agreement"]))
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait(timeout=120)
    print("\n" + common.table(rows, ["system", "round", "sentences_per_s", "median_ms", "p90_ms",
                                     "one_client_median_ms", "failed", "mean_batch_size"]))
    common.print_goals(_goals(rows, timeout_micros), "Goals (medians over rounds):")
    if args.smoke:
        shutil.rmtree(scratch, ignore_errors=True)
    elif not args.run:
        print(f"The trained run stays in {run}: pass --run {run} to serve it again without training.")
    return rows


if __name__ == "__main__":
    main()
