"""`make test`'s pretrained run keeps each module on one worker (`--dist loadfile`), and the modules marked
`ONE_AT_A_TIME` (tests/harness.py: they peak at several GB) or taking its lock for a step (`alone`) run in it: with
`--dist load` such a module could be split over both workers, its module fixtures built twice at once."""

import os
import pathlib
import re
import subprocess
import sys
import textwrap

from tests.harness import ROOT, takes_the_one_at_a_time_lock


def _make_variable(text, name):
    match = re.search(rf"^{name} :=(.*)$", text, re.M)
    assert match, f"the Makefile defines {name}"
    return match.group(1).split()


def test_one_at_a_time_modules_run_in_the_loadfile_run():
    with open(os.path.join(ROOT, "Makefile")) as f:
        makefile = f.read()
    pretrained = _make_variable(makefile, "PRETRAINED")
    runs = [line.strip() for line in makefile.splitlines() if "$(PYTEST) " in line]  # after their variables
    assert any("--dist loadfile $(PRETRAINED)" in run for run in runs), runs
    marked = [str(path.relative_to(ROOT)) for path in pathlib.Path(ROOT, "tests").rglob("test_*.py")
              if takes_the_one_at_a_time_lock(path)]
    assert len(marked) >= 4, marked
    for path in marked:
        assert any(path == p or path.startswith(p.rstrip("/") + "/") for p in pretrained), (
            f"{path} is marked ONE_AT_A_TIME but runs outside the pretrained run {pretrained}")


def test_one_at_a_time_modules_never_overlap_on_two_workers(tmp_path):
    """Two marked modules and a plain one on two xdist workers (`--dist loadfile`, tests/conftest.py's scheduler):
    the marked ones never overlap, and run on one worker one after the other while the other worker runs the plain
    module, so no worker waits for the lock."""
    (tmp_path / "conftest.py").write_text(
        "from tests.conftest import one_at_a_time, pytest_xdist_make_scheduler  # noqa: F401\n")
    for name, marked in (("a", True), ("b", True), ("c", False)):
        (tmp_path / f"test_{name}.py").write_text(textwrap.dedent(f"""
            import os
            import time
            from tests.harness import ONE_AT_A_TIME
            {"pytestmark = ONE_AT_A_TIME" if marked else ""}

            def test_{name}():
                start = time.time()
                time.sleep(1.5)
                with open({str(tmp_path / "spans")!r}, "a") as f:
                    f.write(f"{name} {{start}} {{time.time()}} {{os.environ['PYTEST_XDIST_WORKER']}}\\n")
            """))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", "-p",
                          "no:cacheprovider", "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    spans = {name: (float(start), float(end), worker) for name, start, end, worker in
             (line.split() for line in (tmp_path / "spans").read_text().splitlines())}
    (first_start, first_end, first_worker), (second_start, second_end, second_worker) = sorted(
        spans[name] for name in "ab")
    assert first_end <= second_start, "the second module started while the first held the lock"
    assert first_worker == second_worker != spans["c"][2], spans
