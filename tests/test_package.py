"""Package-level checks: import direction, registration, the CLI."""

import ast
import inspect
import pathlib
import subprocess
import sys

import keras
import pytest

import tfformer
from tfformer import cli, layers

ROOT = pathlib.Path(tfformer.__file__).parent
# Which tfformer packages each package may import (layers -> generation -> models -> export; data and training
# beside them; nothing imports cli). Generation sits below models, as keras-hub's samplers do: its loops are driven
# through the model's decode step and import no model, and a task's `generate` calls them.
ALLOWED = {
    "layers": {"layers"},
    "generation": {"layers", "generation"},
    # tasks tokenize with tfformer.data and decode with tfformer.generation
    "models": {"layers", "generation", "data", "models"},
    # export may read the run's tokenizer (tfformer.data) to put it in the graph
    "export": {"layers", "models", "generation", "export", "data"},
    # edge applies the same text pre/post-processing as the SavedModel (tfformer.data.placeholders), on the host
    "edge": {"edge", "export", "data"},
    "data": {"data"},
    "training": {"models", "data", "training", "layers"},
    "serving": {"serving", "export"},
    # converters attach the checkpoint's tokenizer (tfformer.data) and decoding settings to the task they build
    "convert": {"layers", "generation", "models", "data", "convert"},
    # recipes are end-to-end jobs: everything but the CLI
    "recipes": {"layers", "models", "generation", "export", "data", "training", "serving", "convert", "recipes"},
}
# Modules every package may import: argument checks, the special token ids, atomic file writes. They import no
# other tfformer module, so they sit below every package of ALLOWED.
FOUNDATIONS = ("checks.py", "tokens.py", "files.py")
# Modules the host loops (tfformer.edge) share with the graphs, without TensorFlow: they import numpy and the
# foundations only.
TF_FREE = ("timestamps.py",)


def _tfformer_imports(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "tfformer" and len(parts) > 1:
                yield parts[1]


def test_imports_flow_one_way():
    for path in ROOT.rglob("*.py"):
        package = path.relative_to(ROOT).parts[0]
        for imported in _tfformer_imports(path):
            assert imported != "cli" or package == "cli.py", f"{path} imports tfformer.cli"
            if package in ALLOWED and imported in {"layers", "models", "generation", "export", "data", "training",
                                                   "serving", "convert"}:
                assert imported in ALLOWED[package], f"{path} ({package}) must not import tfformer.{imported}"


def test_foundations_import_nothing_from_tfformer():
    for name in FOUNDATIONS:
        assert list(_tfformer_imports(ROOT / name)) == [], f"tfformer/{name} must import no tfformer module"


def test_tf_free_modules_import_no_tensorflow():
    foundations = {name.removesuffix(".py") for name in FOUNDATIONS}
    for name in TF_FREE + FOUNDATIONS:
        tree = ast.parse((ROOT / name).read_text())
        modules = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        modules |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        tops = {module.split(".")[0] for module in modules}
        assert not tops & {"tensorflow", "keras", "tensorflow_text"}, f"tfformer/{name} imports {sorted(tops)}"
        assert set(_tfformer_imports(ROOT / name)) <= foundations, f"tfformer/{name} imports more than the foundations"


def test_allowed_imports_have_no_cycle():
    # A package may import itself; between packages the allowed imports must form a DAG.
    done, active = set(), set()

    def visit(package):
        assert package not in active, f"import cycle through {package}"
        if package in done:
            return
        active.add(package)
        for imported in ALLOWED.get(package, set()) - {package}:
            visit(imported)
        active.remove(package)
        done.add(package)

    for package in ALLOWED:
        visit(package)
    # and the check fails on a planted cycle
    ALLOWED["layers"].add("models")
    try:
        with pytest.raises(AssertionError, match="import cycle"):
            done.clear()
            visit("models")
    finally:
        ALLOWED["layers"].discard("models")


def test_every_public_layer_is_registered():
    for name in layers.__all__:
        obj = getattr(layers, name)
        if inspect.isclass(obj):
            assert keras.saving.get_registered_name(obj) == f"tfformer>{name}"


def test_cli_presets_and_bad_command(capsys):
    assert cli.main(["presets"]) == 0
    assert "transformer-base" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["no-such-command"])


def test_console_script_is_installed():
    out = subprocess.run([sys.executable, "-m", "tfformer.cli", "presets"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "gpt-mini" in out.stdout
