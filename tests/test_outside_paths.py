"""Nothing depends on state outside the clone: no `/tmp` location in the package, the benchmarks or the tools.

Scratch space comes from `tempfile`, the benchmarks' peers from `.venv-peers` in the clone (`benchmarks.peers`).
The only outside inputs are installed packages and the gettext catalogs under /usr/share/locale. The raw results
of past benchmark runs (benchmarks/results/*.jsonl) are records, kept as they were written, and not read here.
"""

import os
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCANNED = ("tfformer", "benchmarks", "tools")
RECORDS = ROOT / "benchmarks" / "results"
# "/tmp" as a path of its own: "/tmp/x", "/tmp" at a string's end, os.path.join("/tmp", ...); not "/tmpfoo".
TMP = re.compile(r"/tmp(?![\w.-])")


def scanned_files():
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and RECORDS not in path.parents:
                yield path


def tmp_lines(text):
    """`(line number, line)` of each line of `text` that names /tmp."""
    return [(number, line.strip()) for number, line in enumerate(text.splitlines(), 1) if TMP.search(line)]


def test_the_pattern_finds_every_spelling():
    found = tmp_lines('a = "/tmp/ct2venv/bin/python"\nb = os.path.join("/tmp", "x")\n'
                      "docs: default /tmp/edge-parity\nc = '/tmp'\nd = '/tmpfoo' + 'x/tmpl'\n")
    assert [number for number, _ in found] == [1, 2, 3, 4]


def test_no_file_names_tmp():
    files = list(scanned_files())
    assert len(files) > 50 and any(path.suffix == ".md" for path in files)
    offenders = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:  # binary fixtures: a literal would be bytes no code reads as a path
            continue
        offenders += [f"{path.relative_to(ROOT)}:{number}: {line}" for number, line in tmp_lines(text)]
    assert not offenders, "use tempfile for scratch space, .venv-peers for peers:\n" + "\n".join(offenders)


def test_peers_come_from_the_clone(monkeypatch, tmp_path):
    """Without `TFFORMER_PEERS`, the peers' directory is `.venv-peers` in this clone; with it, that directory. A
    missing peer is a skip that names it and the command that makes it."""
    from benchmarks import ct2_worker, peers, torch_worker

    monkeypatch.delenv(peers.ENV, raising=False)
    assert os.path.realpath(peers.directory()) == str(ROOT / ".venv-peers")
    monkeypatch.setenv(peers.ENV, str(tmp_path))
    assert peers.directory() == str(tmp_path) and peers.python() is None and peers.binary("llama-bench") is None
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "llama-bench").write_text("#!/bin/sh\n")
    assert peers.binary("llama-bench") is None  # not executable
    (tmp_path / "bin" / "llama-bench").chmod(0o755)
    assert peers.binary("llama-bench") == str(tmp_path / "bin" / "llama-bench")
    for python, why in (torch_worker.torch_python("llm"), ct2_worker.ct2_python()):
        assert python is None and "bin/python (`make peers` installs it" in why
