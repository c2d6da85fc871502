import functools
import gc
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import pytest

import tfformer_command
from tests.harness import alone, takes_the_one_at_a_time_lock

tfformer_command.collect_once_at_exit()  # pytest's processes (xdist's workers too) exit as `tfformer` does

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


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` with every module that takes the `ONE_AT_A_TIME` lock in one unit of work: one worker runs
    them one after another while the other worker runs the rest. Handed out one by one, two of them could reach the
    two workers at once, and one worker then waited for the other's lock: the asr smoke's first test waited 39 s
    (Intel Xeon model 207, the pretrained run). Other `--dist` modes are xdist's own."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    locks = functools.cache(lambda module: takes_the_one_at_a_time_lock(config.rootpath / module))

    class OneAtATimeTogether(LoadFileScheduling):
        def _split_scope(self, nodeid):  # LoadFileScheduling's own override point: a test's unit of work
            module = super()._split_scope(nodeid)
            return "modules taking the one-at-a-time lock" if locks(module) else module

    return OneAtATimeTogether(config, log)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def pytest_configure(config):
    # The suite's memory peak, measured once, in the main process (not in each xdist worker).
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        from tests.memory_report import MemoryReport

        config.pluginmanager.register(MemoryReport(), "tfformer-memory-report")
