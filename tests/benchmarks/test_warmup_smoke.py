"""`python -m benchmarks.warmup --smoke` runs (tiny random models; the numbers mean nothing): for each model a row
with SavedModel warm-up and one without, the same answer in both, and the issue's goal read from the first."""

import pytest

from tests.benchmarks.smoke import run_smoke


def test_warmup_benchmark_smoke(tmp_path):
    stdout, records = run_smoke("benchmarks.warmup", str(tmp_path), light_xla=True)  # no peers: none is used
    rows = [r for r in records if r["bench"] == "warmup"]
    assert sorted((r["model"], r["condition"]) for r in rows) == [
        (model, condition) for model in ("smollm2", "translator") for condition in ("no warm-up", "warm-up")]
    for r in rows:
        assert r["load_s"] > 0 and r["first_ms"] > 0 and r["warm_ms"] > 0 and r["repeats"] == 2
        assert r["first_vs_warm"] == pytest.approx(r["first_ms"] / r["warm_ms"], rel=0.02)
        assert r["warmup_file_bytes"] > 0
    for model in ("smollm2", "translator"):
        answers = {r["answer"] for r in rows if r["model"] == model}
        assert len(answers) == 1  # warm-up changes when, not what
        (with_warmup,) = [r for r in rows if (r["model"], r["condition"]) == (model, "warm-up")]
        (goal,) = [r for r in records if r["bench"] == "goal" and r["goal"].startswith(f"{model}:")]
        assert goal["value"] == pytest.approx(with_warmup["first_vs_warm"]) and goal["target"] == 2.0
        assert goal["met"] == (goal["value"] <= 2.0)
    assert "| model | condition |" in stdout and "Goals (issue 54):" in stdout
