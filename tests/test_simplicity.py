"""One helper per check, one home per constant (read with `ast`, so a violation fails before anything runs).

- An int/number argument check that rejects bools is written once, in `tfformer/checks.py` (`check_int`,
  `check_number`, `is_int`, `is_number`); nowhere else does an `isinstance(x, bool)` sit beside an int check, nor
  does `type(x) is int` stand in for one.
- The special token ids are assigned in `tfformer/tokens.py` alone; the others import them.
- Files are swapped in with `os.replace` in `tfformer/files.py` alone (`atomic_path`, `write_atomic`,
  `write_json`); the decoding tasks share one `empty_cache`; ids are cut at an end id by `tfformer.tokens.cut_at_end`.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tfformer"
CHECKS = "tfformer/checks.py"
SPECIAL_IDS = ("PAD_ID", "UNK_ID", "START_ID", "END_ID")


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text(), filename=str(path))


def _type_names(node):
    """The last names of the types an `isinstance` second argument lists: `(int, np.integer)` -> {int, integer}."""
    elements = node.elts if isinstance(node, ast.Tuple) else [node]
    return {e.id if isinstance(e, ast.Name) else e.attr for e in elements if isinstance(e, (ast.Name, ast.Attribute))}


def _isinstance_types(expression):
    """The type-name sets of every `isinstance(x, types)` call inside `expression`."""
    for node in ast.walk(expression):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance"
                and len(node.args) == 2):
            yield _type_names(node.args[1])


def _is_type_call(node):
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "type"


def hand_written_int_checks(tree):
    """Line numbers of hand-written int checks in `tree`: an expression with `isinstance(..., bool)` beside an
    `isinstance(..., int | float | np.integer | numbers.Integral | numbers.Number)`, or a `type(x)` compared with
    `is`/`==`/`in`."""
    numeric = {"int", "float", "integer", "Integral", "Number", "Real"}
    lines = set()
    for statement in ast.walk(tree):
        if not isinstance(statement, ast.stmt):
            continue
        # The statement's own expressions (its test, value, ...), not the statements nested in its body.
        for field, value in ast.iter_fields(statement):
            for expression in value if isinstance(value, list) else [value]:
                if not isinstance(expression, ast.expr):
                    continue
                types = list(_isinstance_types(expression))
                if any("bool" in t for t in types) and any(t & numeric for t in types):
                    lines.add(statement.lineno)
                for node in ast.walk(expression):
                    if isinstance(node, ast.Compare) and any(map(_is_type_call, [node.left] + node.comparators)):
                        lines.add(statement.lineno)
    return sorted(lines)


def test_int_checks_use_the_shared_helpers():
    found = {path: lines for path, tree in _modules() if path != CHECKS and (lines := hand_written_int_checks(tree))}
    assert not found, f"hand-written int/bool checks (use tfformer.checks.check_int/check_number/is_int): {found}"


@pytest.mark.parametrize("source, line", [
    ("if isinstance(n, bool) or not isinstance(n, int) or n < 1:\n    raise ValueError(n)", 1),
    ("ok = not isinstance(n, (int, np.integer)) or isinstance(n, bool)", 1),
    ("def f(x):\n    return isinstance(x, numbers.Number) and not isinstance(x, bool)", 2),
    ("assert type(n) is int", 1),
    ("if type(n) in (int, float):\n    pass", 1),
])
def test_hand_written_int_checks_are_found(source, line):
    assert hand_written_int_checks(ast.parse(source)) == [line]


def test_a_bool_dispatch_is_no_int_check():
    source = "if isinstance(v, bool):\n    kind = 'bool'\nelif isinstance(v, int):\n    kind = 'int'"
    assert hand_written_int_checks(ast.parse(source)) == []  # each test checks one type


def _bound(target):
    if isinstance(target, ast.Name):
        yield target.id
    elif isinstance(target, (ast.Tuple, ast.List, ast.Starred)):
        for element in target.elts if not isinstance(target, ast.Starred) else [target.value]:
            yield from _bound(element)


def assigned_names(tree):
    """Names bound at any level of `tree` by assignments (tuple targets included; not `x[PAD_ID] = ...`)."""
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.NamedExpr)) else [])
        for target in targets:
            yield from _bound(target)


def test_special_ids_are_assigned_in_one_module():
    homes = {name: [] for name in SPECIAL_IDS}
    for path, tree in _modules():
        for name in set(assigned_names(tree)) & set(SPECIAL_IDS):
            homes[name].append(path)
    assert homes == {name: ["tfformer/tokens.py"] for name in SPECIAL_IDS}


def test_special_ids_check_sees_a_second_home():
    assert set(assigned_names(ast.parse("PAD_ID, UNK_ID, START_ID, END_ID = 0, 1, 2, 3"))) == set(SPECIAL_IDS)
    assert list(assigned_names(ast.parse("from tfformer.tokens import END_ID\nscores[PAD_ID] = 0.0"))) == []


def test_files_are_swapped_in_by_one_helper():
    users = sorted(path for path, tree in _modules() for node in ast.walk(tree)
                   if isinstance(node, ast.Attribute) and node.attr == "replace" and isinstance(node.value, ast.Name)
                   and node.value.id == "os")
    assert users == ["tfformer/files.py"], users


def test_empty_cache_is_written_once():
    homes = sorted(path for path, tree in _modules() for node in ast.walk(tree)
                   if isinstance(node, ast.FunctionDef) and node.name == "empty_cache")
    assert homes == ["tfformer/models/base.py"], homes


def ids_cut_at_an_index(tree):
    """Line numbers of slices `ids[: ids.index(end) ...]`: ids cut at an end id by hand."""
    return sorted(node.lineno for node in ast.walk(tree) if isinstance(node, ast.Slice) and node.upper is not None
                  and any(isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                          and call.func.attr == "index" for call in ast.walk(node.upper)))


def test_ids_are_cut_at_the_end_id_in_one_place():
    found = {path: lines for path, tree in _modules() if (lines := ids_cut_at_an_index(tree))}
    assert list(found) == ["tfformer/tokens.py"], f"use tfformer.tokens.cut_at_end: {found}"
    assert ids_cut_at_an_index(ast.parse("row = row[: row.index(END_ID) + 1] if END_ID in row else row")) == [1]


# --- Short functions -------------------------------------------------------------------------------------------------

MAX_BODY_LINES = 60
# Functions allowed over MAX_BODY_LINES for now, as "path:name" (train_translation, train_lm and WhisperModel._build
# were, until the dtype work split them). The test fails if one of them is no longer long, so that the set cannot go
# stale.
STILL_LONG = set()


def body_lines(function):
    """Lines of `function`'s body, docstring excluded: from its first statement after the docstring to the end of its
    last (a nested function's lines count here too, and the nested function is measured on its own as well)."""
    body = function.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(
            body[0].value.value, str):
        body = body[1:]
    return body[-1].end_lineno - body[0].lineno + 1 if body else 0


def long_functions(limit=MAX_BODY_LINES):
    """`{"path:name": body lines}` of the functions and methods of tfformer/ over `limit`."""
    return {f"{path}:{node.name}": body_lines(node) for path, tree in _modules() for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and body_lines(node) > limit}


def test_functions_are_short():
    long = long_functions()
    assert not set(long) - STILL_LONG, f"bodies over {MAX_BODY_LINES} lines: split them: " + str(
        {name: lines for name, lines in long.items() if name not in STILL_LONG})
    assert not STILL_LONG - set(long), f"no longer long, remove from STILL_LONG: {sorted(STILL_LONG - set(long))}"


@pytest.mark.parametrize("source, lines", [
    ('def f():\n    """Doc\n    string."""\n    a = 1\n\n    return a\n', 3),
    ("def f():\n    return 1\n", 1),
    ('def f():\n    """Only a docstring."""\n', 0),
    ("def f():\n    def g():\n        return 1\n\n    return g\n", 4),
    ("def f(x):\n    return (x +\n            1)\n", 2),
])
def test_body_lines_skip_the_docstring_and_count_nested_functions(source, lines):
    assert body_lines(ast.parse(source).body[0]) == lines


# Issue 52's sizes: attention holds attention, not decode engineering; generation/ holds the model-agnostic loop
# (samplers, beam, the cached decode and its plan). A model's own decoding rules live with the model
# (models/whisper_decode.py), as keras-hub keeps them in the model's task.
MAX_LINES = {"tfformer/layers/attention.py": 350, "tfformer/generation": 900}


def _lines(relative):
    path = ROOT / relative
    files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return sum(len(f.read_text().splitlines()) for f in files)


@pytest.mark.parametrize("relative", sorted(MAX_LINES))
def test_attention_and_generation_stay_short(relative):
    lines = _lines(relative)
    assert lines <= MAX_LINES[relative], f"{relative}: {lines} lines, at most {MAX_LINES[relative]}"
