import pytest

from harness.cluster import Cluster, client_threads


@pytest.fixture
def make_cluster(tmp_path):
    """Factory for real loopback clusters. At teardown every process is ended, and the test fails if
    anything outlived it: a process, an engine, a bound coordinator port, or a client thread."""
    clusters = []
    threads_before = client_threads()

    def make(**kwargs) -> Cluster:
        c = Cluster(tmp_path / f"cluster{len(clusters)}", **kwargs)
        clusters.append(c)
        return c

    yield make
    leaks = []
    for c in clusters:
        leaks += c.stop_all()
    leaked_threads = client_threads() - threads_before
    if leaked_threads:
        leaks.append(f"{len(leaked_threads)} RolloutClient loop thread(s) left running (a client not closed)")
    if leaks:
        pytest.fail("the test left things behind:\n  " + "\n  ".join(leaks))
