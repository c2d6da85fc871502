"""Where the benchmarks find their peers, inside the clone: `.venv-peers/`, which `make peers` builds.

`make peers` (and so `make bench`) creates `.venv-peers/` at the repository's root from `benchmarks/peers.txt`
(torch CPU, transformers, sentence-transformers, accelerate, gguf, ctranslate2, faster-whisper; cmake and ninja),
then builds llama.cpp's `llama-bench` and `llama-perplexity` from the vendored sources of the `llama-cpp-python`
source distribution (`LLAMA_CPP_PYTHON`) into `.venv-peers/bin/`:

    python -m benchmarks.peers build-llama-cpp .venv-peers

Nothing outside the clone is read. `TFFORMER_PEERS=DIR` names another directory of the same layout (`DIR/bin/python`,
`DIR/bin/llama-bench`): the smoke tests give an empty one (no peers) or one of stand-ins. This module imports only
the standard library: the peers' own interpreter runs it to build llama.cpp.
"""

import glob
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = "TFFORMER_PEERS"
DEFAULT_DIR = os.path.join(ROOT, ".venv-peers")
LLAMA_CPP_PYTHON = "0.3.36"  # the sdist whose vendor/llama.cpp is built
LLAMA_TOOLS = ("llama-bench", "llama-perplexity")
HOW = "`make peers` installs it in .venv-peers"


def directory():
    """The peers' directory: `$TFFORMER_PEERS`, else `.venv-peers` in this clone."""
    return os.environ.get(ENV) or DEFAULT_DIR


def python():
    """The peers' interpreter (`<directory>/bin/python`), or None when there is none."""
    return binary("python")


def binary(name, peers_dir=None):
    """The executable `name` (e.g. "llama-bench") in `<peers_dir or directory()>/bin`, or None when there is none."""
    path = os.path.join(peers_dir or directory(), "bin", name)
    return path if os.path.isfile(path) and os.access(path, os.X_OK) else None


def describe(name):
    """How a skip names the peer that is missing: its path and the command that makes it."""
    return f"{os.path.relpath(os.path.join(directory(), 'bin', name), os.getcwd())} ({HOW})"


# On the Intel Xeon (AMX) KVM guests here, a native build's llama-bench died of SIGILL on the SmolLM2 Q4_1 GGUF, at a
# `tileloadd` in ggml's AMX kernel (`tinygemm_kernel_amx<block_q8_1, block_q4_1>`), although the kernel granted the
# process AMX state (arch_prctl ARCH_REQ_XCOMP_PERM). gcc's explicit -mno-* flags win over -march=native's, so the
# build keeps AVX-512 and VNNI and leaves AMX out; CPUs without AMX (AMD Zen) build as before, and other
# architectures (whose compilers have no such flags) get no extra flags. On a host where AMX works, llama.cpp's
# prefill could be faster with it than what the benchmarks record.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" if platform.machine().lower() in ("x86_64", "amd64") else ""


def build_llama_cpp(prefix, jobs=None):
    """Build `LLAMA_TOOLS` from the `llama-cpp-python==LLAMA_CPP_PYTHON` sdist into `<prefix>/bin/`, with the cmake
    and ninja of `prefix` (from PyPI). Native CPU kernels (`GGML_NATIVE`), on x86 without the Intel AMX ones
    (`NO_AMX`), no network code (`LLAMA_CURL=OFF`)."""
    prefix = os.path.abspath(prefix)
    bin_dir = os.path.join(prefix, "bin")
    cmake, ninja = os.path.join(bin_dir, "cmake"), os.path.join(bin_dir, "ninja")
    for tool in (cmake, ninja):
        if not os.access(tool, os.X_OK):
            raise SystemExit(f"{tool} is missing: install benchmarks/peers.txt into {prefix} first")
    work = os.path.join(prefix, "build")
    os.makedirs(work, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=work) as download:
        subprocess.run([os.path.join(bin_dir, "python"), "-m", "pip", "download", "--quiet", "--no-deps",
                        "--no-binary", ":all:", "-d", download, f"llama-cpp-python=={LLAMA_CPP_PYTHON}"], check=True)
        (archive,) = glob.glob(os.path.join(download, "*.tar.gz"))
        source = os.path.join(work, f"llama_cpp_python-{LLAMA_CPP_PYTHON}")
        shutil.rmtree(source, ignore_errors=True)
        with tarfile.open(archive) as tar:
            tar.extractall(work, filter="data")
    llama_cpp = os.path.join(source, "vendor", "llama.cpp")
    build = os.path.join(work, "llama.cpp")
    subprocess.run([cmake, "-S", llama_cpp, "-B", build, "-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}",
                    "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
                    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF",
                    *([f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"] if NO_AMX else [])], check=True)
    subprocess.run([cmake, "--build", build, "--target", *LLAMA_TOOLS, "-j", str(jobs or os.cpu_count() or 1)],
                   check=True)
    for tool in LLAMA_TOOLS:
        shutil.copy2(os.path.join(build, "bin", tool), os.path.join(bin_dir, tool))
        print(f"built {os.path.join(bin_dir, tool)}")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "build-llama-cpp":
        raise SystemExit("usage: python -m benchmarks.peers build-llama-cpp PREFIX")
    build_llama_cpp(sys.argv[2])
