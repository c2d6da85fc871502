import collections

import pytest

from tests.benchmarks.smoke import PEERS, peers_dir

Peers = collections.namedtuple("Peers", "kind path")


@pytest.fixture(params=PEERS)
def peers(request, tmp_path):
    """Each smoke test runs twice: with no peers (their rows skipped, and said so) and with stand-ins (their rows
    present, every ratio and goal computed from them)."""
    return Peers(request.param, peers_dir(request.param, tmp_path / "peers"))
