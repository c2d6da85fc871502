"""A .tflite file's signatures run by LiteRT's `CompiledModel`, each input and output a `TensorBuffer` of its own that
stays bound between runs: a decode loop writes only its token and index and reads only its logits, and an output
bound to the input of the same name (a cache) is updated in place, with no copy through the host."""

import contextlib
import os
import tempfile

import numpy as np


@contextlib.contextmanager
def _native_log_held():
    """Holds what native code writes to stderr (LiteRT's INFO lines about the NPU and GPU accelerators it looks for
    and cannot find on a CPU machine); writes it out only if the block raises."""
    with tempfile.TemporaryFile() as held:
        saved = os.dup(2)
        os.dup2(held.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved, 2)
            held.seek(0)
            os.write(2, held.read())
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)


_ENVIRONMENT = []  # the LiteRT environment every model shares, made once (its accelerators registered once)


def compiled_model(path, num_threads):
    """`path` as a CPU `ai_edge_litert.compiled_model.CompiledModel` on `num_threads` threads (XNNPACK)."""
    import ai_edge_litert
    from ai_edge_litert.compiled_model import CompiledModel
    from ai_edge_litert.cpu_options import CpuOptions
    from ai_edge_litert.environment import Environment, EnvironmentOptions
    from ai_edge_litert.options import Options

    with _native_log_held():
        if not _ENVIRONMENT:
            runtime = os.path.dirname(os.path.abspath(ai_edge_litert.__file__))
            _ENVIRONMENT.append(Environment.create(options=EnvironmentOptions(runtime_path=runtime)))
        return CompiledModel.from_file(path, environment=_ENVIRONMENT[0],
                                       options=Options(cpu_options=CpuOptions(num_threads=num_threads)))


class Signature:
    """One signature of a `CompiledModel` with its buffers. `inputs`: buffers of other signatures to read as they
    are (`{name: TensorBuffer}`, e.g. an encoder's outputs as a decoder's inputs); the others are made here. An
    output named like an input is that input's buffer: the signature updates it in place.

    Example:
    ```python
    step = Signature(model, "decode_step")
    step(token_ids=np.array([[5]], np.int32), index=np.array(0, np.int32))  # the cache stays in its buffer
    logits = step.read("logits")
    ```
    """

    def __init__(self, model, name, inputs=None):
        self.model, self.name = model, name
        inputs = inputs or {}
        self.specs = {}  # name -> (shape, dtype)
        self.inputs, self.outputs = {}, {}
        for key, detail in model.get_input_tensor_details(name).items():
            self.specs[key] = (tuple(int(d) for d in detail["shape"]), np.dtype(detail["dtype"]))
            self.inputs[key] = inputs[key] if key in inputs else model.create_input_buffer_by_name(name, key)
        for key, detail in model.get_output_tensor_details(name).items():
            spec = (tuple(int(d) for d in detail["shape"]), np.dtype(detail["dtype"]))
            if key in self.inputs:
                if self.specs[key] != spec:
                    raise ValueError(f"Signature {name!r}: output {key!r} {spec} differs from its input "
                                     f"{self.specs[key]}")
                self.outputs[key] = self.inputs[key]
            else:
                self.specs[key] = spec
                self.outputs[key] = model.create_output_buffer_by_name(name, key)
        with _native_log_held():  # the first write makes the runtime's buffer context, logging INFO lines
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
