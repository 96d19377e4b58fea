"""The dataset index a coordinator keeps in its data dir never vouches for a changed file (real LMDB ledger)."""

from __future__ import annotations

import json
import os

import pytest

from common.dataset import Dataset
from common.errors import ConfigError
from coordinator.ledger import Ledger


def open_like_serve(dataset, data_dir):
    """What ``coordinator serve`` does at start: the dataset with its index, then the ledger's check."""
    ds = Dataset(dataset, index_path=data_dir / "dataset.index")
    ledger = Ledger(data_dir, sync=False)
    try:
        snapshot = ledger.open_run(len(ds), ds.fingerprint)
    finally:
        ledger.close()
        ds.close()
    return ds, snapshot


def test_a_file_changed_under_a_data_dir_is_refused_even_with_its_size_and_mtime_kept(tmp_path):
    dataset = tmp_path / "data.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "label": i + 1}) + "\n" for i in range(500)))
    data_dir = tmp_path / "coordinator"
    first, snapshot = open_like_serve(dataset, data_dir)
    assert not first.index_loaded and snapshot.generation == 1
    again, snapshot = open_like_serve(dataset, data_dir)
    assert again.index_loaded and snapshot.generation == 2 and again.fingerprint == first.fingerprint

    # One label edited in place: same size, mtime put back.
    st = os.stat(dataset)
    text = dataset.read_text().replace('"What is 7 + 1?", "label": 8', '"What is 7 + 1?", "label": 9')
    dataset.write_text(text)
    os.utime(dataset, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(dataset).st_size == st.st_size
    with pytest.raises(ConfigError, match="another dataset"):
        open_like_serve(dataset, data_dir)
