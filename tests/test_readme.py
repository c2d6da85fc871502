"""The README's quickstart runs as written."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _quickstart():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as handle:
        readme = handle.read()
    section = readme[readme.index("## Quickstart"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_quickstart_runs(tmp_path):
    code = _quickstart() + "\nassert isinstance(lm.generate('def ', max_new_tokens=4), str)\nprint('done')\n"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                         env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("done")
    assert sorted(os.listdir(tmp_path / "my_lm")) == ["config.json", "model.keras", "preset.json", "tokenizer.model"]
    assert os.listdir(tmp_path / "export" / "models" / "my_lm") == ["1"]


def test_performance_page_stays_short():
    # docs/performance.md explains today's numbers; their history is in git.
    with open(os.path.join(ROOT, "docs", "performance.md"), encoding="utf-8") as handle:
        lines = handle.read().splitlines()
    assert len(lines) <= 150, len(lines)
