"""One runner for every benchmark: `python -m benchmarks run [WORKLOAD...] [--smoke]`.

Workloads: training (seq2seq + GPT-shaped LM vs keras-hub and PyTorch), generation (vs keras-hub
GPT2CausalLM and transformers' GPT-2), encoder (MiniLM vs keras-hub BertBackbone and sentence-transformers),
tflite (batch-1 latency vs SavedModel),
translation_bleu (BLEU after the same time budget vs the keras.io KerasHub recipe; ~45 minutes) and lm_perplexity
(test perplexity after the same time budget vs keras-hub's GPT2CausalLM; ~45 minutes); the last two are never in
the default set, nor are llm (SmolLM2-135M-Instruct decode and prefill vs transformers on the same GGUF; ~10
minutes), asr (Whisper tiny.en transcription vs faster-whisper/CTranslate2; ~5 minutes) and serving (`tfformer
serve` with and without request batching under 32 concurrent clients; ~20 minutes with the demo training) and
warmup (the first request after a version loads vs a warm one, with and without SavedModel warm-up, for the demo
translator and SmolLM2; ~10 minutes). Each
runs in its own process and prints JSON lines and a markdown table. `--smoke` runs one repeat on tiny shapes (CI
runs it so the runner cannot rot); numbers from it mean nothing. Ratios are given of the medians and per round
(`common.paired_ratio`: median, min-max over rounds of each round's pair).
PyTorch rows come from a worker process (`benchmarks.torch_worker`) of `--torch-python`, else of this interpreter
if it has torch and transformers (sentence-transformers for the encoder), else of the peers' interpreter,
`.venv-peers/bin/python` in this clone (`benchmarks.peers`), which `make peers` installs with faster-whisper (asr)
and llama.cpp's llama-bench (llm); without one they are skipped, and the output says so. `make bench` = `make
peers` + this runner on the workloads of RESULTS.md.
Every run but a smoke run also writes its JSON lines to benchmarks/results/<YYYY-MM-DD>-<short commit>.jsonl (UTC
date; "-2", "-3", ... for another run that day), after a first line that says what ran where (`run_record`);
`--no-results` turns that off, `--results-dir DIR` writes there instead (smoke runs too).
`--systems peers` (smoke runs of training and generation only) times just the PyTorch rows and the rows they are
read against, and reads no goals: the runner's smoke test runs its stand-in peers so, and covers everything else in
its run without peers.
"""

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import sys

import tfformer_command
from benchmarks import SYSTEMS

WORKLOADS = {
    "training": "benchmarks.training",
    "generation": "benchmarks.generation",
    "encoder": "benchmarks.encoder",
    "tflite": "benchmarks.tflite_latency",
    "translation_bleu": "benchmarks.translation_bleu",
    "lm_perplexity": "benchmarks.lm_perplexity",
    "llm": "benchmarks.llm",
    "asr": "benchmarks.asr",
    "serving": "benchmarks.serving",
    "warmup": "benchmarks.warmup",
}
DEFAULT = ["training", "generation", "encoder", "tflite"]
# The workloads that time what a `tfformer` command runs, in that command's TensorFlow environment
# (`workload_environment`): asr's tfformer rows are `tfformer transcribe`'s path, with oneDNN.
COMMANDS = {"asr": "transcribe"}
WITH_PYTORCH = {"training", "generation", "encoder", "llm"}
WITH_SYSTEMS = ("training", "generation")  # the workloads that take `--systems`
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(ROOT, "benchmarks", "results")
# The ISA extensions that decide which kernels oneDNN and XLA use, and so what a ratio means on another host.
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


def _git(*args):
    """`git args` in the repository: its output, or None without git or outside a clone."""
    try:
        out = subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _cpu():
    """`(model name, [the CPU_FLAGS it has])` from /proc/cpuinfo; `(platform.processor(), None)` elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return platform.processor() or None, None
    fields = dict(line.split(":", 1) for line in info.split("\n\n")[0].splitlines() if ":" in line)
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    flags = set(fields.get("flags", "").split())
    return fields.get("model name"), [flag for flag in CPU_FLAGS if flag in flags]


def run_record(argv, workloads, smoke):
    """The first line of a results file: what ran (command, commit, whether the tree had changes), when, and where
    (CPU model, its `CPU_FLAGS`, cores, library versions)."""
    versions = {}
    for package in ("tensorflow", "keras", "keras-hub", "torch", "transformers"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    model, flags = _cpu()
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"bench": "run", "command": ["python", "-m", "benchmarks", *argv], "workloads": workloads, "smoke": smoke,
            "commit": _git("rev-parse", "HEAD"), "uncommitted_changes": None if status is None else bool(status),
            "utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cpu": model, "cpu_flags": flags, "cpus": os.cpu_count(),
            "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            # Versions of this interpreter's packages; the PyTorch rows record their worker's torch.
            "versions": versions}


def results_path(directory):
    """A new file `<directory>/<YYYY-MM-DD>-<short commit>.jsonl` (UTC date; "-2", "-3", ... when taken)."""
    commit = _git("rev-parse", "--short", "HEAD") or "unknown"
    stem = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d}-{commit}"
    path, count = os.path.join(directory, f"{stem}.jsonl"), 1
    while os.path.exists(path):
        count += 1
        path = os.path.join(directory, f"{stem}-{count}.jsonl")
    return path


def workload_environment(name, environ=None):
    """The environment workload `name` runs in: `environ` (None: this process's), with the TensorFlow settings
    (`tfformer_command.tensorflow_environment`) of the `tfformer` command it stands for (`COMMANDS`)."""
    environ = dict(os.environ if environ is None else environ)
    if name in COMMANDS:
        tfformer_command.tensorflow_environment([COMMANDS[name]], environ)
    return environ


def _run_workload(command, results, environ):
    """Run `command` in `environ`, passing its output on as it comes; its JSON lines also go to `results` (a file or
    None)."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, bufsize=1, env=environ)
    with process.stdout:
        for line in process.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            if results is not None and _is_record(line):
                results.write(line if line.endswith("\n") else line + "\n")
                results.flush()  # a run that dies later keeps what it measured
    return process.wait()


def _is_record(line):
    """Whether `line` is one of the JSON lines a workload prints (`common.emit`): a JSON object."""
    if not line.startswith("{"):
        return False
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run")
    run.add_argument("workloads", nargs="*", choices=[*WORKLOADS, []], metavar="WORKLOAD", help=", ".join(WORKLOADS))
    run.add_argument("--smoke", action="store_true")
    run.add_argument("--torch-python", help="interpreter for the PyTorch rows (training, generation, encoder, llm)")
    run.add_argument("--llama-bench", help="llama.cpp's `llama-bench` binary, for the llm workload's llama.cpp rows "
                                           "(default: the one `make peers` builds into .venv-peers/bin)")
    run.add_argument("--results-dir", help=f"where the run's JSON lines go (default: {RESULTS_DIR}; smoke runs: "
                                           "nowhere unless given)")
    run.add_argument("--no-results", action="store_true", help="write no results file")
    run.add_argument("--systems", choices=SYSTEMS, default="all",
                     help="peers: time only the PyTorch rows and the rows they are read against, no goals (smoke "
                          f"runs of {' and '.join(WITH_SYSTEMS)} only); default: all")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    names = list(dict.fromkeys(args.workloads or DEFAULT))  # each once, in the order given
    if args.systems != "all":
        if not args.smoke:
            run.error(f"argument --systems: {args.systems!r} needs --smoke (its rows alone are no benchmark)")
        others = [name for name in names if name not in WITH_SYSTEMS]
        if others:
            run.error(f"argument --systems: {args.systems!r} applies to {' and '.join(WITH_SYSTEMS)} only, not "
                      f"{', '.join(others)}")
    directory = args.results_dir or (None if args.smoke else RESULTS_DIR)
    results = None
    if directory is not None and not args.no_results:
        os.makedirs(directory, exist_ok=True)
        results = open(results_path(directory), "x")
        results.write(json.dumps(run_record(argv, names, args.smoke)) + "\n")
    try:
        for name in names:
            print(f"## {name}", flush=True)
            # A fresh interpreter per workload: TF's thread settings only take before its runtime starts (the
            # encoder pins 2 intra-op / 1 inter-op threads), and no workload inherits another's memory.
            options = ["--smoke"] if args.smoke else []
            if args.torch_python and name in WITH_PYTORCH:
                options += ["--torch-python", args.torch_python]
            if args.llama_bench and name == "llm":
                options += ["--llama-bench", args.llama_bench]
            if args.systems != "all":
                options += ["--systems", args.systems]
            code = _run_workload([sys.executable, "-m", WORKLOADS[name], *options], results,
                                 workload_environment(name))
            if code:
                return code
        return 0
    finally:
        if results is not None:
            results.close()
            print(f"JSON lines of this run: {os.path.relpath(results.name)}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
