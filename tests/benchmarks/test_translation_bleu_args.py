"""`python -m benchmarks.translation_bleu` never replaces an earlier run without `--overwrite` (checked before any
training: the benchmark runs ~45 minutes, so it is not run here)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_an_existing_run_is_kept_without_overwrite(tmp_path):
    (tmp_path / "run-bf16").mkdir()
    (tmp_path / "run-bf16" / "metrics.json").write_text("{}")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-m", "benchmarks.translation_bleu", "--out", str(tmp_path / "run"),
                          "--mixed-precision"], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "run-bf16' already holds a run; pass --overwrite" in out.stderr
    assert (tmp_path / "run-bf16" / "metrics.json").read_text() == "{}"
    assert not (tmp_path / "run").exists()  # nothing started
