"""check_layer(): the same battery for every layer (keras-hub's run_layer_test, smaller)."""

import contextlib
import fcntl
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap

import keras
import numpy as np
import pytest


def _inputs_for(call_args):
    return {
        name: keras.Input(shape=value.shape[1:], dtype=str(value.dtype), name=name)
        for name, value in call_args.items()
    }


def check_layer(cls, init_kwargs, call_args, call_kwargs=None, expected_output_shape=None, fit=True, mixed=True):
    """Config round trip, symbolic + eager calls, weight-copy equality, .keras save/load, one fit step, mixed precision.

    `call_args` is an ordered dict of numpy arrays passed positionally.
    """
    call_kwargs = call_kwargs or {}
    layer = cls(**init_kwargs)

    # 1. get_config returns every __init__ argument under the same name, and survives JSON.
    config = layer.get_config()
    for cls_ in type(layer).__mro__:
        if cls_ is keras.layers.Layer:
            break
        for name, param in inspect.signature(cls_.__init__).parameters.items():
            if name not in ("self", "kwargs") and param.kind is not param.VAR_KEYWORD:
                assert name in config, f"{cls.__name__}.get_config() is missing __init__ argument {name!r}"
    clone = cls.from_config(json.loads(json.dumps(config)))
    assert clone.get_config() == config

    # 2. Eager call, output shape.
    args = list(call_args.values())
    outputs = layer(*args, **call_kwargs)
    if expected_output_shape is not None:
        assert tuple(outputs.shape) == tuple(expected_output_shape)
    assert np.all(np.isfinite(keras.ops.convert_to_numpy(outputs)))

    # 3. Symbolic call in a functional model (batch dim free).
    symbolic_inputs = _inputs_for(call_args)
    sym_layer = cls.from_config(config)
    sym_out = sym_layer(*symbolic_inputs.values(), **call_kwargs)
    assert tuple(sym_out.shape[1:]) == tuple(outputs.shape[1:])
    model = keras.Model(symbolic_inputs, sym_out)

    # 4. Same weights -> same outputs.
    sym_layer.set_weights(layer.get_weights())
    np.testing.assert_allclose(model(call_args), outputs, atol=1e-6)

    # 5. .keras save/load with safe_mode=True gives identical outputs.
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "layer.keras")
        model.save(path)
        reloaded = keras.models.load_model(path, safe_mode=True)
    np.testing.assert_allclose(reloaded(call_args), outputs, atol=1e-6)

    # 6. One fit step moves the weights.
    if fit and layer.trainable_weights:
        before = [w.copy() for w in model.get_weights()]
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        target = np.zeros(outputs.shape, dtype="float32")
        model.fit(call_args, target, batch_size=len(args[0]), epochs=1, verbose=0)
        assert any(not np.allclose(a, b) for a, b in zip(before, model.get_weights()))

    # 7. Mixed precision: computes in the low dtype, stays finite.
    if mixed:
        for policy in ("mixed_bfloat16", "mixed_float16"):
            low = cls(**init_kwargs, dtype=policy)
            low_out = low(*args, **call_kwargs)
            assert np.all(np.isfinite(keras.ops.convert_to_numpy(keras.ops.cast(low_out, "float32"))))
    return layer, outputs


def spread(model, seed=0, scale=0.5):
    """Random kernels large enough that greedy decoding of an untrained model is not one repeated token.

    Only kernels (ndim >= 2) are redrawn: random biases and LayerNorm offsets would dominate the logits.
    """
    rng = np.random.default_rng(seed)
    model.set_weights([rng.normal(size=w.shape).astype("float32") * scale if w.ndim >= 2 else w
                       for w in model.get_weights()])
    return model


def matmuls_fed_by(op, fn, *args):
    """Matmuls in `fn`'s traced graph with an operand made by an `op` node: "Transpose" for the "rows" layout of
    `generation.plan.DecodePlan` (`x @ transpose(rows)`), "Identity" for its "halves"."""
    nodes = fn.get_concrete_function(*args).graph.as_graph_def().node
    ops_by_name = {n.name: n.op for n in nodes}
    return sum(n.op in ("MatMul", "BatchMatMulV2", "BatchMatMulV3")
               and any(ops_by_name.get(i.split(":")[0].lstrip("^")) == op for i in n.input) for n in nodes)


def count_ops(op, fn, *args):
    """How many `op` nodes (e.g. "Softmax") `fn`'s graph traced on `args` holds (`fn` a `tf.function`)."""
    return sum(n.op == op for n in fn.get_concrete_function(*args).graph.as_graph_def().node)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
# The modules whose tests peak at several GB (a 135M-parameter conversion, Whisper's exports, benchmark runs that
# load pretrained models) hold tests/conftest.py's `one_at_a_time` lock for the whole module, so two of them never
# add up on the two xdist workers. The Makefile's pretrained run passes `--dist loadfile`, which keeps a module on
# one worker: with `--dist load` a module could be split over both, and its module fixtures (the 135M conversion)
# would run twice, at once. (`--dist loadgroup` does not group with pytest 9: xdist 3.8 renames `item._nodeid`,
# which pytest 9 no longer reads.)
# A module whose peak is one step (a subprocess that converts the 135M model) holds the same lock for that step
# only, with `alone(tmp_path_factory)`.
# tests/conftest.py's scheduler hands all these modules to one worker as a single unit.
ONE_AT_A_TIME = pytest.mark.usefixtures("one_at_a_time")
ONE_AT_A_TIME_LOCK = "one-at-a-time.lock"


def takes_the_one_at_a_time_lock(path):
    """Whether the test module at `path` is marked `ONE_AT_A_TIME` or takes its lock for a step (`alone`)."""
    with open(path, encoding="utf-8") as f:
        return re.search(r"^pytestmark = .*ONE_AT_A_TIME|\balone\(tmp_path_factory\)", f.read(), re.M) is not None


def session_directory(tmp_path_factory):
    """The session's temporary directory that all its xdist workers share (.../pytest-N/, above popen-gwK/), or
    the session's own without xdist."""
    root = tmp_path_factory.getbasetemp()
    return root.parent if os.environ.get("PYTEST_XDIST_WORKER") is not None else root


@contextlib.contextmanager
def session_lock(tmp_path_factory, name):
    """An exclusive lock on `name` in `session_directory`, held for the `with` block: the session's workers take
    turns (a worker that reaches it while the other holds it waits)."""
    with open(session_directory(tmp_path_factory) / name, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def alone(tmp_path_factory):
    """`ONE_AT_A_TIME`'s lock for a `with` block: on xdist workers the other worker's several-GB module or step never
    runs beside it. Without xdist the lock is the session's own and nobody else takes it."""
    return session_lock(tmp_path_factory, ONE_AT_A_TIME_LOCK)


def run_in_fresh_interpreter(code, timeout=300):
    """The JSON on the last line `code` (dedented) prints, run in a new interpreter from the repository's root:
    TensorFlow's runtime not started yet, no GPU, `TF_NUM_INTRAOP_THREADS` unset."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    env.pop("TF_NUM_INTRAOP_THREADS", None)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                         timeout=timeout, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


FRESH_PROCESS = os.path.join(ROOT, "tests", "export", "fresh_process.py")


def saved_model_in_fresh_process(path, request, tmp_path):
    """The outputs `{"signature/key": array}` of SavedModel `path` for `request` (`fresh_process.py`'s JSON), run
    in a new interpreter that has only tensorflow and tensorflow_text, as TF Serving loads it."""
    (tmp_path / "request.json").write_text(json.dumps(request))
    out = tmp_path / "out.npz"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, FRESH_PROCESS, path, str(tmp_path / "request.json"), str(out)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(np.load(out, allow_pickle=True))
