"""The `tfformer` command's entry point. It lives outside the package so that it runs before anything imports
TensorFlow (importing `tfformer` does): TensorFlow reads its C++ log level once, when it loads. Then it runs
`tfformer.cli.main`, where the commands are."""

import os
import sys


def quiet_tensorflow_logs(environ=os.environ, nvidia_driver="/proc/driver/nvidia/version"):
    """TensorFlow's C++ log threshold for this command, unless the user set `TF_CPP_MIN_LOG_LEVEL`: no warnings (2),
    and on a machine without NVIDIA's driver no C++ error lines either (3). There the full `tensorflow` wheel logs
    "failed call to cuInit" as an error at start-up (tensorflow#37689), which is no error on a CPU machine. Every
    error that stops an op still reaches the user as a Python exception."""
    if "TF_CPP_MIN_LOG_LEVEL" not in environ:
        environ["TF_CPP_MIN_LOG_LEVEL"] = "2" if os.path.exists(nvidia_driver) else "3"


def tensorflow_environment(argv, environ=os.environ):
    """`tfformer export` runs TensorFlow without oneDNN (`TF_ENABLE_ONEDNN_OPTS=0`) unless the user set it: with
    oneDNN, TensorFlow's CPU allocator is a pool that never gives memory back, so a model the export has dropped
    would stay resident under the converter's peak (`tfformer.export.litertlm`). Measured for `tfformer export
    smollm2-135m-instruct --format litertlm`, Intel Xeon model 207: 2,965 MB peak with oneDNN, 2,319 without,
    before the export dropped the model. The export computes little in TensorFlow; that bundle was the same, byte
    for byte but for its timestamp and uuid."""
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    if command == "export" and "TF_ENABLE_ONEDNN_OPTS" not in environ:
        environ["TF_ENABLE_ONEDNN_OPTS"] = "0"


def main(argv=None):
    quiet_tensorflow_logs()
    tensorflow_environment(sys.argv[1:] if argv is None else argv)
    from tfformer import cli

    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
