"""A stand-in for the benchmarks' peers, so that their smoke runs take the branch with peer rows in CI too.

`smoke.peers_dir("stand-in", directory)` writes `bin/python`, `bin/llama-bench` and `bin/llama-perplexity` there,
each running this script; a smoke run with `TFFORMER_PEERS=directory` then finds them as it would find
`.venv-peers`. As `python` it answers the module probe (`python -c ...`) and speaks `benchmarks.torch_worker`'s
protocol for every system of `torch_worker.py` and `ct2_worker.py`: a ready line, then one reply per command with
made-up seconds (for the llm, growing with the tokens asked for). As `llama-bench` it prints llama-bench's JSON
lines for its `-p`, `-n` and `-pg` tests; as `llama-perplexity`, llama-perplexity's chunk count and final line, with
the perplexity `PERPLEXITY`. Every version it reports is "stand-in", so its rows cannot pass for measurements. It
imports only the standard library and numpy (to count the clips of an .npz file).
"""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VERSION = "stand-in"
SECONDS = 0.01  # per command, plus MILLISECONDS_PER_TOKEN per new token where a command has a count
MILLISECONDS_PER_TOKEN = 1.0
PERPLEXITY = 12.3456  # llama-perplexity's "Final estimate", whatever the text


def reply(seconds, **extra):
    print(json.dumps({"seconds": seconds, "peak_rss_mb": 1, **extra}), flush=True)


def transcripts(spec):
    """The speech fixtures' reference transcripts, one per clip the benchmark sent (`clip_00`, ...)."""
    import numpy as np

    with np.load(spec["arrays"]) as arrays:
        count = sum(name.startswith("clip_") for name in arrays.files)
    with open(os.path.join(ROOT, "tests", "fixtures", "speech", "manifest.json"), encoding="utf-8") as f:
        return [clip["transcript"] for clip in json.load(f)["clips"][:count]]


def worker(script, system, spec):
    """`torch_worker` / `ct2_worker`'s side of the protocol (see `benchmarks.torch_worker`)."""
    ready = {"ready": True, "threads": spec["threads"], "load_peak_rss_mb": 1}
    if os.path.basename(script) == "ct2_worker.py":
        texts = transcripts(spec)
        ready.update(ctranslate2=VERSION, faster_whisper=VERSION)
    else:
        ready.update(torch=VERSION, parameters=None)
    print(json.dumps(ready), flush=True)
    for line in sys.stdin:
        command = line.split()
        if command == ["quit"]:
            break
        if system == "whisper" and command[-1] == "long":  # the long recording: one made-up segment
            reply(SECONDS, texts=[VERSION], segments=[[0.0, 1.0, VERSION]])
        elif system == "whisper":
            reply(SECONDS, texts=texts)
        elif system == "llm":  # "decode DTYPE N" or "prefill DTYPE": N new ids (1 for a prefill)
            new_tokens = int(command[2]) if command[0] == "decode" else 1
            reply(SECONDS + new_tokens * MILLISECONDS_PER_TOKEN / 1000, ids=[0] * new_tokens)
        else:
            reply(SECONDS)


def llama_bench(argv):
    """llama-bench's `-o jsonl` lines for `-p P`, `-n N` and `-pg P,N` (each test's tokens over its time)."""
    options = dict(zip(argv[::2], argv[1::2]))
    tests = [(int(options["-p"]), 0), (0, int(options["-n"]))]
    if "-pg" in options:
        tests.append(tuple(int(x) for x in options["-pg"].split(",")))
    for n_prompt, n_gen in tests:
        seconds = SECONDS + (n_prompt + n_gen) * MILLISECONDS_PER_TOKEN / 1000
        print(json.dumps({"build_commit": VERSION, "model_size": os.path.getsize(options["-m"]),
                          "n_prompt": n_prompt, "n_gen": n_gen, "n_threads": int(options["-t"]),
                          "avg_ns": int(seconds * 1e9), "stddev_ns": 0, "avg_ts": (n_prompt + n_gen) / seconds,
                          "stddev_ts": 0.0}), flush=True)


def llama_perplexity(argv):
    """llama-perplexity's lines that the benchmark reads (on stderr, as llama.cpp logs them): the chunk count (the
    text's bytes over `-c`, as if a token were a byte) and the final estimate."""
    options = dict(zip(argv[::2], argv[1::2]))
    chunks = os.path.getsize(options["-f"]) // int(options["-c"])
    print(f"perplexity: calculating perplexity over {chunks} chunks, n_ctx={options['-c']}", file=sys.stderr)
    print(f"Final estimate: PPL = {PERPLEXITY:.4f} +/- 0.50000", file=sys.stderr)


def main(role, argv):
    if role == "llama-bench":
        return llama_bench(argv)
    if role == "llama-perplexity":
        return llama_perplexity(argv)
    if argv[:1] == ["-c"]:  # `torch_worker._has_modules`: every module is "there"
        return 0
    script, system, spec = argv
    return worker(script, system, json.loads(spec))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
