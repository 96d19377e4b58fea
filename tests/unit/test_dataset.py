"""The JSONL prompt dataset: validation, row access, fingerprint, shuffling (pure)."""

from __future__ import annotations

import hashlib
import json
from array import array

import pytest

from common.dataset import Dataset, Row, epoch_permutation
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


def test_offsets_not_rows_are_kept(tmp_path):
    path = write(tmp_path, jsonl(*({"prompt": "x" * 1000, "label": i} for i in range(50))))
    ds = Dataset(path)
    # Only an array of offsets per row: nothing holding row content.
    assert isinstance(ds._offsets, array) and len(ds._offsets) == 50
    assert ds.row(49).label == 49
    ds.close()


def test_epoch_permutation_is_deterministic_and_varies_by_epoch():
    assert epoch_permutation(5, 3, None) == range(5)
    p0 = epoch_permutation(1000, 0, seed=42)
    assert isinstance(p0, array)
    assert sorted(p0) == list(range(1000))
    assert p0 == epoch_permutation(1000, 0, seed=42)
    assert p0 != epoch_permutation(1000, 1, seed=42)
    assert p0 != epoch_permutation(1000, 0, seed=43)
    assert list(p0) != list(range(1000))
    assert list(epoch_permutation(0, 0, seed=1)) == []
