"""`make test`'s pretrained run keeps each module on one worker (`--dist loadfile`), and the modules marked
`ONE_AT_A_TIME` (tests/harness.py: they peak at several GB) or taking its lock for a step (`alone`) run in it: with
`--dist load` such a module could be split over both workers, its module fixtures built twice at once."""

import os
import pathlib
import re
import subprocess
import sys
import textwrap

from tests.harness import ROOT


def _make_variable(text, name):
    match = re.search(rf"^{name} :=(.*)$", text, re.M)
    assert match, f"the Makefile defines {name}"
    return match.group(1).split()


def test_one_at_a_time_modules_run_in_the_loadfile_run():
    with open(os.path.join(ROOT, "Makefile")) as f:
        makefile = f.read()
    pretrained = _make_variable(makefile, "PRETRAINED")
    runs = [line.strip() for line in makefile.splitlines() if line.strip().startswith("$(PYTEST)")]
    assert any("--dist loadfile $(PRETRAINED)" in run for run in runs), runs
    marked = [str(path.relative_to(ROOT)) for path in pathlib.Path(ROOT, "tests").rglob("test_*.py")
              if re.search(r"^pytestmark = .*ONE_AT_A_TIME|\balone\(tmp_path_factory\)",
                           path.read_text(encoding="utf-8"), re.M)]
    assert len(marked) >= 4, marked
    for path in marked:
        assert any(path == p or path.startswith(p.rstrip("/") + "/") for p in pretrained), (
            f"{path} is marked ONE_AT_A_TIME but runs outside the pretrained run {pretrained}")


def test_one_at_a_time_modules_never_overlap_on_two_workers(tmp_path):
    """Two marked modules on two xdist workers (`--dist loadfile`): their tests' spans never overlap."""
    (tmp_path / "conftest.py").write_text("from tests.conftest import one_at_a_time  # noqa: F401\n")
    for name in ("a", "b"):
        (tmp_path / f"test_{name}.py").write_text(textwrap.dedent(f"""
            import time
            from tests.harness import ONE_AT_A_TIME
            pytestmark = ONE_AT_A_TIME

            def test_{name}():
                start = time.time()
                time.sleep(1.5)
                with open({str(tmp_path / "spans")!r}, "a") as f:
                    f.write(f"{{start}} {{time.time()}}\\n")
            """))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", "-p",
                          "no:cacheprovider", "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    (a_start, a_end), (b_start, b_end) = sorted(
        tuple(map(float, line.split())) for line in (tmp_path / "spans").read_text().splitlines())
    assert a_end <= b_start, "the second module started while the first held the lock"
