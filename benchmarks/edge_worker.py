"""The asr benchmark's TFLite int8 row in a process of its own: LiteRT never runs in the benchmark's process.

`torch_worker`'s protocol, in this interpreter (`sys.executable`: tfformer, TensorFlow and ai_edge_litert): the
worker builds `tfformer.models.from_preset(spec["preset"])`, writes its dynamic-range int8 decoder file
(`tfformer.export.tflite_decoder(model, path, quantize="dynamic")`, into `spec["directory"]`, which the caller
makes and deletes, so a worker killed mid-export leaves nothing behind) and loads it in `tfformer.edge.Transcriber`
on `spec["threads"]` threads (TensorFlow, which the host's tokenizer runs on, gets the same intra-op count), all
untimed; then it prints `{"ready": ...}` with its peak memory
after that (`load_peak_rss_mb`: the Keras model and the export included). Each line `int8` transcribes every
waveform of the spec's arrays (`clip_00`, ... 16 kHz float32), one after another, and it prints the seconds, its
peak memory and the texts; `quit` ends it.

On the asr benchmark's 2-core host, a used `edge.Transcriber` in the benchmark's own process went with a slower
faster-whisper worker (its long form 4.8-5.0 s alone, 6.3-8.8 s beside it; by hand): so the TFLite row runs here,
as the faster-whisper rows run in theirs, and the benchmark's process never imports ai_edge_litert. (An idle
Transcriber was later measured at 0.1 ms of CPU in 3 s: it was not what slowed faster-whisper.)

    python benchmarks/edge_worker.py whisper '{"preset": "whisper-tiny-en", "threads": 2, "directory": ..., ...}'
"""

import gc
import json
import os
import sys
import time

if __name__ == "__main__":  # started as a script (`TorchWorker`): the repository, for `benchmarks` and its tfformer
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import torch_worker  # standard library only

SAMPLE_RATE = 16000
COMMAND = "int8"  # the one command: the dynamic-range int8 file on every clip


def worker_main(system, spec):
    if system != "whisper":
        raise SystemExit(f"unknown system {system!r}")
    # The protocol's lines go to the pipe through a copy of fd 1; fd 1 itself goes to the log (stderr), so nothing
    # that TensorFlow's converter or LiteRT's native code writes to stdout can break a reply.
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = protocol

    from benchmarks import common
    from tfformer import edge, export, models

    common.set_tf_threads(spec["threads"])
    arrays = torch_worker.load_arrays(spec["arrays"])
    waveforms = [audio for name, audio in sorted(arrays.items()) if name.startswith("clip_")]
    model = models.from_preset(spec["preset"])
    path = export.tflite_decoder(model, os.path.join(spec["directory"], "whisper_int8.tflite"), quantize="dynamic")
    transcriber = edge.Transcriber(path, tokenizer=model.preprocessor, num_threads=spec["threads"])
    del model  # the tokenizer and the file's runtime stay; the Keras model goes before any timed run
    gc.collect()
    print(json.dumps({"ready": True, "threads": spec["threads"],
                      "load_peak_rss_mb": round(torch_worker.peak_rss_mb())}), flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "quit":
            break
        if command != COMMAND:
            raise SystemExit(f"unknown command {command!r} (the worker runs {COMMAND!r})")
        start = time.perf_counter()
        texts = [transcriber.transcribe(audio, sample_rate=SAMPLE_RATE) for audio in waveforms]
        torch_worker.reply(time.perf_counter() - start, texts=texts)


def start(spec, arrays):
    """A `torch_worker.TorchWorker` of this file in this interpreter, started (its `wait_ready()` still to come):
    `spec` holds the `preset`, `threads` and an existing `directory` for the file, `arrays` the clips (`clip_00`,
    ...). It raises when the worker cannot start, and `wait_ready` / `run` when it fails: these rows are tfformer's
    own, a failure is an error, not a skip. Close it when done (`TorchWorker.close`)."""
    return torch_worker.TorchWorker(sys.executable, "whisper", spec, arrays, script=os.path.abspath(__file__))


if __name__ == "__main__":
    worker_main(sys.argv[1], json.loads(sys.argv[2]))
