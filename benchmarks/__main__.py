"""One runner for every benchmark: `python -m benchmarks run [WORKLOAD...] [--smoke]`.

Workloads: training (seq2seq + GPT-shaped LM vs keras-hub and PyTorch), generation (vs keras-hub
GPT2CausalLM and transformers' GPT-2), encoder (MiniLM vs keras-hub BertBackbone and sentence-transformers),
tflite (batch-1 latency vs SavedModel),
translation_bleu (BLEU after the same time budget vs the keras.io KerasHub recipe; ~45 minutes) and lm_perplexity
(test perplexity after the same time budget vs keras-hub's GPT2CausalLM; ~45 minutes); the last two are never in
the default set. Each runs in its own process and prints JSON lines and a markdown table. `--smoke` runs
one repeat on tiny shapes (CI runs it so the runner cannot rot); numbers from it mean nothing. Ratios are
given of the medians and per round (`common.paired_ratio`: median, min-max over rounds of each round's pair).
PyTorch rows come from a worker process (`benchmarks.torch_worker`) of `--torch-python`, else of this interpreter
if it has torch and transformers (sentence-transformers for the encoder), else of /tmp/torchvenv/bin/python;
without one they are skipped, and the output says so.
"""

import argparse
import subprocess
import sys

WORKLOADS = {
    "training": "benchmarks.training",
    "generation": "benchmarks.generation",
    "encoder": "benchmarks.encoder",
    "tflite": "benchmarks.tflite_latency",
    "translation_bleu": "benchmarks.translation_bleu",
    "lm_perplexity": "benchmarks.lm_perplexity",
}
DEFAULT = ["training", "generation", "encoder", "tflite"]
WITH_PYTORCH = {"training", "generation", "encoder"}


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run")
    run.add_argument("workloads", nargs="*", choices=[*WORKLOADS, []], metavar="WORKLOAD", help=", ".join(WORKLOADS))
    run.add_argument("--smoke", action="store_true")
    run.add_argument("--torch-python", help="interpreter for the PyTorch rows (training, generation, encoder)")
    args = parser.parse_args(argv)
    for name in dict.fromkeys(args.workloads or DEFAULT):  # each once, in the order given
        print(f"## {name}", flush=True)
        # A fresh interpreter per workload: TF's thread settings only take before its runtime starts (the
        # encoder pins 2 intra-op / 1 inter-op threads), and no workload inherits another's memory.
        options = ["--smoke"] if args.smoke else []
        if args.torch_python and name in WITH_PYTORCH:
            options += ["--torch-python", args.torch_python]
        code = subprocess.call([sys.executable, "-m", WORKLOADS[name], *options])
        if code:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
