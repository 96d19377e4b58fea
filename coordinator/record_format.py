"""The recorded-batch format: one Parquet file per rollout id, one row per sample.

``DIR/rollout-<rollout_id>.parquet`` holds batch ``rollout_id`` as a trainer's ``generate`` returned
it, in order (groups in batch order, the samples of each group in order), with these columns (the
first fifteen are the contract; the others make the batch whole again, so a replay is equal to it):

    rollout_id         int64    the batch's rollout id
    source             string   the group's training dataset (``Group.source``; ``default`` for a plain ``--dataset``)
    group_index        int64    the prompt's dataset row (``Group.index``)
    data_epoch         int64
    sample_index       int64    the sample's place in its group (0 .. n_samples_per_prompt - 1)
    prompt_tokens      list<int32>
    response_tokens    list<int32>
    response_logprobs  list<float64>
    loss_mask          list<int8>
    reward             float64
    status             string   completed | truncated | aborted
    weight_versions    list<struct<version: string, start: int64, end: int64>>  response-token spans
    label              string   JSON (the row's label, any JSON value)
    metadata           string   JSON (the sample's metadata)
    response_text      string
    weight_version     string   the engine's label when the sample finished (``Sample.weight_version``)
    group_position     int64    the group's place in the batch
    group_metadata     string   JSON (``Group.metadata``)
    agent_id           string   the node that made the group
    gen_seconds        float64  the group's generation time
    leased_rollout_id  int64    the rollout being collected when the prompt was leased (``Group.rollout_id``)

The file's key-value metadata holds ``rollfleet.format`` (``1``), ``rollfleet.rollout_id``,
``rollfleet.metrics`` (the batch's metrics, JSON) and ``rollfleet.fleet`` (JSON: the fleet's rollout
``config``, ``dataset_size``, ``dataset_fingerprint`` and ``weights_version`` when the recording
trainer attached), which is what a replay answers an ``attach`` with.

Every file has the same schema, so a directory reads as one table (``pyarrow.parquet``, pandas,
``datasets.load_dataset("parquet", data_files="DIR/rollout-*.parquet")``).

Evaluation passes are kept beside them as ``DIR/eval-<name>-<pass>.json``: ``{"name", "pass",
"consumed", "metrics"}`` (``evaluate`` returns metrics only; there are no samples to keep).

Token arrays move between ``array`` and Arrow buffers without a per-token Python step.
pyarrow is imported here, and this module only by code that records or replays.
"""

from __future__ import annotations

import json
import os
import re
import sys
from array import array
from dataclasses import dataclass, field

from common.errors import ConfigError, RolloutError
from common.types import Group, Sample

try:
    import pyarrow as pa
except ImportError:  # pragma: no cover - checked where recording or replay starts
    pa = None

FORMAT = "1"
BATCH_FILE = re.compile(r"^rollout-(\d+)\.parquet$")
EVAL_FILE = re.compile(r"^eval-(.+)-(\d+)\.json$")
TMP_PREFIX = ".tmp-"
"""Files being written start with this; a whole file is renamed into place, so anything so named is
the leftover of a writer that died, and the next recorder removes it."""

_LITTLE = sys.byteorder == "little"


def require_pyarrow(what: str) -> None:
    if pa is None:
        raise ConfigError(f"{what} needs pyarrow: pip install 'rollfleet[record]'")


def batch_name(rollout_id: int) -> str:
    return f"rollout-{rollout_id}.parquet"


def eval_name(name: str, eval_pass: int) -> str:
    return f"eval-{name}-{eval_pass}.json"


def schema():
    span = pa.struct([("version", pa.string()), ("start", pa.int64()), ("end", pa.int64())])
    return pa.schema(
        [
            ("rollout_id", pa.int64()),
            ("source", pa.string()),
            ("group_index", pa.int64()),
            ("data_epoch", pa.int64()),
            ("sample_index", pa.int64()),
            ("prompt_tokens", pa.list_(pa.int32())),
            ("response_tokens", pa.list_(pa.int32())),
            ("response_logprobs", pa.list_(pa.float64())),
            ("loss_mask", pa.list_(pa.int8())),
            ("reward", pa.float64()),
            ("status", pa.string()),
            ("weight_versions", pa.list_(span)),
            ("label", pa.string()),
            ("metadata", pa.string()),
            ("response_text", pa.string()),
            ("weight_version", pa.string()),
            ("group_position", pa.int64()),
            ("group_metadata", pa.string()),
            ("agent_id", pa.string()),
            ("gen_seconds", pa.float64()),
            ("leased_rollout_id", pa.int64()),
        ]
    )


@dataclass
class BatchFile:
    """One recorded file, decoded: the batch as ``generate`` returned it, and what the fleet was."""

    rollout_id: int
    groups: list[Group]
    metrics: dict
    fleet: dict = field(default_factory=dict)


# ------------------------------------------------------------------ writing

PARQUET_OPTIONS = {
    # Dictionary encoding only where values repeat; on token and logprob lists it costs time for nothing.
    "use_dictionary": ["source", "status", "weight_version", "agent_id", "label", "group_metadata"],
    "write_statistics": ["rollout_id", "group_index", "data_epoch", "sample_index", "reward", "group_position"],
}
"""``pyarrow.parquet.write_table`` options: half the default's time on a batch of 256 x 256 tokens, and smaller."""


def _packed(chunks: list[bytes], itemsize: int, arrow_type):
    """A ``list<arrow_type>`` column from each row's little-endian bytes (the wire's): one join, no per-element step."""
    offsets = array("i", [0])
    total = 0
    for c in chunks:
        total += len(c) // itemsize
        offsets.append(total)
    if not _LITTLE:
        offsets.byteswap()
    values = pa.Array.from_buffers(arrow_type, total, [None, pa.py_buffer(b"".join(chunks))])
    starts = pa.Array.from_buffers(pa.int32(), len(offsets), [None, pa.py_buffer(offsets)])
    return pa.ListArray.from_arrays(starts, values)


def _json(value, what: str) -> str:
    try:
        return json.dumps(value, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise RolloutError(f"cannot record {what}: not JSON ({exc})") from None


def batch_table(rollout_id: int, payloads: list[bytes], metrics: dict, fleet: dict):
    """Batch ``rollout_id`` as an Arrow table with its metadata (the file's whole content), from its groups'
    payload bytes in batch order (``Group.to_wire``, as the client fetched them: token arrays stay bytes)."""
    import msgpack

    chunks: dict[str, list[bytes]] = {"p": [], "r": [], "lp": [], "m": []}
    names = (
        "group_index",
        "data_epoch",
        "sample_index",
        "reward",
        "status",
        "weight_versions",
        "label",
        "metadata",
        "response_text",
        "weight_version",
        "group_position",
        "group_metadata",
        "agent_id",
        "gen_seconds",
        "leased_rollout_id",
    )
    rows: dict[str, list] = {k: [] for k in names}
    sources: list[str] = []
    for position, payload in enumerate(payloads):
        g = msgpack.unpackb(payload, raw=False)
        index, samples = g["i"], g["ss"]
        if not samples:
            raise RolloutError(f"cannot record batch {rollout_id}: group {index} has no samples")
        label = _json(g["l"], f"the label of group {index}")
        group_metadata = _json(g["md"], f"the metadata of group {index}")
        n = len(samples)
        for key in chunks:
            chunks[key].extend(s[key] for s in samples)
        rows["group_index"] += [index] * n
        sources += [g.get("src", "default")] * n
        rows["data_epoch"] += [g["e"]] * n
        rows["sample_index"] += range(n)
        rows["label"] += [label] * n
        rows["group_position"] += [position] * n
        rows["group_metadata"] += [group_metadata] * n
        rows["agent_id"] += [g["a"]] * n
        rows["gen_seconds"] += [float(g["g"])] * n
        rows["leased_rollout_id"] += [g["rid"]] * n
        for s in samples:
            rows["reward"].append(float(s["rw"]))
            rows["status"].append(s["s"])
            rows["weight_versions"].append(
                [{"version": None if v is None else str(v), "start": b, "end": e} for v, b, e in s["wvs"]]
            )
            rows["metadata"].append(_json(s["md"], f"the metadata of a sample of group {index}"))
            rows["response_text"].append(s["t"])
            rows["weight_version"].append(s["wv"])
    sch = schema()
    n = len(rows["reward"])
    columns = {
        "rollout_id": pa.array([rollout_id] * n, pa.int64()),
        "source": pa.array(sources, pa.string()),
        "prompt_tokens": _packed(chunks["p"], 4, pa.int32()),
        "response_tokens": _packed(chunks["r"], 4, pa.int32()),
        "response_logprobs": _packed(chunks["lp"], 8, pa.float64()),
        "loss_mask": _packed(chunks["m"], 1, pa.int8()),
    }
    for name, values in rows.items():
        columns[name] = pa.array(values, sch.field(name).type)
    meta = {
        "rollfleet.format": FORMAT,
        "rollfleet.rollout_id": str(rollout_id),
        "rollfleet.metrics": _json(metrics, f"the metrics of batch {rollout_id}"),
        "rollfleet.fleet": _json(fleet, "the fleet's configuration"),
    }
    return pa.Table.from_arrays([columns[f.name] for f in sch], schema=sch.with_metadata(meta))


# ------------------------------------------------------------------ reading


def _unpacked(column, typecode: str) -> list[array]:
    """Each row of a ``list<...>`` column as an ``array(typecode)`` (its bytes sliced out, no per-element step)."""
    col = column.combine_chunks() if hasattr(column, "combine_chunks") else column
    values = col.flatten()
    size = array(typecode).itemsize
    data = values.buffers()[1]
    raw = data.to_pybytes()[values.offset * size : (values.offset + len(values)) * size] if data is not None else b""
    offsets = col.offsets.to_pylist()
    base = offsets[0] if offsets else 0
    out = []
    for i in range(len(offsets) - 1):
        a = array(typecode)
        a.frombytes(raw[(offsets[i] - base) * size : (offsets[i + 1] - base) * size])
        if not _LITTLE:
            a.byteswap()
        out.append(a)
    return out


def read_batch(path: str) -> BatchFile:
    """The batch in recorded file ``path``; RolloutError naming the file if it is not one."""
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:
        raise RolloutError(f"{path}: not a readable Parquet file ({exc})") from None
    meta = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
    if meta.get("rollfleet.format") != FORMAT:
        raise RolloutError(f"{path}: not a rollfleet recorded batch (format {meta.get('rollfleet.format')!r})")
    rollout_id = int(meta["rollfleet.rollout_id"])
    columns = {
        "prompt_tokens": _unpacked(table.column("prompt_tokens"), "i"),
        "response_tokens": _unpacked(table.column("response_tokens"), "i"),
        "response_logprobs": _unpacked(table.column("response_logprobs"), "d"),
        "loss_mask": _unpacked(table.column("loss_mask"), "b"),
    }
    plain = table.drop_columns(list(columns)).to_pydict()
    groups: list[Group] = []
    for r in range(table.num_rows):
        if not groups or plain["group_position"][r] != len(groups) - 1:
            label = json.loads(plain["label"][r])
            groups.append(
                Group(
                    index=plain["group_index"][r],
                    samples=[],
                    data_epoch=plain["data_epoch"][r],
                    rollout_id=plain["leased_rollout_id"][r],
                    label=label,
                    metadata=json.loads(plain["group_metadata"][r]),
                    agent_id=plain["agent_id"][r],
                    gen_seconds=plain["gen_seconds"][r],
                    source=plain["source"][r] or "default",  # null in recordings from before mixtures
                )
            )
        g = groups[-1]
        g.samples.append(
            Sample(
                prompt_tokens=columns["prompt_tokens"][r],
                response_tokens=columns["response_tokens"][r],
                response_logprobs=columns["response_logprobs"][r],
                loss_mask=columns["loss_mask"][r],
                reward=plain["reward"][r],
                status=plain["status"][r],
                weight_version=plain["weight_version"][r],
                label=g.label,
                metadata=json.loads(plain["metadata"][r]),
                response_text=plain["response_text"][r],
                weight_versions=[[s["version"], s["start"], s["end"]] for s in plain["weight_versions"][r]],
            )
        )
    return BatchFile(rollout_id, groups, json.loads(meta["rollfleet.metrics"]), json.loads(meta["rollfleet.fleet"]))


def recorded_ids(directory: str) -> list[int]:
    """The rollout ids with a whole file in ``directory``, ascending."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for m in map(BATCH_FILE.match, names) if m)


def describe_ids(ids: list[int]) -> str:
    """``0-9, 12, 14-15`` for a sorted list of ids."""
    if not ids:
        return "none"
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
