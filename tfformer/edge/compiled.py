"""A .tflite file's signatures run by LiteRT's `CompiledModel`, each input and output a `TensorBuffer` of its own that
stays bound between runs: a decode loop writes only its token and index and reads only its logits, and an output
bound to the input of the same name (a cache) is read and written in the runtime's buffer, never copied through the
host."""

import contextlib
import os
import sys
import tempfile
import threading

import numpy as np

# What LiteRT logs to stderr while it makes its environment and a model on a CPU machine: the NPU and GPU
# accelerators and the vendors' compiler plugins it looks for and does not find, and what it registers.
_RUNTIME_LOG = ("environment.cc", "npu_registry.cc", "gpu_registry.cc", "accelerator_registry.cc", "cpu_registry.cc",
                "compiler_plugin.cc", "compiled_model.cc", "XNNPACK delegate for CPU", "ai_edge_litert/vendors/")
_STDERR_LOCK = threading.Lock()  # fd 2 is the process's: one holder at a time


@contextlib.contextmanager
def _runtime_log_dropped():
    """Holds what native code writes to stderr inside the block; then writes it back but for LiteRT's lines about its
    accelerators and plugins (`_RUNTIME_LOG`), or all of it if the block raises. Without a usable fd 2, does
    nothing."""
    with _STDERR_LOCK, tempfile.TemporaryFile() as held:
        sys.stderr.flush()
        try:
            saved = os.dup(2)
        except OSError:
            yield
            return
        failed = False
        try:
            os.dup2(held.fileno(), 2)
            yield
        except BaseException:
            failed = True
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            lines = held.read().decode("utf-8", "replace").splitlines(keepends=True)
            kept = "".join(line for line in lines if failed or not any(name in line for name in _RUNTIME_LOG))
            if kept:
                sys.stderr.write(kept)
                sys.stderr.flush()


_ENVIRONMENT = []  # the LiteRT environment every model shares, made once (its accelerators registered once)


def compiled_model(path, num_threads):
    """`path` as a CPU `ai_edge_litert.compiled_model.CompiledModel` on `num_threads` threads (XNNPACK). A missing
    `path` is a FileNotFoundError and a file LiteRT cannot load a ValueError, both naming it (LiteRT's own error
    names neither)."""
    if not isinstance(path, (str, os.PathLike)) or not os.path.isfile(path):
        raise FileNotFoundError(f"`path` must be a .tflite file. Received: path={path!r}")
    import ai_edge_litert
    from ai_edge_litert.compiled_model import CompiledModel
    from ai_edge_litert.cpu_options import CpuOptions
    from ai_edge_litert.environment import Environment, EnvironmentOptions
    from ai_edge_litert.options import Options

    with _runtime_log_dropped():
        if not _ENVIRONMENT:
            runtime = os.path.dirname(os.path.abspath(ai_edge_litert.__file__))
            _ENVIRONMENT.append(Environment.create(options=EnvironmentOptions(runtime_path=runtime)))
        try:
            return CompiledModel.from_file(os.fspath(path), environment=_ENVIRONMENT[0],
                                           options=Options(cpu_options=CpuOptions(num_threads=num_threads)))
        except RuntimeError as error:
            raise ValueError(f"`path` {os.fspath(path)!r} is not a TFLite file LiteRT can load: {error}") from None


class Signature:
    """One signature of a `CompiledModel` with its buffers. `inputs`: buffers of other signatures to read as they
    are (`{name: TensorBuffer}`, e.g. an encoder's outputs as a decoder's inputs); the others are made here. An
    output named like an input is that input's buffer: the runtime reads and writes it there (a decoder's cache,
    which its step writes in place), and the host never copies it.

    Example:
    ```python
    step = Signature(model, "decode_step")
    step(token_ids=np.array([[5]], np.int32), index=np.array(0, np.int32))  # the caches stay in their buffers
    logits = step.read("logits")
    ```
    """

    def __init__(self, model, name, inputs=None):
        self.model, self.name = model, name
        inputs = inputs or {}
        self.specs = {}  # name -> (shape, dtype)
        self.inputs, self.outputs = {}, {}
        for key, detail in model.get_input_tensor_details(name).items():
            self.specs[key] = _spec(detail)
            if key in inputs and _spec(inputs[key].get_tensor_details()) != self.specs[key]:
                raise ValueError(f"Signature {name!r}: the buffer given for input {key!r} holds "
                                 f"{_spec(inputs[key].get_tensor_details())}, not {self.specs[key]}")
            self.inputs[key] = inputs[key] if key in inputs else model.create_input_buffer_by_name(name, key)
        for key, detail in model.get_output_tensor_details(name).items():
            spec = _spec(detail)
            if key in self.inputs:
                if self.specs[key] != spec:
                    raise ValueError(f"Signature {name!r}: output {key!r} {spec} differs from its input "
                                     f"{self.specs[key]}")
                self.outputs[key] = self.inputs[key]
            else:
                self.specs[key] = spec
                self.outputs[key] = model.create_output_buffer_by_name(name, key)
        with _runtime_log_dropped():  # the first write makes the runtime's buffer context, logging INFO lines
            for key in set(self.inputs) - set(inputs):
                self.write(key, np.zeros(*self.specs[key]))

    def bind(self, key, buffer):
        """Reads and updates `buffer` as the input (and the output of that name, if any) `key`."""
        self.inputs[key] = buffer
        if key in self.outputs:
            self.outputs[key] = buffer

    def new_buffer(self, key):
        """A new buffer for input `key`, e.g. a second cache for another beam."""
        return self.model.create_input_buffer_by_name(self.name, key)

    def write(self, key, array, buffer=None):
        if key not in self.inputs:
            raise ValueError(f"Signature {self.name!r} has no input {key!r}; its inputs: {sorted(self.inputs)}")
        shape, dtype = self.specs[key]
        array = np.asarray(array, dtype)
        if array.shape != shape:
            raise ValueError(f"Signature {self.name!r}: {key!r} must have shape {shape}. Received: {array.shape}")
        (self.inputs[key] if buffer is None else buffer).write(array)

    def read(self, key, buffer=None):
        shape, dtype = self.specs[key]
        if buffer is None:
            buffer = self.outputs[key] if key in self.outputs else self.inputs[key]
        return buffer.read(int(np.prod(shape)), dtype).reshape(shape)

    def __call__(self, **arrays):
        """Writes `arrays` into their inputs, then runs the signature."""
        for key, array in arrays.items():
            self.write(key, array)
        self.model.run_by_name(self.name, self.inputs, self.outputs)


def zero_caches(step, caches):
    """Writes zeros into `caches` (`{name: buffer}`: buffers of `step`'s cache inputs, each of one shape), the
    empty caches a decoder file's `decode_step` starts from."""
    zeros = {}  # shape -> one array of zeros, written into every buffer of that shape
    for name, buffer in caches.items():
        shape = step.specs[name][0]
        if shape not in zeros:
            zeros[shape] = np.zeros(shape, np.float32)
        step.write(name, zeros[shape], buffer)


def next_logits(step, token, index):
    """Runs a decoder file's `decode_step` (a `Signature`, its caches bound) on `token` at cache position `index`;
    the logits `(V,)` of the token after it."""
    step(token_ids=np.array([[token]], np.int32), index=np.array(index, np.int32))
    return step.read("logits")[0, -1]


def constants(model, name):
    """The outputs `{name: array}` of signature `name`, which takes no inputs (constants, such as a file's decoding
    options), run once. The runtime logs an INFO line for each constant output it binds; they are dropped."""
    signature = Signature(model, name)
    with _runtime_log_dropped():
        signature()
    return {key: signature.read(key) for key in signature.outputs}


def _spec(detail):
    """`(shape, dtype)` of a tensor's or buffer's details (`{"shape": ..., "dtype": ...}`)."""
    return tuple(int(d) for d in detail["shape"]), np.dtype(detail["dtype"])
