"""tfformer uses only public Keras/TensorFlow APIs outside `tfformer/compat.py` (issue 40, point 4).

`public_api_violations` reads a module's source with `ast` and reports: imports of `keras.src`,
`tensorflow.python` or `tensorflow.compiler` in any form (`import`, `from ... import`, `importlib.import_module`,
`__import__`, attribute access such as `keras.src`), and access to a private attribute `x._name` (also through
`getattr`/`setattr`/`hasattr`/`delattr` with a literal name) where `x` is not `self`/`cls`, or where the name is a
private attribute of a Keras/TF base class even on `self`. Our own private attributes on `self` stay allowed.
"""

import ast
import pathlib

import keras
import pytest
import tensorflow as tf

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "tfformer"
ALLOWED = {PACKAGE / "compat.py"}  # the one module that may reach private APIs, one tested function per need
FORBIDDEN_MODULES = ("keras.src", "tensorflow.python", "tensorflow.compiler")
ALIASES = {"tf": "tensorflow"}  # `tf.python` is `tensorflow.python`
ATTRIBUTE_FUNCTIONS = ("getattr", "setattr", "hasattr", "delattr")
IMPORT_FUNCTIONS = ("import_module", "__import__")


def _is_private(name):
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _forbidden(module):
    module = ALIASES.get(module.split(".")[0], module.split(".")[0]) + module[len(module.split(".")[0]):]
    return any(module == prefix or module.startswith(prefix + ".") for prefix in FORBIDDEN_MODULES)


def _dotted(node):
    """`a.b.c` for an attribute chain on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id] + parts[::-1])


def keras_private_names():
    """Private attribute names of Keras/TF base classes and of built instances (compiled model, built optimizer):
    what a subclass would inherit, so `self._name` with one of them reaches into Keras/TF."""
    inputs = keras.Input((2,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))  # a functional model, as tfformer's are
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    optimizer = keras.optimizers.AdamW()
    optimizer.build(model.trainable_variables)
    objects = [
        keras.Model, model, keras.layers.Layer, keras.layers.Layer(), keras.layers.Dense(1),
        keras.optimizers.Adam, keras.optimizers.Adam(), keras.optimizers.AdamW, optimizer,
        keras.losses.Loss, keras.losses.Loss(), keras.metrics.Metric, keras.metrics.Mean(),
        keras.callbacks.Callback, keras.callbacks.Callback(),
        keras.callbacks.BackupAndRestore, keras.callbacks.BackupAndRestore("unused-backup-dir"),
        tf.Module, tf.Module(),
    ]
    return frozenset(name for obj in objects for name in dir(obj) if _is_private(name))


def keras_derived_classes(sources):
    """Names of the classes in `sources` (module texts) that derive from a Keras/TF class, directly, through
    another of these classes, or as a mixin listed beside one (`class A(Mixin, keras.optimizers.Adam)`)."""
    bases = {}
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef):
                bases.setdefault(node.name, set()).update(filter(None, (_dotted(base) for base in node.bases)))
    derived = set()
    while True:
        grown = set(derived)
        for name, dotted in bases.items():
            roots = {ALIASES.get(d.split(".")[0], d.split(".")[0]) for d in dotted}
            if roots & {"keras", "tensorflow"} or {d.split(".")[-1] for d in dotted} & grown:
                grown.add(name)
                grown.update(d.split(".")[-1] for d in dotted if d.split(".")[-1] in bases)  # its mixins
        if grown == derived:
            return frozenset(derived)
        derived = grown


class _Checker(ast.NodeVisitor):
    def __init__(self, filename, private_names, keras_classes):
        self.filename, self.private_names, self.keras_classes = filename, private_names, keras_classes
        self.classes = []  # enclosing class names, innermost last
        self.found = []

    def report(self, node, what):
        self.found.append(f"{self.filename}:{node.lineno}: {what}")

    def visit_ClassDef(self, node):
        self.classes.append(node.name)
        self.generic_visit(node)
        self.classes.pop()

    def in_keras_class(self):
        return self.keras_classes is None or not self.classes or self.classes[-1] in self.keras_classes

    def visit_FunctionDef(self, node):
        if self.classes and self.in_keras_class() and node.name in self.private_names:
            self.report(node, f"`{node.name}` overrides a private method of a Keras/TF base class")
        self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef

    def check_attribute(self, node, owner, name):
        if not _is_private(name):
            return
        # `super()` reaches the same class hierarchy as `self`: our own private methods, or Keras' (caught below).
        is_super = isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super"
        if not (is_super or isinstance(owner, ast.Name) and owner.id in ("self", "cls")):
            self.report(node, f"private attribute `{ast.unparse(owner)}.{name}`")
            return
        if self.in_keras_class() and name in self.private_names:
            self.report(node, f"`{ast.unparse(owner)}.{name}` is a private attribute of a Keras/TF base class")

    def visit_Import(self, node):
        for alias in node.names:
            if _forbidden(alias.name):
                self.report(node, f"import of {alias.name}")

    def visit_ImportFrom(self, node):
        if node.module and not node.level:
            if _forbidden(node.module):
                self.report(node, f"import from {node.module}")
            else:
                for alias in node.names:
                    if _forbidden(f"{node.module}.{alias.name}"):
                        self.report(node, f"import of {node.module}.{alias.name}")

    def visit_Attribute(self, node):
        dotted = _dotted(node)
        if dotted is not None and _forbidden(dotted) and not _forbidden(dotted.rsplit(".", 1)[0]):
            self.report(node, f"use of {dotted}")
        self.check_attribute(node, node.value, node.attr)
        self.generic_visit(node)

    def visit_Call(self, node):
        function = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        if node.args:
            first = node.args[0]
            literal = node.args[1] if len(node.args) > 1 else None
            if function in IMPORT_FUNCTIONS and isinstance(first, ast.Constant) and isinstance(first.value, str):
                if _forbidden(first.value):
                    self.report(node, f"import of {first.value} through {function}")
            if (function in ATTRIBUTE_FUNCTIONS and isinstance(literal, ast.Constant)
                    and isinstance(literal.value, str)):
                self.check_attribute(node, first, literal.value)
        self.generic_visit(node)


def public_api_violations(source, filename="<string>", private_names=frozenset(), keras_classes=None):
    """`["file:line: what"]` for every use of a non-public Keras/TF API in `source`.

    `private_names`: the Keras/TF base classes' private attribute names, forbidden also on `self`/`cls` inside a
    class named in `keras_classes` (None: inside every class, and outside classes).
    """
    checker = _Checker(filename, private_names, keras_classes)
    checker.visit(ast.parse(source, filename))
    return checker.found


@pytest.fixture(scope="module")
def private_names():
    return keras_private_names()


def test_private_names_hold_what_keras_hides(private_names):
    """The collected names include the internals tfformer used to reach (so `self.<name>` is caught)."""
    for name in ("_compile_config", "_loss_tracker", "_initial_epoch", "_momentums", "_velocities",
                 "_get_variable_index", "_apply_weight_decay", "_aggregate_additional_loss", "_standardize_inputs",
                 "_flatten_layers", "_weights_path", "_current_epoch"):
        assert name in private_names, name
    for ours in ("_build", "_projection_inputs", "_evaluate"):
        assert ours not in private_names, ours


PLANTED = {
    "import keras.src.losses": "import of keras.src.losses",
    "import keras.src as ks": "import of keras.src",
    "from keras.src.losses import loss": "import from keras.src.losses",
    "from keras import src": "import of keras.src",
    "from tensorflow.python.eager import record": "import from tensorflow.python.eager",
    "from tensorflow import python": "import of tensorflow.python",
    "from tensorflow.compiler.tf2xla.python import xla": "import from tensorflow.compiler.tf2xla.python",
    "import importlib\nimportlib.import_module('keras.src.models')": "import of keras.src.models through import_module",
    "from importlib import import_module\nimport_module('tensorflow.python')": "through import_module",
    "__import__('tensorflow.compiler.xla')": "import of tensorflow.compiler.xla through __import__",
    "import tensorflow as tf\ntf.python.eager": "use of tf.python",
    "y = model._compile_config": "private attribute `model._compile_config`",
    "y = layer._private_helper": "private attribute `layer._private_helper`",
    "y = super()._apply_weight_decay(v)": "`super()._apply_weight_decay` is a private attribute",
    "y = super(A, self)._apply_weight_decay(v)": "`super(A, self)._apply_weight_decay` is a private attribute",
    "y = getattr(model, '_compile_config', None)": "private attribute `model._compile_config`",
    "hasattr(x, '_keras_mask')": "private attribute `x._keras_mask`",
    "class A:\n    def f(self):\n        return self._loss_tracker": "`self._loss_tracker` is a private attribute",
    "class A:\n    def f(self):\n        self._initial_epoch = 0": "`self._initial_epoch` is a private attribute",
    "class A:\n    def _apply_weight_decay(self, v):\n        pass": "overrides a private method",
    "class A:\n    @classmethod\n    def f(cls):\n        return cls._flatten_layers": "`cls._flatten_layers`",
}


@pytest.mark.parametrize("source", sorted(PLANTED))
def test_checker_catches_a_planted_violation(source, private_names):
    found = public_api_violations(source, "planted.py", private_names)
    assert found, source
    assert any(PLANTED[source] in line for line in found), found


@pytest.mark.parametrize("source", [
    "import keras\nfrom keras import ops\nimport tensorflow as tf\nx = keras.layers.Dense",
    "from tensorflow import keras",
    "import keras_hub.src",  # another package's layout is not Keras' internals
    "class A:\n    def f(self):\n        self._hidden_model = None\n        return self._projection_inputs",
    "class A:\n    def _block(self):\n        return super()._block()",  # our own private method, one level up
    "class A:\n    def __init__(self):\n        super().__init__()\n        x = self.__class__",
    "getattr(model, 'name')",
    "from . import _private",
    "import importlib\nimportlib.import_module(name)",
])
def test_checker_allows_public_use_and_our_own_privates(source, private_names):
    assert public_api_violations(source, "clean.py", private_names) == []


def test_tfformer_uses_only_public_keras_and_tensorflow(private_names):
    sources = {path: path.read_text() for path in sorted(PACKAGE.rglob("*.py"))}
    keras_classes = keras_derived_classes(sources.values())
    found = []
    for path, source in sources.items():
        if path not in ALLOWED:
            found += public_api_violations(source, str(path.relative_to(PACKAGE.parent)), private_names, keras_classes)
    assert not found, "non-public Keras/TF use outside tfformer/compat.py:\n" + "\n".join(found)


def test_keras_derived_classes_follow_bases_and_mixins():
    sources = ["import keras\nclass Mixin:\n    pass\nclass Opt(Mixin, keras.optimizers.Adam):\n    pass\n"
               "class Sub(Opt):\n    pass\nclass Lock:\n    pass\nclass Server(Lock):\n    pass\n",
               "import tensorflow as tf\nclass Mod(tf.Module):\n    pass\n"]
    assert keras_derived_classes(sources) == {"Mixin", "Opt", "Sub", "Mod"}


def test_self_rule_applies_inside_keras_classes_only(private_names):
    source = "class Lock:\n    def f(self):\n        return self._lock\n"
    assert public_api_violations(source, "x.py", private_names, keras_classes=frozenset()) == []
    assert public_api_violations(source, "x.py", private_names, keras_classes=frozenset({"Lock"}))
    assert public_api_violations(source, "x.py", private_names)  # unknown classes count as Keras-derived


def test_compat_is_the_one_exemption():
    """compat.py does reach private APIs (else the exemption would hide nothing and should go)."""
    source = (PACKAGE / "compat.py").read_text()
    assert public_api_violations(source, "compat.py")


def module_state_violations(source, filename="<string>"):
    """`["file:line: what"]` for module-level state that code may switch: `global` statements, and module-level
    `threading.local()` or `contextvars.ContextVar(...)` (per-thread switches that change what a layer builds
    depending on who traces it). Per-model state belongs on the model; values a call needs, in its arguments."""
    found = []
    tree = ast.parse(source, filename)
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found.append(f"{filename}:{node.lineno}: `global {', '.join(node.names)}`")
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if isinstance(value, ast.Call):
            name = _dotted(value.func) or ""
            if name.split(".")[-1] in ("local", "ContextVar"):
                found.append(f"{filename}:{node.lineno}: module-level `{name}()`")
    return found


@pytest.mark.parametrize("source", [
    "import threading\n_TRACING = threading.local()",
    "from threading import local\nSTATE = local()",
    "import contextvars\nMODE = contextvars.ContextVar('mode', default=None)",
    "_SWITCH = False\ndef switch():\n    global _SWITCH\n    _SWITCH = True",
])
def test_state_checker_catches_a_planted_switch(source):
    assert module_state_violations(source, "planted.py"), source


def test_state_checker_allows_state_on_objects():
    source = ("import threading\nSCORES = ('dot',)\nclass Client:\n    def __init__(self):\n"
              "        self._local = threading.local()\n")
    assert module_state_violations(source, "clean.py") == []


def test_tfformer_keeps_no_module_level_switches():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += module_state_violations(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    assert not found, "module-level state that changes what a layer or model builds:\n" + "\n".join(found)
