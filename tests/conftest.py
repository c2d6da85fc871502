import gc
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import pytest

from tests.harness import alone

# The Whisper fixtures (manifest, asr, waveforms); pytest takes `pytest_plugins` only in the root conftest.
pytest_plugins = ["tests.speech"]


@pytest.fixture(autouse=True)
def _seed_and_policy():
    keras.utils.set_random_seed(1234)
    keras.config.set_dtype_policy("float32")
    yield
    keras.config.set_dtype_policy("float32")


@pytest.fixture(autouse=True, scope="module")
def _free_after_module():
    """A module's models, once its fixtures are torn down, are freed before the next module builds its own: Keras
    layers hold reference cycles, which only the cycle collector frees."""
    yield
    gc.collect()


@pytest.fixture(scope="module")
def one_at_a_time(tmp_path_factory):
    """Held for a whole module (tests/harness.py's `ONE_AT_A_TIME`): on xdist workers, an exclusive lock on a file
    in the session's temporary directory, which all its workers share, so two modules that peak at several GB never
    run at once (a worker that reaches one while the other worker holds the lock waits). Without xdist nobody else
    takes it."""
    with alone(tmp_path_factory):
        yield


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def pytest_configure(config):
    # The suite's memory peak, measured once, in the main process (not in each xdist worker).
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        from tests.memory_report import MemoryReport

        config.pluginmanager.register(MemoryReport(), "tfformer-memory-report")
