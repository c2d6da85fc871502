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


def main(argv=None):
    quiet_tensorflow_logs()
    from tfformer import cli

    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
