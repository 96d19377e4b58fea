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


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory) -> str:
    """A tiny random Llama model directory (agent.hf.model.make_model), made once per session."""
    pytest.importorskip("transformers")
    from transformers.utils import logging as transformers_logging

    from agent.hf.model import make_model

    transformers_logging.disable_progress_bar()
    path = tmp_path_factory.mktemp("hf") / "tiny"
    make_model(str(path), context_length=8192)
    return str(path)


HEAVY_FILES = {
    "tests/cluster/test_chaos.py",
    "tests/cluster/test_grpo_example.py",
    "tests/cluster/test_trl.py",
    "tests/cluster/test_hf_cluster.py",
    "tests/cluster/test_record_replay.py",
    "tests/cluster/test_netfault.py",
    "tests/cluster/test_catch_up.py",
    "tests/cluster/test_weight_failures.py",
    "tests/cluster/test_weights.py",
    "tests/integration/test_hf_engine.py",
    "tests/cluster/test_nccl_two_gpus.py",
    "tests/cluster/test_grpo_sharded.py",
    "tests/cluster/test_trl_processes.py",
    "tests/cluster/test_sharded_weights.py",
}
"""Files whose tests are marked ``heavy``: CPU-bound (models training, chaos) or bounded in seconds on a loaded
machine (silent partitions, weight updates under faults). ``-m "not heavy"`` leaves them out of a quick run."""


def pytest_collection_modifyitems(config, items):
    root = config.rootpath
    for item in items:
        if item.path.relative_to(root).as_posix() in HEAVY_FILES:
            item.add_marker(pytest.mark.heavy)
