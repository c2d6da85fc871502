import collections

import pytest

from tests.benchmarks.smoke import PEERS, peers_dir

Peers = collections.namedtuple("Peers", "kind path")


@pytest.fixture(params=PEERS)
def peers(request, tmp_path):
    """Each smoke test runs with no peers (their rows skipped, and said so), with stand-ins (their rows present,
    every ratio and goal computed from them), and, where `make peers` made `.venv-peers` (never in CI), with the
    real ones."""
    from benchmarks import peers as installed

    if request.param == "installed" and installed.binary("python", installed.DEFAULT_DIR) is None:
        pytest.skip(f"no {installed.DEFAULT_DIR}: `make peers` installs the real peers")
    return Peers(request.param, peers_dir(request.param, tmp_path / "peers"))
