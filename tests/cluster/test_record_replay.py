"""Record and replay (docs/guides/record-and-replay.md): a real run's batches, recorded by the trainer's
client, served again by ``coordinator replay`` with no agents and no engines, equal to what the trainer had."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import urllib.request

import pytest

from common.demo_data import write_arithmetic_dataset
from common.errors import RemoteError, StateError
from coordinator.client import EvalMetrics
from coordinator.record_format import TMP_PREFIX, read_batch
from harness.cluster import ROOT, Proc
from harness.polling import WaitAborted, wait_for

pytest.importorskip("pyarrow")
torch = pytest.importorskip("torch")

pytestmark = pytest.mark.timeout(240)

STEPS = 10
SLOW = "--token-latency-ms 6 --output-len-dist fixed --output-len-median 40"  # ~0.24 s a sample


def running(cluster) -> int:
    """Requests the engines generate right now (their own ``/v1/loads``)."""
    total = 0
    for entry in cluster.status()["agents"].values():
        for e in entry["engines"]:
            if entry["status"] == "alive" and e.get("url"):
                with urllib.request.urlopen(f"{e['url']}/v1/loads", timeout=5) as resp:
                    total += sum(load["num_running_reqs"] for load in json.loads(resp.read())["loads"])
    return total


def trainer_loop(client, steps: int, on_step=None) -> list:
    """The trainer loop both runs share: a batch a step, its tensors, an evaluation after steps 3 and 9."""
    out = []
    for step in range(steps):
        # One step takes what is ready after a short deadline: possibly a partial batch, recorded like any.
        batch = client.generate(step, deadline=0.3) if step == 6 else client.generate(step)
        out.append((batch, batch.to_tensors()))
        if on_step is not None:
            on_step(step)
        if step in (3, 9):
            out.append(client.evaluate("small"))
    return out


def assert_same_batches(replayed, recorded) -> None:
    assert len(replayed) == len(recorded)
    for got, want in zip(replayed, recorded, strict=True):
        if isinstance(want, EvalMetrics):  # an evaluation pass
            assert got == want
            continue
        (batch, tensors), (want_batch, want_tensors) = got, want
        assert batch.rollout_id == want_batch.rollout_id
        assert batch.groups == want_batch.groups, f"batch {batch.rollout_id} differs"
        timing = ("rollout/wait_seconds", "rollout/fetch_seconds")  # measured by each run's client
        assert {k: v for k, v in batch.metrics.items() if k not in timing} == {
            k: v for k, v in want_batch.metrics.items() if k not in timing
        }
        assert tensors.keys() == want_tensors.keys()
        for key in tensors:
            assert torch.equal(tensors[key], want_tensors[key]), f"batch {batch.rollout_id}: to_tensors()[{key!r}]"


def test_a_recorded_run_replays_equal_with_no_fleet(make_cluster, tmp_path):
    """10 batches of a real run (sim engines, a disk weight update caught mid-generation so samples continue on
    the new weights: partial rollouts, one batch made at a deadline, two evaluation passes), recorded; then the
    same loop against ``coordinator replay`` alone gets every batch, its tensors and the passes equal."""
    records = tmp_path / "records"
    evals = write_arithmetic_dataset(tmp_path / "eval.jsonl", 6, seed=5)
    cluster = make_cluster(rollout_batch_size=4, n_samples_per_prompt=4, max_new_tokens=48, dynamic_filter="none")
    cluster.start_coordinator("--eval-dataset", f"small={evals},n_samples=2")
    cluster.start_agent("a1", engines=2, sim_args=SLOW)

    def update_mid_generation(step: int) -> None:
        if step == 4:
            wait_for(lambda: running(cluster) > 0, 30, "samples running on the engines")
            ckpt = tmp_path / "ckpt1"
            ckpt.mkdir()
            client.update_weights_from_disk(str(ckpt), 1)

    with cluster.client(record=str(records)) as client:
        recorded = trainer_loop(client, STEPS, update_mid_generation)
        again = client.generate(2)  # asked again: the same batch, not written twice
        assert again.groups == recorded[2][0].groups
    batches = [b for b, _ in (r for r in recorded if not isinstance(r, EvalMetrics))]
    names = sorted(os.listdir(records))
    assert names == sorted([f"rollout-{i}.parquet" for i in range(STEPS)] + ["eval-small-1.json", "eval-small-2.json"])
    spans = [len(s.weight_versions) for b in batches for s in b.samples]
    assert max(spans) >= 2, "no sample was continued across the weight update (a partial rollout)"
    assert {s.weight_versions[-1][0] for s in batches[-1].samples} == {"1"}
    assert cluster.stop_all() == []  # no fleet from here on

    replay = make_cluster()
    replay.start_replay(records)
    with replay.client(expect={"rollout_batch_size": 4, "dynamic_filter": "none"}) as client:
        assert client.weight_version() == 0  # the fleet's version when recording began
        replayed = trainer_loop(client, STEPS)
        assert_same_batches(replayed, recorded)
        assert client.generate(3).groups == batches[3].groups  # asked again
        with pytest.raises(RemoteError, match=r"not recorded .*recorded ids: 0-9 \(10 batches\)") as err:
            client.generate(STEPS)
        assert err.value.code == "not_recorded"
        with pytest.raises(RemoteError, match="every recorded pass"):
            client.evaluate("small")
        # Pause, checkpoint, resume and weight updates behave as on a fleet; the updates are logged, not applied.
        with pytest.raises(StateError, match="pause"):
            client.state_dict()
        client.pause()
        state = client.state_dict()
        assert state["rollout_id"] == STEPS - 1 and state["dataset_fingerprint"]
        client.resume()
        ckpt = tmp_path / "ckpt2"
        ckpt.mkdir()
        assert client.update_weights_from_disk(str(ckpt), 2).engines == {}
        with pytest.raises(StateError, match="not greater"):
            client.update_weights_from_disk(str(ckpt), 2)
        client.update_weights({"w": torch.ones(3)}, 3, backend="gloo")
        stats = client.stats()
        assert stats.weights.version == 3
        assert [u["version"] for u in stats.raw["weights"]["not_applied"]] == [2, 3]  # a replay's own key
        client.load_state_dict({**state, "rollout_id": 3})  # back to step 4: the pass after it comes again
        assert client.generate(4).groups == batches[4].groups
        assert client.evaluate("small") == recorded[-1]
    # A trainer expecting another fleet is refused by the replay as by a fleet.
    with pytest.raises(StateError, match="rollout_batch_size"):
        replay.client(expect={"rollout_batch_size": 8})
    # The asyncio client records too: a replay recorded again gives the same files' batches.
    again = tmp_path / "again"
    asyncio.run(record_async(replay.address, str(again), [0, 6, 9]))
    for i in (0, 6, 9):
        got, want = read_batch(str(again / f"rollout-{i}.parquet")), read_batch(str(records / f"rollout-{i}.parquet"))
        assert got.groups == want.groups == batches[i].groups
        assert got.fleet == {**want.fleet, "weights_version": 3}  # the replay's version then: pushes are logged

    show = cli("replay", "--from", str(records), "--show", "6", "--samples", "2")
    assert show.returncode == 0, show.stderr
    assert show.stdout.startswith(f"batch 6 ({records}/rollout-6.parquet): ") and "rollout/reward_mean" in show.stdout
    assert show.stdout.count("    prompt:   'Question ") == 2 and "first 2 of 16 samples:" in show.stdout
    missing = cli("replay", "--from", str(records), "--show", "10")
    assert missing.returncode == 2 and "recorded ids: 0-9" in missing.stderr, missing.stderr


async def record_async(address: str, directory: str, ids: list[int]) -> None:
    from coordinator.client import AsyncRolloutClient

    async with AsyncRolloutClient(address, record=directory, timeout=30, retry_interval=0.5) as client:
        for i in ids:
            await client.generate(i)


def cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "coordinator.cli", *argv], capture_output=True, text=True, timeout=60, cwd=ROOT
    )


def test_a_sigkilled_trainer_leaves_whole_files_and_its_restart_records_the_rest(make_cluster, tmp_path):
    """The recording trainer is SIGKILLed while it writes a file (a temporary file seen in the directory once two
    are whole; failing that, after its 15th batch): every recorded file there is whole. Started again on the
    same directory, it records the batches missing and none twice, and the replay serves all of them equal to
    the fleet's."""
    records = tmp_path / "records"
    cluster = make_cluster(rollout_batch_size=8, n_samples_per_prompt=4, dynamic_filter="none")
    cluster.start_coordinator()
    cluster.start_agent("a1", engines=2)
    steps = 20
    argv = [sys.executable, "-m", "harness.recording_trainer", cluster.address, str(records), str(steps)]

    first = Proc("trainer-0", argv, tmp_path / "trainer-0.log")
    try:

        def writing() -> bool:
            if not first.alive():
                raise WaitAborted(f"the trainer exited: {first.text()[-2000:]}")
            names = os.listdir(records) if records.exists() else []
            recorded = sum(n.startswith("rollout-") for n in names)
            if recorded >= 2 and any(n.startswith(TMP_PREFIX) for n in names):
                return True
            return "batch 14" in first.text() and recorded

        wait_for(writing, 60, "the trainer to write a file", interval=0.001)
        first.signal(signal.SIGKILL)
        first.wait(10)
        torn = [n for n in os.listdir(records) if n.startswith(TMP_PREFIX)]
    finally:
        first.signal(signal.SIGKILL)
        first.close()
    whole = {}
    for name in os.listdir(records):
        if name.startswith("rollout-"):
            batch = read_batch(str(records / name))  # raises on a torn file
            assert len(batch.groups) == 8 and all(len(g.samples) == 4 for g in batch.groups), name
            whole[name] = os.stat(records / name).st_mtime_ns
    assert whole, "nothing was recorded before the kill"
    print(f"killed with {len(whole)} whole files and {torn} being written")

    second = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert second.returncode == 0 and "done" in second.stdout, second.stderr[-3000:]
    assert sorted(os.listdir(records)) == sorted(f"rollout-{i}.parquet" for i in range(steps))
    assert not [n for n in os.listdir(records) if n.startswith(TMP_PREFIX)]
    for name, mtime in whole.items():
        assert os.stat(records / name).st_mtime_ns == mtime, f"{name} was written again"
    with cluster.client() as client:
        fleet = [client.generate(i) for i in range(steps)]  # the same batches again (generate is idempotent)
    assert cluster.stop_all() == []

    replay = make_cluster()
    replay.start_replay(records)
    with replay.client() as client:
        for i in range(steps):
            assert client.generate(i).groups == fleet[i].groups


def test_the_grpo_example_trainer_on_a_replay_computes_the_same_losses(make_cluster, tmp_path, hf_model_dir):
    """``examples/grpo/train.py``'s trainer, unchanged, records a short run on a sim fleet (its gloo pushes reach the
    engines); the fleet goes; from the same starting weights it runs again on ``coordinator replay`` of the records
    and computes the same loss, gradient norm and logprob check at every step (its pushes accepted, not applied)."""
    pytest.importorskip("transformers")
    from agent.hf.model import load_model
    from examples.grpo.train import TrainConfig, train

    steps, records = 3, tmp_path / "records"
    cluster = make_cluster(rollout_batch_size=4, n_samples_per_prompt=4, max_new_tokens=40, max_staleness=1)
    cluster.start_coordinator()
    cluster.start_agent("a1", sim_args="--output-len-dist fixed --output-len-median 32")  # the answer fits
    model, _ = load_model(hf_model_dir)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the trainer shares the cores with the fleet
    try:
        on_fleet = train(cluster.address, model, TrainConfig(steps=steps, record=str(records)), out=tmp_path / "run")
        assert cluster.stop_all() == []
        replay = make_cluster()
        replay.start_replay(records)
        fresh, _ = load_model(hf_model_dir)
        on_replay = train(replay.address, fresh, TrainConfig(steps=steps), out=tmp_path / "replay")
    finally:
        torch.set_num_threads(threads)
    assert all(row["loss"] != 0 for row in on_fleet), "a step without a reward spread compares nothing"
    keys = ("step", "version", "reward", "loss", "grad_norm", "train/rollout_logprob_abs_diff", "checked_versions")
    assert [{k: r[k] for k in keys} for r in on_replay] == [{k: r[k] for k in keys} for r in on_fleet]
