"""`python -m benchmarks.serving --smoke` runs: an untrained tiny translator exported and served by two `tfformer
serve` subprocesses (plain and --enable_batching), 4 clients for 2 seconds each (the numbers mean nothing)."""

import pytest

from tests.benchmarks.smoke import peers_dir, run_smoke


def test_serving_benchmark_smoke(tmp_path):
    stdout, records = run_smoke("benchmarks.serving", peers_dir("none", tmp_path / "peers"))
    rows = {r["system"]: r for r in records if r["bench"] == "serving"}
    assert set(rows) == {"tfformer serve", "tfformer serve --enable_batching"}
    for row in rows.values():
        assert row["failed"] == 0 and row["requests"] > 0 and row["clients"] == 4, row
        assert row["sentences_per_s"] > 0 and 0 < row["median_ms"] <= row["p90_ms"] and row["one_client_median_ms"] > 0
        assert row["sentences_per_s"] == pytest.approx(row["requests"] / row["seconds"], rel=0.01)
    batched = rows["tfformer serve --enable_batching"]
    assert batched["mean_batch_size"] >= 1 and "max_batch_size { value: 32 }" in batched["batching_parameters"]
    assert "mean_batch_size" not in rows["tfformer serve"]
    (agreement,) = [r for r in records if r["bench"] == "serving_agreement"]
    assert agreement["sentences"] == 5 and 0 <= agreement["equal"] <= 1
    goals = [r for r in records if r["bench"] == "goal"]
    assert [g["goal"] for g in goals] == ["serving: batched throughput >= 2.5x unbatched",
                                          "serving: batched median latency <= 0.5x unbatched",
                                          "serving: one client batched <= (unbatched + batch_timeout_micros) x 1.1"]
    plain = rows["tfformer serve"]
    assert goals[0]["value"] == round_to(batched["sentences_per_s"] / plain["sentences_per_s"])
    assert "untrained tiny translator (smoke)" in stdout and "| system | round |" in stdout


def round_to(x):
    return float(f"{x:.4g}")
