"""The runner keeps each run's JSON lines in benchmarks/results/<YYYY-MM-DD>-<short commit>.jsonl.

A stand-in workload (a module that prints what a benchmark prints: JSON lines among text) keeps this fast; the
real workloads' smoke run is tests/benchmarks/test_runner_smoke.py.
"""

import datetime
import json
import os
import re
import subprocess
import sys

import pytest

from benchmarks import __main__ as runner

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECORDS = [{"bench": "fake", "system": "a", "ratio": 1.25}, {"bench": "goal", "goal": "fake >= 1x", "met": True}]


@pytest.fixture
def fake_workloads(tmp_path, monkeypatch):
    """Workloads "fake" (prints RECORDS among text and a JSON list, which is no record) and "failing" (one record,
    then exit code 3), importable by the runner's child interpreters."""
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "fake_workload.py").write_text(
        "import json, sys\n"
        "print('## a table')\n"
        f"print(json.dumps({RECORDS[0]!r}))\n"
        "print('| system | ratio |')\n"
        "print('[1, 2]')\n"
        f"print(json.dumps({RECORDS[1]!r}))\n"
        "print('smoke' if '--smoke' in sys.argv else 'full')\n"
        "print('options:', *sys.argv[1:])\n")
    (modules / "failing_workload.py").write_text(
        f"import json, sys\nprint(json.dumps({RECORDS[0]!r}), flush=True)\nsys.exit(3)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(modules), ROOT]))
    monkeypatch.setitem(runner.WORKLOADS, "fake", "fake_workload")
    monkeypatch.setitem(runner.WORKLOADS, "failing", "failing_workload")
    return tmp_path


def _git(*args):
    return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, check=True).stdout.strip()


def _lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_a_run_writes_its_json_lines_under_the_date_and_commit(fake_workloads, capfd):
    out_dir = fake_workloads / "results"
    before = datetime.datetime.now(datetime.timezone.utc).date()
    assert runner.main(["run", "fake", "fake", "--results-dir", str(out_dir)]) == 0
    after = datetime.datetime.now(datetime.timezone.utc).date()
    (name,) = os.listdir(out_dir)
    # The date of the run (UTC) and the commit's short hash, as git itself spells it.
    assert name in {f"{day:%Y-%m-%d}-{_git('rev-parse', '--short', 'HEAD')}.jsonl" for day in (before, after)}
    header, *records = _lines(out_dir / name)
    assert records == RECORDS  # the workload's JSON lines, in order; text and a JSON list left out; "fake" once
    assert header["bench"] == "run" and header["workloads"] == ["fake"] and header["smoke"] is False
    assert header["command"] == ["python", "-m", "benchmarks", "run", "fake", "fake", "--results-dir", str(out_dir)]
    assert header["commit"] == _git("rev-parse", "HEAD")
    assert header["uncommitted_changes"] == bool(_git("status", "--porcelain", "--untracked-files=no"))
    assert header["cores"] == len(os.sched_getaffinity(0)) and header["cpus"] == os.cpu_count()
    assert datetime.datetime.fromisoformat(header["utc"]).date() in {before, after}
    # The CPU as /proc/cpuinfo names it, and which of the flags that matter it has.
    with open("/proc/cpuinfo") as f:
        first = f.read().split("\n\n")[0]
    flags = set(re.search(r"^flags\s*:(.*)$", first, re.M).group(1).split())
    assert header["cpu"] == re.search(r"^model name\s*:\s*(.*)$", first, re.M).group(1).strip()
    assert header["cpu_flags"] == [flag for flag in runner.CPU_FLAGS if flag in flags]
    assert header["versions"]["tensorflow"] and header["versions"]["keras"]
    # Everything still reaches the terminal, and the runner says where the lines went.
    out = capfd.readouterr().out
    assert out.count("## a table") == 1 and "| system | ratio |" in out and "[1, 2]" in out and "full" in out
    assert out.strip().endswith(os.path.relpath(out_dir / name))


def test_another_run_that_day_gets_a_file_of_its_own(fake_workloads):
    out_dir = fake_workloads / "results"
    for _ in range(3):
        assert runner.main(["run", "fake", "--results-dir", str(out_dir)]) == 0
    names = sorted(os.listdir(out_dir))
    stem = min(names, key=len)[:-len(".jsonl")]  # the first run's
    assert names == sorted([f"{stem}.jsonl", f"{stem}-2.jsonl", f"{stem}-3.jsonl"])
    assert all(_lines(out_dir / name)[1:] == RECORDS for name in names)


def test_no_results_and_smoke_runs_write_nothing(fake_workloads, monkeypatch, capfd):
    default = fake_workloads / "default"
    monkeypatch.setattr(runner, "RESULTS_DIR", str(default))
    assert runner.main(["run", "fake", "--no-results"]) == 0
    assert runner.main(["run", "fake", "--smoke"]) == 0  # numbers of a smoke run mean nothing
    assert not default.exists()
    assert "smoke" in capfd.readouterr().out  # the flag still reaches the workload
    # Without --results-dir a full run writes to the default directory; a smoke run only where it is told to.
    assert runner.main(["run", "fake"]) == 0
    assert len(os.listdir(default)) == 1
    assert runner.main(["run", "fake", "--smoke", "--results-dir", str(fake_workloads / "smoke")]) == 0
    ((name,),) = [os.listdir(fake_workloads / "smoke")]
    header, *records = _lines(fake_workloads / "smoke" / name)
    assert header["smoke"] is True and records == RECORDS


def test_a_failing_workload_keeps_what_ran_before_it(fake_workloads):
    out_dir = fake_workloads / "results"
    assert runner.main(["run", "fake", "failing", "fake", "--results-dir", str(out_dir)]) == 3
    (name,) = os.listdir(out_dir)
    # The first workload's lines, the failing one's line before it exited; the run stopped there.
    assert _lines(out_dir / name)[1:] == RECORDS + RECORDS[:1]


def test_the_runner_from_the_command_line():
    # The options as `python -m benchmarks run --help` shows them to a user.
    out = subprocess.run([sys.executable, "-m", "benchmarks", "run", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "--results-dir" in out.stdout and "--no-results" in out.stdout


def test_systems_narrows_smoke_runs_of_the_workloads_that_take_it(fake_workloads, monkeypatch, capfd):
    # `--systems peers` reaches a workload that takes it (smoke runs only), and only when given.
    monkeypatch.setattr(runner, "WITH_SYSTEMS", ("fake",))
    assert runner.main(["run", "fake", "--smoke", "--systems", "peers"]) == 0
    assert "options: --smoke --systems peers" in capfd.readouterr().out
    assert runner.main(["run", "fake", "--smoke", "--systems", "all"]) == 0
    assert "options: --smoke\n" in capfd.readouterr().out
    # A bad value, a run that is no smoke run or a workload without the option: a usage error naming the argument,
    # before any workload runs.
    for argv, message in ((["fake", "--smoke", "--systems", "none"], "invalid choice: 'none'"),
                          (["fake", "--systems", "peers"], "'peers' needs --smoke"),
                          (["fake", "failing", "--smoke", "--systems", "peers"],
                           "'peers' applies to fake only, not failing")):
        with pytest.raises(SystemExit) as exit_info:
            runner.main(["run", *argv, "--no-results"])
        out = capfd.readouterr()
        assert exit_info.value.code == 2 and f"argument --systems: {message}" in out.err and "options:" not in out.out


@pytest.mark.parametrize("workload", ["training", "generation"])
def test_workloads_take_systems_in_smoke_runs_only(workload, capsys):
    import importlib

    module = importlib.import_module(f"benchmarks.{workload}")
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--systems", "peers"])  # a usage error before anything is built
    assert exit_info.value.code == 2 and "argument --systems: 'peers' needs --smoke" in capsys.readouterr().err
