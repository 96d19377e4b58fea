import pytest

from harness.cluster import Cluster


@pytest.fixture
def make_cluster(tmp_path):
    """Factory for real loopback clusters; every process is ended at teardown."""
    clusters = []

    def make(**kwargs) -> Cluster:
        c = Cluster(tmp_path / f"cluster{len(clusters)}", **kwargs)
        clusters.append(c)
        return c

    yield make
    for c in clusters:
        c.stop_all()
