"""`python -m benchmarks.encoder --smoke` runs (one repeat, tiny shapes; the numbers mean nothing), with no PyTorch
worker and with a stand-in for it."""

import pytest

from tests.benchmarks.smoke import run_smoke


def test_encoder_benchmark_smoke(peers):
    stdout, all_records = run_smoke("benchmarks.encoder", peers.path)
    records = [r for r in all_records if r["bench"] == "encoder"]
    ratios = [r for r in all_records if r["bench"] == "encoder_ratio"]
    systems = {(r["system"], r["dtype"]) for r in records}
    keras_rows = {(s, d) for s in ("tfformer", "keras-hub", "tfformer encode") for d in ("float32", "bfloat16")}
    assert keras_rows <= systems
    torch_rows = {(s, d) for s in ("pytorch", "pytorch encode") for d in ("float32", "bfloat16")}
    # The PyTorch rows are there when an interpreter with torch exists, else the skip is said.
    if peers.kind == "none":
        assert "PyTorch rows skipped" in stdout and not systems & torch_rows
    else:
        assert torch_rows <= systems and "PyTorch rows skipped" not in stdout
    # A worker that exists but fails is an error, not a skip.
    assert "worker failed" not in stdout and "worker did not start" not in stdout
    assert all(r["sentences_per_s"] > 0 and len(r["repeats"]) == 1 for r in records)
    for r in records:  # encode rows: the 16 smoke sentences; forward rows: the smoke batch
        assert r["sentences"] == (16 if r["system"].endswith(" encode") else 2), r
        assert r["seconds"] == pytest.approx(r["sentences"] / r["sentences_per_s"], rel=0.01, abs=1e-4)  # rounding
    # GFLOP/s of the forward rows (the encode rows' lengths vary: none) against their dtype's limit.
    for r in records:
        if r["system"].endswith(" encode"):
            assert "gflops" not in r
        else:
            # gflops and the limit to 4 significant digits, the fraction to 2 decimals: a smoke run's tiny matmul
            # limit can read several times below the model's GFLOP/s (ci90: 34.09 against 4.9, fraction 7.0).
            assert r["gflops"] > 0 and r["fraction_of_own_limit"] == pytest.approx(
                r["gflops"] / r["limit_gflops"], rel=2e-3, abs=0.011)
    speed = {(r["system"], r["dtype"]): r["sentences_per_s"] for r in records}
    pairs = [("tfformer", "keras-hub", "keras-hub")]
    if torch_rows <= systems:
        pairs += [("tfformer", "pytorch", "pytorch"), ("tfformer encode", "pytorch", "pytorch encode")]
    for ours, versus, theirs in pairs:  # per dtype; with one round, per round = of the medians
        for dtype in ("float32", "bfloat16"):
            (r,) = [r for r in ratios if (r["system"], r["dtype"], r["tfformer_vs"]) == (ours, dtype, versus)]
            assert r["ratio"] == pytest.approx(speed[(ours, dtype)] / speed[(theirs, dtype)], rel=0.01)
            assert r["per_round"] == pytest.approx([r["ratio"]] * 3, rel=0.01)
    # The issue's goals (each dtype at least PyTorch's speed), read from the forward rows' ratios; none without
    # PyTorch.
    goals = {r["goal"]: r for r in all_records if r["bench"] == "goal"}
    if torch_rows <= systems:
        assert set(goals) == {"encoder float32 >= 1x PyTorch float32",
                              "encoder bfloat16 >= 1x PyTorch bfloat16 autocast"}
        for dtype in ("float32", "bfloat16"):
            (r,) = [g for g in goals.values() if g["goal"].startswith(f"encoder {dtype} ")]
            (ratio,) = [x for x in ratios if (x["system"], x["dtype"], x["tfformer_vs"]) == ("tfformer", dtype,
                                                                                            "pytorch")]
            assert r["value"] == pytest.approx(ratio["ratio"], rel=1e-3) and r["met"] == (r["value"] >= 1)
    else:
        assert not goals
    assert "| system | dtype |" in stdout and "tfformer/keras-hub" in stdout
