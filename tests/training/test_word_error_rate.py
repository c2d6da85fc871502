"""`training.word_error_rate`, the speech tests' and the asr benchmark's WER, against hand-counted edits."""

import json
import pathlib

import pytest

from tfformer.training import normalize_transcript, word_error_rate

MANIFEST = pathlib.Path(__file__).parents[1] / "fixtures" / "speech" / "manifest.json"


def test_counts_substitutions_deletions_and_insertions():
    assert word_error_rate(["a b c d"], ["a x c"]) == pytest.approx(2 / 4)  # one substitution, one deletion
    assert word_error_rate(["a b c"], ["a x c d"]) == pytest.approx(2 / 3)  # one substitution, one insertion
    assert word_error_rate(["a b c d", "e f"], ["b c", "e f"]) == pytest.approx(2 / 6)  # corpus-level: summed
    assert word_error_rate(["A, b!", "c"], ["", "c"]) == pytest.approx(2 / 3)
    assert word_error_rate(["x"], ["a b"]) == pytest.approx(2)
    assert word_error_rate(["a b"], ["a b"]) == 0
    assert word_error_rate(["The cat, sat!"], ["the cat sat on"]) == pytest.approx(1 / 3)
    assert word_error_rate(["The cat"], ["the cat"], normalize=None) == pytest.approx(1 / 2)  # as given


def test_normalization_and_the_recorded_reference():
    assert normalize_transcript("The quick, brown FOX's  dog!") == "the quick brown fox's dog"
    manifest = json.loads(MANIFEST.read_text())
    spoken = [clip["text"] for clip in manifest["clips"]]
    transcripts = [clip["transcript"] for clip in manifest["clips"]]
    assert word_error_rate(spoken, transcripts) == pytest.approx(manifest["reference"]["wer"], abs=1e-12)  # jiwer's


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="same length"):
        word_error_rate(["a"], [])
    with pytest.raises(ValueError, match="no words"):
        word_error_rate([""], ["a"])
