"""The `tfformer` command's entry point. It lives outside the package so that it runs before anything imports
TensorFlow (importing `tfformer` does): TensorFlow reads its C++ log level once, when it loads, and writes lines
no level hides while it does (`import_tensorflow_quietly`). Then it runs `tfformer.cli.main`, where the commands
are."""

import atexit
import contextlib
import gc
import importlib
import os
import re
import sys
import tempfile


def quiet_tensorflow_logs(environ=os.environ, nvidia_driver="/proc/driver/nvidia/version"):
    """TensorFlow's C++ log threshold for this command, unless the user set `TF_CPP_MIN_LOG_LEVEL`: no warnings (2),
    and on a machine without NVIDIA's driver no C++ error lines either (3). There the full `tensorflow` wheel logs
    "failed call to cuInit" as an error at start-up (tensorflow#37689), which is no error on a CPU machine. Every
    error that stops an op still reaches the user as a Python exception."""
    if "TF_CPP_MIN_LOG_LEVEL" not in environ:
        environ["TF_CPP_MIN_LOG_LEVEL"] = "2" if os.path.exists(nvidia_driver) else "3"


# What each command sets `TF_ENABLE_ONEDNN_OPTS` to unless the user set it (`tensorflow_environment`).
ONEDNN = {"export": "0", "transcribe": "1"}


def tensorflow_environment(argv, environ=os.environ):
    """oneDNN (`TF_ENABLE_ONEDNN_OPTS`) for the command in `argv`, as `ONEDNN` says, unless the user set it.

    - `tfformer export` runs TensorFlow without oneDNN: with it, TensorFlow's CPU allocator is a pool that never
      gives memory back, so a model the export has dropped would stay resident under the converter's peak
      (`tfformer.export.litertlm`). Measured for `tfformer export smollm2-135m-instruct --format litertlm`, Intel
      Xeon model 207: 2,965 MB peak with oneDNN, 2,319 without, before the export dropped the model. The export
      computes little in TensorFlow; that bundle was the same, byte for byte but for its timestamp and uuid.
    - `tfformer transcribe` runs it with oneDNN, which TensorFlow turns on by itself only on CPUs with AVX-512 VNNI
      or BF16 or AMX. On an AMD EPYC Zen 3 (AVX2, no AVX-512), Whisper tiny.en's encoder took 0.35-0.37 s a
      window in TensorFlow's graph runtime with oneDNN against 0.41-0.46 without, and the 186-s recording of the
      `asr` benchmark 5.7-6.3 s against 6.8-9.1 (alternating processes), with the same segments.
    """
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    if command in ONEDNN and "TF_ENABLE_ONEDNN_OPTS" not in environ:
        environ["TF_ENABLE_ONEDNN_OPTS"] = ONEDNN[command]


# What the full `tensorflow` wheel writes to stderr as it loads, before any log level applies (absl writes every
# line until it is initialized), twice: on a machine without CUDA four lines before a command's first own line, and
# two more with oneDNN on (`tfformer transcribe`, or any command on a CPU with AVX-512 VNNI or BF16 or AMX), whose
# info line says how to turn it off.
LOAD_NOISE = re.compile(rb"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR\n"
                        rb"|I\d{4} [\d:.]+ +\d+ cudart_stub\.cc:\d+\] Could not find cuda drivers on your machine, GPU "
                        rb"will not be used\.\n"
                        rb"|I\d{4} [\d:.]+ +\d+ port\.cc:\d+\] oneDNN custom operations are on\. [^\n]*"
                        rb"`TF_ENABLE_ONEDNN_OPTS=0`\.\n")


def without_load_noise(data):
    """`data` (bytes written to stderr) without the whole lines `LOAD_NOISE` matches."""
    return b"".join(line for line in data.splitlines(keepends=True) if not LOAD_NOISE.fullmatch(line))


def import_tensorflow_quietly(environ=os.environ):
    """Imports TensorFlow with the process's stderr (file descriptor 2) captured, then writes back all of it but the
    `LOAD_NOISE` lines; unless the user asked for TensorFlow's info lines (`TF_CPP_MIN_LOG_LEVEL` unset or 0).
    What else TensorFlow writes while it loads, an error included, reaches stderr, in order, once it has loaded
    or failed to. Without a usable stderr (fd 2 closed, as a daemon's may be) there is nothing to filter, as in
    `tfformer.edge.compiled`'s `_runtime_log_dropped`, which this command cannot import before TensorFlow."""
    saved = None
    if environ.get("TF_CPP_MIN_LOG_LEVEL", "0") != "0" and sys.stderr is not None:
        sys.stderr.flush()
        with contextlib.suppress(OSError):
            saved = os.dup(2)
    if saved is None:
        importlib.import_module("tensorflow")
        return
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            importlib.import_module("tensorflow")
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            sys.stderr.buffer.write(without_load_noise(captured.read()))
            sys.stderr.flush()


def collect_once_at_exit():
    """Makes this process's exit one collection of its cyclic garbage, then `gc.freeze()`, after the exit handlers
    registered after this call (they run last in, first out: `main` calls it first). The interpreter's shutdown
    collects several times more as it clears the modules, each time walking every object TensorFlow and Keras hold
    (about 330,000 after `import tensorflow, keras`); frozen, they are skipped. Garbage left at exit is still
    collected, its finalizers run; a cycle still alive at exit is not collected again and its memory goes back
    with the process, as Python allows (it does not promise `__del__` at exit). Measured on an AMD EPYC Zen 3:
    `import tensorflow, keras` and exit 3.3-3.9 s against 4.0-4.4 s (6 processes each, alternating); a pytest
    process exits 0.1 s after its last exit handler against 1.0 s."""

    def collect_then_freeze():
        gc.collect()
        gc.freeze()

    atexit.register(collect_then_freeze)


def main(argv=None):
    collect_once_at_exit()
    quiet_tensorflow_logs()
    tensorflow_environment(sys.argv[1:] if argv is None else argv)
    import_tensorflow_quietly()
    from tfformer import cli

    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
