"""A full LMDB map (``--map-size``), on real processes, on both sides (common/lmdb_env.py).

What must hold: the process that hit it says so in one line naming the data dir and the flag,
exits 1, and loses nothing it acknowledged: restarted on the same data dir with a larger
``--map-size``, it carries on and every group acknowledged before is delivered, exactly once.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import lmdb
import pytest

from common import faults
from common.types import Group
from coordinator.frontier import FILTERED
from coordinator.ledger import read_ledger
from harness.observe import metrics_url, scrape
from harness.polling import wait_for
from harness.small_disk import PAGE, fill, small_disk_or_skip, unfill

FIXED = "--output-len-dist fixed --output-len-median 16"


def committed_groups(data_dir: Path) -> dict[int, Group]:
    """The groups an agent's store holds, read from outside: dataset index -> group."""
    env = lmdb.open(str(data_dir / "store"), readonly=True, max_dbs=4, lock=True)
    try:
        db = env.open_db(b"groups", create=False)
        with env.begin() as txn:
            groups = [Group.from_wire(bytes(v)) for _, v in txn.cursor(db=db)]
    finally:
        env.close()
    return {g.index: g for g in groups}


def assert_full_line(text: str, what: str, data_dir: Path, size: str) -> None:
    lines = [line for line in text.splitlines() if line.startswith(("agent: error:", "coordinator: error:"))]
    assert len(lines) == 1, text[-3000:]
    assert what in lines[0] and str(data_dir) in lines[0] and f"--map-size {size}" in lines[0], lines[0]
    assert "Traceback" not in text, text[-3000:]


def test_full_agent_store_stops_the_agent_and_a_restart_with_a_larger_map_delivers_every_committed_group(
    make_cluster,
):
    """Red if: the agent keeps running and failing every group, dies with a traceback, the message
    does not name the store and the flag, or a group committed before the stop is lost or delivered
    twice after the restart."""
    cluster = make_cluster(rows=64, dynamic_filter="none", prefetch=64)  # every row leased: the store fills
    cluster.start_coordinator()
    agent = cluster.start_agent("a1", "--map-size", "256KiB", sim_args=FIXED, wait=False)
    assert agent.wait(60) == 1
    data_dir = cluster.tmp / "a1"
    assert_full_line(agent.text(), "agent store", data_dir / "store", "256KiB")
    before = committed_groups(data_dir)
    assert before, "nothing was committed before the store was full"

    cluster.start_agent("a1", "--map-size", "64MiB", sim_args=FIXED)
    delivered: dict[int, Group] = {}
    with cluster.client() as client:
        for step in range(8):  # the whole epoch: 64 rows, 8 per batch
            batch = client.generate(step)
            assert len(batch.groups) == 8
            for g in batch.groups:
                assert g.index not in delivered, f"index {g.index} delivered twice"
                delivered[g.index] = g
    assert set(delivered) == set(range(64))
    for index, group in before.items():  # the very groups committed before the stop, not regenerated ones
        got = delivered[index]
        assert [list(s.response_tokens) for s in got.samples] == [list(s.response_tokens) for s in group.samples]


def test_full_coordinator_ledger_stops_it_and_a_restart_with_a_larger_map_carries_on(make_cluster):
    """Red if: the coordinator dies with a traceback or keeps serving on a ledger it cannot write,
    the message does not name the ledger and the flag, or after the restart a batch the trainer
    was given is lost or given again with other groups (an index twice)."""
    cluster = make_cluster(rows=400, dynamic_filter="none")
    coordinator = cluster.start_coordinator("--map-size", "64KiB")
    cluster.start_agent("a1", sim_args=FIXED)
    batches: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def train():
        try:
            with cluster.client(timeout=120) as client:
                for step in range(6):
                    batches[step] = [g.index for g in client.generate(step).groups]
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    trainer = threading.Thread(target=train, name="trainer")
    trainer.start()
    assert coordinator.wait(120) == 1
    assert_full_line(coordinator.text(), "coordinator ledger", cluster.tmp / "coordinator" / "ledger", "64KiB")
    given_before = dict(batches)
    cluster.start_coordinator("--map-size", "64MiB")
    trainer.join(180)
    assert not trainer.is_alive() and not errors, errors
    assert sorted(batches) == list(range(6))
    for step, indices in given_before.items():
        assert batches[step] == indices
    seen = [i for indices in batches.values() for i in indices]
    assert len(seen) == len(set(seen)) == 48, batches
    wait_for(lambda: cluster.status()["agents"]["a1"]["status"] == "alive", 30, "the agent to be back")


# ---------------------------------------------------------------------------- a disk that fills up

BIG = "--output-len-dist fixed --output-len-median 256"
"""Groups of 4 x 256 tokens: a commit writes several LMDB pages, so a page or two left is a short write."""

CHECKED, ENOSPC, EIO = "left, a write of", "(ENOSPC)", "(EIO: a write ran out of space part-way"
"""How the line says the disk was found full: refused by the check before a commit, or LMDB's own error."""
FILLS = {
    # how the disk is filled: (bytes left free, the check before each commit off (LMDB meets the full disk))
    "checked": (256 << 10, False),  # less than the reserve: the check refuses the next commit
    "no-page-left": (0, True),  # the next commit's first page write into new space fails outright
    "one-page-left": (PAGE, True),  # a commit of several new pages writes one, then runs out: a short write
}


@pytest.fixture
def disk(tmp_path):
    """A 4 MiB tmpfs, unmounted after the test's processes are gone (ask for it before ``make_cluster``)."""
    with small_disk_or_skip(tmp_path / "disk") as path:
        yield path


def with_faults(monkeypatch, spec: str | None, start):
    """``start()`` with ``ROLLFLEET_FAULTS=spec`` in the environment of the process it spawns (None: as it is)."""
    if spec is None:
        return start()
    monkeypatch.setenv(faults.ENV, spec)
    try:
        return start()
    finally:
        monkeypatch.delenv(faults.ENV)


def assert_disk_line(text: str, what: str, path: Path, named: tuple[str, ...]) -> str:
    """The one line, naming the disk under ``what`` full and one of ``named`` (how it was found); returns which."""
    lines = [line for line in text.splitlines() if line.startswith(("agent: error:", "coordinator: error:"))]
    assert len(lines) == 1, text[-3000:]
    assert f"the disk under {what} {path} is full" in lines[0], lines[0]
    assert "Traceback" not in text, text[-3000:]
    found = [n for n in named if n in lines[0]]
    assert found, f"{lines[0]!r} names none of {named}"
    return found[0]


def failed_leases(base: str) -> float:
    return sum(
        s.value for s in scrape(base) if s.name == "rollfleet_lease_ends_total" and s.labels.get("reason") == "failed"
    )


def tokens(groups) -> dict[int, list]:
    return {g.index: [list(s.response_tokens) for s in g.samples] for g in groups}


class Trainer(threading.Thread):
    """Pulls batches 0, 1, ... until told to stop, across restarts of either side (the client retries).

    A daemon: a test that fails with a call in flight leaves it to the cluster's teardown, which
    closes the client."""

    def __init__(self, cluster):
        super().__init__(name="trainer", daemon=True)
        self.client = cluster.client(timeout=60)
        self.batches: dict[int, dict[int, list]] = {}  # rollout id -> index -> samples' tokens
        self.errors: list[BaseException] = []
        self.stop = threading.Event()

    def run(self):
        try:
            step = 0
            while not self.stop.is_set():
                self.batches[step] = tokens(self.client.generate(step).groups)
                step += 1
        except BaseException as exc:  # reported by the main thread
            self.errors.append(exc)

    def finish(self) -> None:
        self.stop.set()
        self.join(90)
        assert not self.is_alive() and not self.errors, self.errors

    def delivered(self) -> list[int]:
        return [i for batch in list(self.batches.values()) for i in batch]


STORE_LINES = {"checked": (CHECKED,), "no-page-left": (ENOSPC, EIO), "one-page-left": (EIO, ENOSPC)}
"""What the agent's line names. A group is several overflow pages written at the end of the file, so with no
page left its first write usually fails outright (ENOSPC) and with one its write is short (EIO); a smaller
commit that lands first (an outbox entry) can take the last page and turn one into the other, so either is
a full disk here (tests/integration/test_full_disk.py provokes each deterministically)."""


@pytest.mark.parametrize("case", FILLS)
def test_a_full_disk_under_the_agent_store_is_charged_to_no_prompt_and_loses_nothing(
    disk, make_cluster, monkeypatch, case
):
    """Red if: a commit that found the disk full (refused by the check, ENOSPC, or EIO from a write
    that ran out part-way) is charged to its prompt (a failed lease, a prompt filtered); the agent
    keeps running, dies with a traceback, or says anything but the one line naming the store's disk;
    or after space is freed a group committed before the stop is lost, delivered twice or changed,
    or a batch given before is given again with other groups."""
    leave, unchecked = FILLS[case]
    cluster = make_cluster(rows=400, dynamic_filter="none", max_new_tokens=256, prefetch=16)
    cluster.start_coordinator("--metrics-port", "0")
    base = metrics_url(cluster.coordinator)
    data_dir = disk / "a1"
    start = lambda: cluster.start_agent("a1", "--data-dir", str(data_dir), sim_args=BIG)  # noqa: E731
    agent = with_faults(monkeypatch, "no_space_check=1" if unchecked else None, start)
    trainer = Trainer(cluster)
    trainer.start()
    wait_for(lambda: len(trainer.batches) >= 2 or trainer.errors, 60, "batches to flow")
    fill(disk, leave)
    assert agent.wait(60) == 1
    assert_disk_line(agent.text(), "agent store", data_dir / "store", STORE_LINES[case])
    before = committed_groups(data_dir)
    assert failed_leases(base) == 0, "a commit on a full disk was charged to its prompt"
    status = cluster.status()
    assert status["filtered_total"] == 0 and status["prompts"]["filtered"] == 0, status
    assert status["starved"] is None, status
    given_before = dict(trainer.batches)
    unfill(disk)
    cluster.start_agent("a1", "--data-dir", str(data_dir), sim_args=BIG)
    wait_for(lambda: set(before) <= set(trainer.delivered()) or trainer.errors, 120, "the stored groups")
    trainer.finish()
    delivered = trainer.delivered()
    assert len(delivered) == len(set(delivered)), "a group was delivered twice"
    got = {i: t for batch in trainer.batches.values() for i, t in batch.items()}
    for index, group in before.items():  # the very groups committed before the stop, not regenerated ones
        assert got[index] == [list(s.response_tokens) for s in group.samples]
    with cluster.client() as client:  # batches given before the stop are recorded: asked again, the same
        for step, batch in given_before.items():
            assert tokens(client.generate(step).groups) == batch
    assert failed_leases(base) == 0


LEDGER_LINES = {"checked": (CHECKED,), "no-page-left": (ENOSPC, EIO), "one-page-left": (EIO, ENOSPC)}
"""What the coordinator's line names. Ledger commits are a few small pages, often a page freed at the end
of the file and rewritten in the same write as new ones: with no page left that write is short too (EIO),
and with one page left a one-page commit may fit and the next fail outright (ENOSPC, seen in a CI run), so
either is a full disk here; tests/integration/test_full_disk.py provokes each on a ledger."""


@pytest.mark.parametrize("case", FILLS)
def test_a_full_disk_under_the_coordinator_ledger_stops_it_in_one_line_and_loses_nothing(
    disk, make_cluster, monkeypatch, case
):
    """Red if: a ledger write that found the disk full (refused by the check, ENOSPC, or EIO from a
    write that ran out part-way) ends the coordinator with a traceback or without its one line naming
    the ledger's disk, or it keeps serving; or after space is freed a batch the trainer was given is
    given again with other groups, a group is delivered twice, or a prompt was filtered."""
    leave, unchecked = FILLS[case]
    cluster = make_cluster(rows=400, dynamic_filter="none")
    data_dir = disk / "coordinator"
    start = lambda: cluster.start_coordinator("--data-dir", str(data_dir))  # noqa: E731
    coordinator = with_faults(monkeypatch, "no_space_check=1" if unchecked else None, start)
    cluster.start_agent("a1", sim_args=FIXED)
    trainer = Trainer(cluster)
    trainer.start()
    wait_for(lambda: len(trainer.batches) >= 2 or trainer.errors, 60, "batches to flow")
    fill(disk, leave)
    assert coordinator.wait(60) == 1
    assert_disk_line(coordinator.text(), "coordinator ledger", data_dir / "ledger", LEDGER_LINES[case])
    given_before = dict(trainer.batches)
    assert not [k for k, s in read_ledger(data_dir).prompts.items() if s.status == FILTERED]
    unfill(disk)
    cluster.start_coordinator("--data-dir", str(data_dir))
    wait_for(lambda: len(trainer.batches) >= len(given_before) + 3 or trainer.errors, 120, "batches again")
    trainer.finish()
    delivered = trainer.delivered()
    assert len(delivered) == len(set(delivered)), "a group was delivered twice"
    with cluster.client() as client:  # batches given before the stop are recorded: asked again, the same
        for step, batch in given_before.items():
            assert tokens(client.generate(step).groups) == batch
    status = cluster.status()
    assert status["filtered_total"] == 0 and status["prompts"]["filtered"] == 0, status
    assert status["agents"]["a1"]["status"] == "alive", status


def test_an_engine_restart_on_a_full_disk_under_its_log_waits_for_space_and_the_agent_stays_up(tmp_path, make_cluster):
    """Red if: an engine that dies while the disk under its log is full takes the agent down (a traceback
    out of the supervisor, as a chaos run once saw), its failed restart does not say which log could not be
    written, the restarts that could not start it are charged to its budget (with ``--max-restarts 2`` the
    disk stays full past three tries: a charged engine would be retired), or once space is freed the engine
    does not come back and serve."""
    import os
    import signal

    cluster = make_cluster(rows=64, dynamic_filter="none")
    data_dir = tmp_path / "a1"
    with small_disk_or_skip(data_dir / "logs") as disk:  # the engines' logs alone: the store keeps its space
        cluster.start_coordinator()
        agent = cluster.start_agent("a1", "--data-dir", str(data_dir), "--max-restarts", "2", engines=2, sim_args=FIXED)
        logs = sorted(disk.glob("*.log"))
        assert len(logs) == 2, logs
        for log in logs:  # each log's last page full: the restart's first line needs a new page
            with open(log, "ab") as f:
                f.write(b"#" * (-log.stat().st_size % PAGE))
        fill(disk, 0)
        os.kill(cluster.engine_pids_of("a1")[0], signal.SIGKILL)
        wait_for(lambda: "cannot write its log" in agent.text() or not agent.alive(), 30, "the failed restart")
        assert agent.alive(), agent.text()[-3000:]
        line = next(line for line in agent.text().splitlines() if "cannot write its log" in line)
        assert str(disk) in line and "No space left on device" in line, line
        time.sleep(7)  # three tries or more at one each 2 s, charged to no budget
        assert "retired" not in agent.text(), agent.text()[-3000:]
        unfill(disk)
        wait_for(lambda: "healthy again" in agent.text() or not agent.alive(), 60, "the engine back")
        assert agent.alive() and "Traceback" not in agent.text(), agent.text()[-3000:]
        with cluster.client() as client:
            assert len(client.generate(0).groups) == 8
        cluster.stop_all()  # before the disk goes: its engines hold their logs open
