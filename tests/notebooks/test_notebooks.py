"""Every notebook runs top to bottom in a fresh kernel in quick mode (`TFFORMER_QUICK=1`).

The committed sources are jupytext percent-format `.py` files; the `.ipynb` is generated here (in a temporary
directory) and executed with nbclient. Any cell error, including a failed check cell, fails the test.
"""

import pathlib
import time

import jupytext
import pytest
from nbclient import NotebookClient

NOTEBOOKS_DIR = pathlib.Path(__file__).resolve().parents[2] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("[0-9][0-9]_*.py"))
CELL_TIMEOUT = 300  # seconds per cell
# Notebooks whose figures must reach the output as PNG images.
WITH_FIGURES = {"01_attention_from_scratch", "02_translate_with_model_fit", "03_gpt_text_generation",
                "05_pretrained_minilm", "06_small_llm", "07_speech_to_text"}


# The runs are this file's first tests, in this order: xdist (`--dist load`) hands tests out in collection order, a
# few at a time, so the longest notebook starts first and the second longest on the other worker, each with a short
# one next, and the rest fill in. In ci80 (alphabetical order, the runs after the quick checks) 06 took 236 s, 07
# 107 s, 02 54 s, 04 44 s, the others under 30 s, and the run 426 s on 2 workers for about 520 s of tests; in ci91,
# in this order, one worker ran 06 alone (205 s), the other the six others (224 s), and the run took 237 s.
RUN_ORDER = ["06_small_llm", "01_attention_from_scratch", "07_speech_to_text", "05_pretrained_minilm"]


def _run_order(path):
    return (RUN_ORDER.index(path.stem) if path.stem in RUN_ORDER else len(RUN_ORDER), path.stem)


@pytest.mark.parametrize("source", sorted(NOTEBOOKS, key=_run_order), ids=lambda p: p.stem)
def test_notebook_runs_in_quick_mode(source, tmp_path, monkeypatch):
    monkeypatch.setenv("TFFORMER_QUICK", "1")
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "2")
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    notebook = jupytext.read(source, fmt="py:percent")
    jupytext.write(notebook, tmp_path / f"{source.stem}.ipynb")  # the generated notebook (never committed)
    client = NotebookClient(notebook, timeout=CELL_TIMEOUT, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOKS_DIR)}})
    start = time.monotonic()
    client.execute()  # raises CellExecutionError on the first failing cell
    print(f"{source.stem}: {time.monotonic() - start:.1f}s")

    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    assert "all checks passed" in text
    if source.stem in WITH_FIGURES:
        assert any("image/png" in o.get("data", {}) for o in outputs), "no figure was rendered"


def test_every_notebook_exists():
    """01-05 and 07 always; 06 (the small LLM) once it is written."""
    expected = ["01", "02", "03", "04", "05", "07"]
    if (NOTEBOOKS_DIR / "06_small_llm.py").exists():
        expected.insert(5, "06")
    assert [p.stem[:2] for p in NOTEBOOKS] == expected


@pytest.mark.parametrize("source", NOTEBOOKS, ids=lambda p: p.stem)
def test_source_is_percent_format_with_a_check_cell(source):
    text = source.read_text()
    notebook = jupytext.reads(text, fmt="py:percent")
    code = [cell.source for cell in notebook.cells if cell.cell_type == "code"]
    assert len(code) >= 3
    assert "TFFORMER_QUICK" in text
    assert "assert " in code[-1], "the last cell checks what the notebook teaches"
    assert "plt.show()" not in text
