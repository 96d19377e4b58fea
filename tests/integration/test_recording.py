"""Recorded batches on disk (coordinator/record_format.py, coordinator/recorder.py) and the replay's core
(coordinator/replay_core.py) over them: files written by a real ``Recorder``, read back by rollfleet and by
pyarrow, pandas and datasets; the core driven with decoded messages, no socket."""

from __future__ import annotations

import json
import os

import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from common import protocol as p  # noqa: E402
from common.types import Group, Sample  # noqa: E402
from coordinator.record_format import TMP_PREFIX, read_batch  # noqa: E402
from coordinator.recorded_run import RecordedRun  # noqa: E402
from coordinator.recorder import Recorder  # noqa: E402
from coordinator.replay_core import ReplayCore  # noqa: E402

CONTRACT = [
    "rollout_id",
    "source",
    "group_index",
    "data_epoch",
    "sample_index",
    "prompt_tokens",
    "response_tokens",
    "response_logprobs",
    "loss_mask",
    "reward",
    "status",
    "weight_versions",
    "label",
    "metadata",
    "response_text",
]
FLEET = {
    "config": {"rollout_batch_size": 2, "n_samples_per_prompt": 3},
    "dataset_size": 100,
    "dataset_fingerprint": "f00d",
    "weights_version": 4,
}


def group(rollout_id: int, position: int) -> Group:
    index = rollout_id * 10 + position
    samples = [
        Sample(
            prompt_tokens=[51, 43, 52, 61, index],
            response_tokens=list(range(3 + j)),
            response_logprobs=[-0.125 * (k + 1) - j for k in range(3 + j)],
            loss_mask=[1] * (2 + j) + [0],
            reward=float(j == 1),
            status="truncated" if j == 2 else "completed",
            weight_version="5",
            label=str(index % 7),
            metadata={"prompt": f"{index}+3=", "tool_calls": j},
            response_text=f"\\boxed{{{j}}}\n",
            weight_versions=[["4", 0, 1], ["5", 1, 3 + j]],
        )
        for j in range(3)
    ]
    return Group(
        index,
        samples,
        data_epoch=1,
        rollout_id=rollout_id - 1,
        label=str(index % 7),
        metadata={"prompt": f"{index}+3="},
        agent_id=f"node-{position}",
        gen_seconds=0.25 + position,
        source=("math", "code")[position],
    )


def batch(rollout_id: int) -> tuple[list[Group], dict]:
    groups = [group(rollout_id, i) for i in range(2)]
    return groups, {"rollout/reward_mean": 1 / 3, "rollout/groups": 2.0, "rollout/wait_seconds": 0.5}


@pytest.fixture
def recorded(tmp_path):
    """Three batches (ids 0-2) and one evaluation pass, written by a Recorder as a client hands them over."""
    directory = tmp_path / "records"
    recorder = Recorder(str(directory))
    for rollout_id in range(3):
        groups, metrics = batch(rollout_id)
        assert recorder.batch_nowait(rollout_id, [g.to_wire() for g in groups], metrics, FLEET)
    groups, metrics = batch(1)
    recorder.batch_nowait(1, [g.to_wire() for g in groups], metrics, FLEET)  # asked again: not written twice
    recorder.evaluation_nowait({"name": "math", "pass": 1, "reward_mean": 0.5}, 1)
    recorder.close()
    stats = recorder.statistics()
    assert (stats.written, stats.skipped, stats.failed) == (4, 1, 0)
    return directory


def test_a_recorded_file_reads_back_as_the_batch_it_was(recorded):
    for rollout_id in range(3):
        got = read_batch(str(recorded / f"rollout-{rollout_id}.parquet"))
        groups, metrics = batch(rollout_id)
        assert (got.rollout_id, got.groups, got.metrics, got.fleet) == (rollout_id, groups, metrics, FLEET)
    assert sorted(os.listdir(recorded)) == ["eval-math-1.json"] + [f"rollout-{i}.parquet" for i in range(3)]


def test_pyarrow_pandas_and_datasets_read_the_files(recorded, tmp_path):
    files = sorted(str(f) for f in recorded.glob("rollout-*.parquet"))
    table = pq.read_table(files[1])
    assert table.column_names[: len(CONTRACT)] == CONTRACT
    assert table.num_rows == 6  # one row per sample: 2 groups x 3
    meta = table.schema.metadata
    assert json.loads(meta[b"rollfleet.metrics"])["rollout/reward_mean"] == 1 / 3
    assert json.loads(meta[b"rollfleet.fleet"]) == FLEET and meta[b"rollfleet.rollout_id"] == b"1"
    row = table.slice(1, 1).to_pylist()[0]
    assert row["rollout_id"] == 1 and row["source"] == "math" and row["group_index"] == 10 and row["sample_index"] == 1
    assert row["response_tokens"] == [0, 1, 2, 3] and row["loss_mask"] == [1, 1, 1, 0]
    assert row["weight_versions"] == [{"version": "4", "start": 0, "end": 1}, {"version": "5", "start": 1, "end": 4}]
    assert json.loads(row["metadata"]) == {"prompt": "10+3=", "tool_calls": 1} and json.loads(row["label"]) == "3"

    pandas = pytest.importorskip("pandas")
    frame = pandas.concat([pandas.read_parquet(f) for f in files], ignore_index=True)
    assert len(frame) == 18 and list(frame.columns[: len(CONTRACT)]) == CONTRACT
    assert frame.groupby("rollout_id")["reward"].mean().tolist() == pytest.approx([1 / 3] * 3)
    assert list(frame.loc[5, "response_logprobs"]) == [-2.125, -2.25, -2.375, -2.5, -2.625]

    datasets = pytest.importorskip("datasets")
    ds = datasets.load_dataset("parquet", data_files=files, split="train", cache_dir=str(tmp_path / "hf-cache"))
    assert ds.num_rows == 18 and ds.column_names[: len(CONTRACT)] == CONTRACT
    assert ds[9]["prompt_tokens"] == [51, 43, 52, 61, 11] and ds[9]["rollout_id"] == 1
    assert sorted(set(ds["status"])) == ["completed", "truncated"]


def test_the_recorder_removes_torn_files_and_keeps_what_is_there(recorded):
    (recorded / f"{TMP_PREFIX}rollout-3.parquet.999").write_bytes(b"PAR1 torn")
    before = (recorded / "rollout-0.parquet").stat().st_mtime_ns
    recorder = Recorder(str(recorded))
    groups, metrics = batch(0)
    recorder.batch_nowait(0, [g.to_wire() for g in groups], metrics, FLEET)  # on disk already: not again
    recorder.close()
    assert recorder.statistics().skipped == 1
    assert not [n for n in os.listdir(recorded) if n.startswith(TMP_PREFIX)]
    assert (recorded / "rollout-0.parquet").stat().st_mtime_ns == before


def _attach(core, **check) -> int:
    ((reply, _),) = core.handle(p.Attach(1, "trainer-x", check))
    assert isinstance(reply, p.Ok), reply
    return reply.result["session"]


def test_the_replay_core_serves_recorded_batches_and_answers_as_a_fleet(recorded):
    sessions = iter(range(7, 100))
    core = ReplayCore(RecordedRun(str(recorded)), "tcp://127.0.0.1:1", lambda: next(sessions))
    s = _attach(core)
    ((refs, _),) = core.handle(p.Generate(s, 2, 1))
    assert isinstance(refs, p.BatchRefs) and refs.metrics == {"rollout/reward_mean": 1 / 3, "rollout/groups": 2.0}
    keys = [ref[3] for ref in refs.groups]
    assert [ref[4] for ref in refs.groups] == ["tcp://127.0.0.1:1"] * 2
    ((payloads, frames),) = core.handle(p.Fetch(3, keys + ["replay:9:0"]))
    assert payloads.found == keys and payloads.missing == ["replay:9:0"]
    assert [Group.from_wire(f) for f in frames] == batch(1)[0]

    ((err, _),) = core.handle(p.Generate(s, 4, 3))
    assert err.code == "not_recorded" and "recorded ids: 0-2 (3 batches)" in err.message
    ((err, _),) = core.handle(p.Generate(s + 1, 5, 0))
    assert err.code == "fenced"
    ((err, _),) = core.handle(p.Attach(6, "trainer-y", {"rollout_batch_size": 4}))
    assert err.code == "config_mismatch" and "rollout_batch_size" in err.message

    ((err, _),) = core.handle(p.UpdateWeights(s, 7, 4, "disk", "/ckpt"))
    assert err.code == "weights_version"  # not above the recorded fleet's version 4
    ((ok, _),) = core.handle(p.UpdateWeights(s, 8, 5, "distributed"))
    assert ok.result["world_size"] == 1 and ok.result["init"]
    ((ok, _),) = core.handle(p.FinishWeights(s, 9, ok.result["update_id"]))
    assert ok.result == {"update_id": ok.result["update_id"], "version": 5, "engines": {}}
    assert core.statistics()["weights"]["not_applied"] == [{"version": 5, "kind": "distributed", "path": ""}]

    ((ok, _),) = core.handle(p.Evaluate(s, 10, "math", "t1"))
    assert ok.result == {"name": "math", "pass": 1, "reward_mean": 0.5}
    ((again, _),) = core.handle(p.Evaluate(s, 11, "math", "t1"))  # the same call resent
    assert again.result == ok.result
    ((err, _),) = core.handle(p.Evaluate(s, 12, "math", "t2"))
    assert err.code == "not_recorded"
    ((err, _),) = core.handle(p.Evaluate(s, 13, "gsm8k", "t3"))
    assert err.code == "unknown_eval" and "math" in err.message

    ((err, _),) = core.handle(p.StateDict(s, 14, 1))
    assert err.code == "not_drained"
    core.handle(p.Pause(s, 15))
    ((state, _),) = core.handle(p.StateDict(s, 16, 1))
    assert state.result["dataset_fingerprint"] == "f00d" and state.result["rollout_id"] == 1
    ((ok, _),) = core.handle(p.LoadStateDict(s, 17, {**state.result, "rollout_id": 0}))
    assert isinstance(ok, p.Ok)
    ((ok, _),) = core.handle(p.Evaluate(s, 18, "math", "t4"))  # after rollout 0 the pass comes again
    assert ok.result["pass"] == 1
    ((err, _),) = core.handle(p.LoadStateDict(s, 19, {**state.result, "dataset_fingerprint": "beef"}))
    assert err.code == "bad_state"
    assert core.paused
    core.handle(p.Generate(s, 20, 2))  # a batch not served yet resumes, as on a fleet
    assert not core.paused
