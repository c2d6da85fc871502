"""`python -m benchmarks.translation_bleu`: the smoke run (tiny models, 60 steps; the numbers mean little)
and the run-directory rule (an earlier run is replaced only with `--overwrite`, checked before any training)."""

import json
import os
import subprocess
import sys

import pytest

from tests.benchmarks.smoke import smoke_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = smoke_env(light_xla=True)  # translation_bleu has no peers


def _bleu_bench(*args):
    return subprocess.run([sys.executable, "-m", "benchmarks.translation_bleu", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=900, env=ENV)


def _bleu_bench_here(capsys, *args):
    """`python -m benchmarks.translation_bleu ARGS` in this process (`main`), for runs that must stop at their
    arguments: its exit code and stderr, without a fresh interpreter importing TensorFlow and keras-hub first."""
    from benchmarks import translation_bleu

    capsys.readouterr()
    with pytest.raises(SystemExit) as exit:
        translation_bleu.main(list(args))
    return exit.value.code, capsys.readouterr().err


def test_translation_bleu_smoke(tmp_path):
    out = _bleu_bench("--smoke", "--mixed-precision", "--out", str(tmp_path / "run"))
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    rows = {r["system"]: r for r in records if r["bench"] != "goal"}
    assert set(rows) == {"tfformer float32", "tfformer bfloat16", "keras-hub"}
    # keras-hub is the float32 reference even though the bfloat16 run before it set the global policy.
    assert {name: r["dtype_policy"] for name, r in rows.items()} == {
        "tfformer float32": "float32", "tfformer bfloat16": "mixed_bfloat16", "keras-hub": "float32"}
    for row in rows.values():
        assert 0 <= row["bleu_test"] <= 100 + 1e-9 and row["steps"] > 10 and row["parameters"] > 0, row
        assert row["test_pairs"] == rows["keras-hub"]["test_pairs"] > 0  # one test split for every system
        # The systems run one after another: the machine's matmul limits right before and after each.
        assert row["bench"] == "translation_bleu" and set(row["matmul_limit_gflops"]) == {"float32", "bfloat16"}, row
        assert all(len(pair) == 2 and min(pair) > 0 for pair in row["matmul_limit_gflops"].values()), row
        if row["system"] != "keras-hub":
            assert row["steps"] == 60, row  # the smoke's max_steps (its 2-minute budget is a ceiling)
    # keras-hub trains tfformer float32's fit time, to one step, unless it needs longer for its floor of 20 steps
    # (a loaded machine can spend seconds tracing).
    budget, theirs = rows["tfformer float32"]["train_seconds"], rows["keras-hub"]
    assert budget - 0.5 <= theirs["train_seconds"], (budget, theirs)
    assert theirs["train_seconds"] <= budget + 5 or theirs["steps"] == 20, (budget, theirs)
    assert "| system | BLEU (test) |" in out.stdout
    # The goal lines: each tfformer run's BLEU over keras-hub's.
    goals = {r["goal"]: r for r in records if r["bench"] == "goal"}
    assert len(goals) == 2
    for system in ("tfformer float32", "tfformer bfloat16"):
        r = goals[f"translation_bleu {system} BLEU >= 1x keras-hub float32's (same budget)"]
        assert r["value"] == pytest.approx(rows[system]["bleu_test"] / max(rows["keras-hub"]["bleu_test"], 1e-9),
                                           rel=1e-3)
        assert r["met"] == (r["value"] >= 1) and r["rows"] == [system, "keras-hub"]
    assert os.path.exists(tmp_path / "run" / "model.keras") and os.path.exists(tmp_path / "run-bf16" / "model.keras")


def test_an_existing_run_is_kept_without_overwrite(tmp_path, capsys):
    (tmp_path / "run-bf16").mkdir()
    (tmp_path / "run-bf16" / "metrics.json").write_text("{}")
    code, stderr = _bleu_bench_here(capsys, "--out", str(tmp_path / "run"), "--mixed-precision")
    assert code == 2, stderr[-2000:]
    assert "run-bf16' already holds a run; pass --overwrite" in stderr
    assert (tmp_path / "run-bf16" / "metrics.json").read_text() == "{}"
    assert not (tmp_path / "run").exists()  # nothing started


def test_bad_arguments_are_named(tmp_path, capsys):
    for args, message in [(["--minutes", "0"], "--minutes must be > 0"),
                          (["--data", str(tmp_path / "none.tsv")], "--data: ")]:
        code, stderr = _bleu_bench_here(capsys, "--out", str(tmp_path / "run"), *args)
        assert code == 2 and message in stderr, stderr[-2000:]
    assert not (tmp_path / "run").exists()
