"""The JSONL prompt dataset: validation, row access, fingerprint, shuffling (pure)."""

from __future__ import annotations

import hashlib
import json
from array import array

import pytest

from common import scan_workers
from common.dataset import _MAX_BLOCK_ROWS, Dataset, Row, ShuffledOrder, epoch_permutation
from common.errors import DatasetError


def write(tmp_path, text: str, name: str = "data.jsonl"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def jsonl(*rows) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def test_rows_prompts_labels_and_metadata(tmp_path):
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    path = write(
        tmp_path,
        jsonl(
            {"prompt": "What is 1+1?", "label": 2, "source": "gsm", "level": 1},
            {"prompt": chat, "label": {"answer": "4"}},
            {"prompt": "no label here"},
        ),
    )
    with Dataset(path) as ds:
        assert len(ds) == 3
        assert ds.path == str(path)
        assert ds.row(0) == Row(0, "What is 1+1?", 2, {"source": "gsm", "level": 1})
        assert ds.row(1) == Row(1, chat, {"answer": "4"}, {})
        assert ds.row(2).label is None
        # random access in any order, repeatedly
        assert ds.row(0).prompt == "What is 1+1?"
        with pytest.raises(IndexError):
            ds.row(3)


def test_custom_keys(tmp_path):
    path = write(tmp_path, jsonl({"question": "q?", "answer": "a", "id": 7}))
    ds = Dataset(path, input_key="question", label_key="answer")
    assert ds.row(0) == Row(0, "q?", "a", {"id": 7})
    ds.close()


def test_blank_lines_are_skipped_but_counted_in_line_numbers(tmp_path):
    text = "\n" + jsonl({"prompt": "a"}) + "   \n\n" + jsonl({"prompt": "b"}) + "\r\n" + '{"question": 1}\n'
    path = write(tmp_path, text)
    with pytest.raises(DatasetError) as info:
        Dataset(path)
    assert info.value.line == 7
    assert str(info.value).startswith(f"{path}:7: missing key 'prompt'")

    path = write(tmp_path, text.rsplit('{"question"', 1)[0] + "\n\n")
    ds = Dataset(path)
    assert len(ds) == 2
    assert [ds.row(i).prompt for i in range(2)] == ["a", "b"]


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"prompt": "a" "label": 1}', "invalid JSON: Expecting ',' delimiter at column 16"),
        ('{"prompt": "a",', "invalid JSON"),
        ('["prompt", "a"]', "row is a JSON array, expected an object"),
        ('"just a string"', "row is a JSON string, expected an object"),
        ('{"question": "q", "answer": 1}', "missing key 'prompt' (keys: question, answer)"),
        ("{}", "missing key 'prompt' (keys: none)"),
        ('{"prompt": ""}', "'prompt' is an empty string"),
        ('{"prompt": "   "}', "'prompt' is an empty string"),
        ('{"prompt": 5}', "'prompt' must be a non-empty string or a list of messages, got a JSON number"),
        ('{"prompt": null}', "got a JSON null"),
        ('{"prompt": []}', "'prompt' is an empty list of messages"),
        ('{"prompt": ["hi"]}', "'prompt' message 0 is a JSON string, expected an object"),
        (
            '{"prompt": [{"role": "user", "content": "a"}, {"content": "b"}]}',
            "'prompt' message 1 needs a non-empty string 'role'",
        ),
        ('{"prompt": [{"role": "user"}]}', "'prompt' message 0 is missing 'content'"),
        ('{"prompt": [{"role": "user", "content": 3}]}', "'content' must be a string or a list"),
    ],
)
def test_bad_rows_name_file_line_and_problem(tmp_path, bad_line, message):
    path = write(tmp_path, jsonl({"prompt": "ok"}, {"prompt": "ok"}) + "\n" + bad_line + "\n")
    with pytest.raises(DatasetError) as info:
        Dataset(path)
    err = info.value
    assert (err.path, err.line) == (str(path), 4)
    assert str(err).startswith(f"{path}:4: ")
    assert message in str(err)


def test_invalid_utf8_names_line(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"prompt": "ok"}\n{"prompt": "\xff\xfe"}\n')
    with pytest.raises(DatasetError, match=r"data\.jsonl:2: invalid UTF-8"):
        Dataset(path)


def test_missing_empty_and_blank_files(tmp_path):
    with pytest.raises(DatasetError, match="file not found") as info:
        Dataset(tmp_path / "nope.jsonl")
    assert "nope.jsonl" in str(info.value)
    with pytest.raises(DatasetError, match="no rows: the file is empty"):
        Dataset(write(tmp_path, "", "empty.jsonl"))
    with pytest.raises(DatasetError, match="no rows: the file has only blank lines"):
        Dataset(write(tmp_path, "\n  \n", "blank.jsonl"))
    with pytest.raises(DatasetError, match="is a directory"):
        Dataset(tmp_path)


def test_fingerprint_is_sha256_of_file_and_tracks_content(tmp_path):
    text = jsonl({"prompt": "a", "label": 1}, {"prompt": "b", "label": 2})
    a = Dataset(write(tmp_path, text, "a.jsonl"))
    assert a.fingerprint == hashlib.sha256(text.encode()).hexdigest()
    same = Dataset(write(tmp_path, text, "same.jsonl"))
    assert same.fingerprint == a.fingerprint
    changed = Dataset(write(tmp_path, text.replace('"label": 2', '"label": 3'), "c.jsonl"))
    assert changed.fingerprint != a.fingerprint
    for ds in (a, same, changed):
        ds.close()


def test_file_changed_after_load_is_reported(tmp_path):
    path = write(tmp_path, jsonl({"prompt": "aaaa"}, {"prompt": "bbbb"}))
    ds = Dataset(path)
    path.write_text('{"prompt": "a"}\n{"prompt": "bbbbbbbbbbbbbb"}\n')
    with pytest.raises(DatasetError, match="changed after it was loaded"):
        ds.row(1)
    ds.close()


def test_only_a_checkpoint_per_block_of_rows_is_kept(tmp_path):
    path = write(tmp_path, jsonl(*({"prompt": "x" * 1000, "label": i} for i in range(50))))
    ds = Dataset(path)
    # ~1 KB rows: 15 rows per 16 KiB block, so 4 checkpoints for 50 rows; nothing holding row content.
    assert ds.block_rows == 15
    assert isinstance(ds._block_offsets, array) and len(ds._block_offsets) == 4
    assert [ds.row(i).label for i in (49, 0, 15, 14, 16, 30, 45)] == [49, 0, 15, 14, 16, 30, 45]
    ds.close()


def test_rows_across_blocks_with_blank_lines_and_a_tail_without_newline(tmp_path):
    lines = []
    for i in range(500):
        lines.append(json.dumps({"prompt": f"p{i}", "label": i}))
        if i % 7 == 3:
            lines.append("  ")
        if i % 11 == 5:
            lines.append("")
    path = write(tmp_path, "\n".join(lines))  # no newline after the last row
    with Dataset(path) as ds:
        assert len(ds) == 500 and ds.block_rows == _MAX_BLOCK_ROWS
        assert [ds.row(i).label for i in range(500)] == list(range(500))
        assert [ds.row(i).label for i in range(499, -1, -37)] == list(range(499, -1, -37))


def test_a_file_changed_after_load_is_caught_before_a_row_is_read(tmp_path):
    text = jsonl(*({"prompt": f"p{i}"} for i in range(200)))
    path = write(tmp_path, text)
    ds = Dataset(path)
    # Same size, a later mtime: the change is caught before the row is parsed.
    path.write_text(text.replace('"p150"', '"q150"'))
    with pytest.raises(DatasetError, match="changed after it was loaded") as info:
        ds.row(150)
    assert info.value.path == str(path)
    ds.close()


def test_loading_reads_in_chunks_across_lines(tmp_path, monkeypatch):
    import common.dataset as dataset_module

    monkeypatch.setattr(dataset_module, "_CHUNK", 7)  # every read ends mid-line
    text = "\n" + jsonl(*({"prompt": f"row {i}", "label": i} for i in range(30))) + '{"question": 1}\n'
    path = write(tmp_path, text)
    with pytest.raises(DatasetError) as info:
        Dataset(path)
    assert info.value.line == 32
    good = write(tmp_path, text.rsplit('{"question"', 1)[0], "good.jsonl")
    with Dataset(good) as ds:
        assert ds.fingerprint == hashlib.sha256(good.read_bytes()).hexdigest()
        assert [ds.row(i).label for i in range(30)] == list(range(30))


def test_epoch_permutation_is_deterministic_and_varies_by_epoch():
    assert epoch_permutation(5, 3, None) == range(5)
    p0 = epoch_permutation(1000, 0, seed=42)
    assert isinstance(p0, ShuffledOrder) and len(p0) == 1000
    assert sorted(p0) == list(range(1000))
    assert p0 == epoch_permutation(1000, 0, seed=42)
    assert list(p0) == list(epoch_permutation(1000, 0, seed=42))
    assert list(p0) != list(epoch_permutation(1000, 1, seed=42))
    assert list(p0) != list(epoch_permutation(1000, 0, seed=43))
    assert list(p0) != list(range(1000))
    assert list(epoch_permutation(0, 0, seed=1)) == []
    assert p0[-1] == p0[999] and p0[10:13] == [p0[10], p0[11], p0[12]]
    with pytest.raises(IndexError):
        p0[1000]


def test_shuffled_order_is_a_permutation_for_every_size():
    for n in [*range(0, 130), 255, 256, 257, 1023, 4097, 10_007]:
        order = epoch_permutation(n, 1, seed=7)
        assert sorted(order) == list(range(n)), n


def test_shuffled_order_is_pinned():
    """The order is part of a data dir's resume: a run restarted on a newer build must serve the same order."""
    assert epoch_permutation(10_000_000, 0, seed=1)[:6] == [9871401, 8811912, 8686977, 6979033, 7067506, 2431347]
    assert epoch_permutation(10, 3, seed=0)[:] == [3, 8, 5, 1, 2, 6, 4, 9, 7, 0]


def test_shuffled_order_mixes_the_file():
    """Neighbouring positions land far apart: a batch does not come from one region of a sorted file."""
    n = 100_000
    order = epoch_permutation(n, 0, seed=3)
    gaps = [abs(order[i + 1] - order[i]) for i in range(5000)]
    assert sum(gaps) / len(gaps) > n / 4  # uniform pairs average n / 3
    first_tenth = sum(1 for i in range(10_000) if order[i] < n // 10)
    assert 800 < first_tenth < 1200  # ~1,000 of the first 10,000 positions in each tenth of the file


def test_index_cache_skips_validation_only_for_the_same_bytes_and_keys(tmp_path, monkeypatch):
    import common.dataset as dataset_module

    rows = [{"prompt": f"p{i}", "q": f"q{i}", "label": i} for i in range(300)]
    path = write(tmp_path, jsonl(*rows))
    index = tmp_path / "dir" / "dataset.index"
    with Dataset(path, index_path=index) as first:
        assert not first.index_loaded and index.exists()
    parsed = []
    real_loads = dataset_module._loads
    monkeypatch.setattr(dataset_module, "_loads", lambda line: parsed.append(line) or real_loads(line))
    with Dataset(path, index_path=index) as again:
        assert again.index_loaded and not parsed  # no row parsed at load
        assert (len(again), again.fingerprint, again.block_rows) == (300, first.fingerprint, first.block_rows)
        assert [again.row(i).label for i in (0, 64, 299)] == [0, 64, 299]
    # Other keys: validated again (and the index rewritten for them).
    with Dataset(path, input_key="q", index_path=index) as other:
        assert not other.index_loaded and other.row(5).prompt == "q5"
    # Other bytes: the fingerprint is the new file's, so the ledger refuses it; a bad row is still named.
    path.write_text(jsonl(*rows).replace('"p7"', '"x7"'))
    with Dataset(path, input_key="q", index_path=index) as changed:
        assert not changed.index_loaded and changed.fingerprint != first.fingerprint
    path.write_text(jsonl(*rows[:10]) + '{"prompt": ""}\n')
    with pytest.raises(DatasetError) as info:
        Dataset(path, input_key="q", index_path=index)
    assert (info.value.path, info.value.line) == (str(path), 11)


def test_a_damaged_or_unwritable_index_costs_only_a_scan(tmp_path):
    path = write(tmp_path, jsonl(*({"prompt": f"p{i}"} for i in range(100))))
    index = tmp_path / "dataset.index"
    Dataset(path, index_path=index).close()
    data = index.read_bytes()
    for damaged in (data[:-8], b"", b"not json\n", data.replace(b'"rows": 100', b'"rows": 101')):
        index.write_bytes(damaged)
        with Dataset(path, index_path=index) as ds:
            assert not ds.index_loaded and len(ds) == 100 and ds.row(99).prompt == "p99"
    blocked = tmp_path / "file"
    blocked.write_text("")
    with Dataset(path, index_path=blocked / "dataset.index") as ds:  # its directory is a file
        assert not ds.index_loaded and ds.row(3).prompt == "p3"


def test_a_large_file_is_validated_in_spans_by_worker_processes(tmp_path, monkeypatch):
    import common.dataset as dataset_module

    lines = []
    for i in range(3000):
        lines.append(json.dumps({"prompt": f"p{i}", "label": i}))
        if i % 13 == 0:
            lines.append("")
    text = "\n".join(lines) + "\n"
    path = write(tmp_path, text)
    serial = Dataset(path)
    monkeypatch.setattr(scan_workers, "_PARALLEL_BYTES", 0)
    monkeypatch.setattr(dataset_module, "_scan_workers", lambda size: 3)
    index = tmp_path / "dataset.index"
    for expect_index in (False, True):
        with Dataset(path, index_path=index) as ds:
            assert ds.index_loaded is expect_index
            assert len(ds._span_rows) == 3  # the spans were scanned apart
            assert (len(ds), ds.fingerprint) == (len(serial), serial.fingerprint)
            assert [ds.row(i).label for i in range(3000)] == list(range(3000))
    # A bad row in the last span is named by its line in the file.
    bad = len(lines) - 5
    lines[bad] = '{"prompt": 3}'
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DatasetError) as info:
        Dataset(path, index_path=index)
    assert (info.value.path, info.value.line) == (str(path), bad + 1)
    assert "'prompt' must be a non-empty string" in str(info.value)
    serial.close()


def test_a_failed_validation_worker_falls_back_to_validating_in_process(tmp_path, monkeypatch):
    import common.dataset as dataset_module

    path = write(tmp_path, jsonl(*({"prompt": f"p{i}"} for i in range(500))))
    monkeypatch.setattr(scan_workers, "_PARALLEL_BYTES", 0)
    monkeypatch.setattr(dataset_module, "_scan_workers", lambda size: 2)
    monkeypatch.setattr(scan_workers, "_WORKER", "import sys; sys.exit(3)")
    with Dataset(path) as ds:
        assert len(ds._span_rows) == 1 and len(ds) == 500 and ds.row(499).prompt == "p499"
