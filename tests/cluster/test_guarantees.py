"""Each guarantee of docs/concepts/guarantees.md, made to fail for real: a fault is injected (common/faults.py,
``ROLLFLEET_FAULTS`` set for the one process that must misbehave), and the test asserts what
only the mechanism under test can produce.

- Commit before receipt, recovery at registration (1, 2): an agent that SIGKILLs itself before a
  commit or between a commit and its receipt, restarted again and again with the coordinator
  running: the ledger never refers to a group the agent did not store, and every group it held
  unacknowledged is recorded under its own key and trained on, never regenerated.
- Receipts lost in flight (2): answered by the agent's resend, not by a re-registration.
- Fencing (5): messages of a session presumed dead are refused (the coordinator counts each
  ``Fence`` it sends, by message type) and the agent registers again because it was fenced.
- Groups a trainer fetched are never generated again (2): the batch asked for AGAIN after its
  node was retired is completed with fresh prompts only, and the epoch closes without them.
- Heartbeat repair (lost messages): a lost Grant's prompts are released and generated; a lost
  pause still pauses the agent.

A test that must show that something does NOT happen waits for a positive signal that would
have come after it (a re-registration, an epoch closing, the prefetch filling up).
"""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import lmdb
import msgpack

from common.faults import ENV
from common.types import Group
from coordinator.ledger import read_ledger
from harness.polling import wait_for

FAST = "--token-latency-ms 2 --output-len-dist fixed --output-len-median 16"
SLOW = "--token-latency-ms 20 --output-len-dist fixed --output-len-median 48"  # ~1 s per group


# ---------------------------------------------------------------------------- helpers


def with_faults(monkeypatch, spec: str, start):
    """Run ``start()`` (which spawns one process) with ``ROLLFLEET_FAULTS=spec`` in its environment."""
    monkeypatch.setenv(ENV, spec)
    try:
        return start()
    finally:
        monkeypatch.delenv(ENV)


def read_store(data_dir: Path) -> tuple[dict[str, bytes], dict[str, dict]]:
    """An agent's store, read from outside: (group key -> payload, outbox key -> receipt)."""
    env = lmdb.open(str(data_dir / "store"), readonly=True, max_dbs=4, lock=True, create=False)
    try:
        groups_db = env.open_db(b"groups", create=False)
        outbox_db = env.open_db(b"outbox", create=False)
        with env.begin(buffers=False) as txn:
            groups = {k.decode(): v for k, v in txn.cursor(db=groups_db)}
            outbox = {k.decode(): msgpack.unpackb(v, raw=False) for k, v in txn.cursor(db=outbox_db)}
    finally:
        env.close()
    return groups, outbox


def registrations(proc) -> list[int]:
    """Receipts recovered at each registration of this agent process, in order."""
    return [
        int(n)
        for n in re.findall(r"registered \(session \w+, capacity \d+ samples, (\d+) receipts recovered\)", proc.text())
    ]


def prompt(g) -> tuple[int, int]:
    return (g.data_epoch, g.index)


class Trainer(threading.Thread):
    """Pulls batches 0, 1, 2, ... in the background until ``stop()``; checks each as it arrives."""

    def __init__(self, client, size: int):
        super().__init__(daemon=True, name="trainer")
        self.client = client
        self.size = size
        self.groups: dict[tuple[int, int], Group] = {}
        self.twice: list[tuple[int, int]] = []
        self.error: BaseException | None = None
        self._halt = threading.Event()

    def run(self):
        try:
            rid = 0
            while not self._halt.is_set():
                batch = self.client.generate(rid)
                assert len(batch.groups) == self.size, f"short batch {rid}"
                for g in batch.groups:
                    if prompt(g) in self.groups:
                        self.twice.append(prompt(g))
                    self.groups[prompt(g)] = g
                rid += 1
        except BaseException as exc:  # reported by stop()
            self.error = exc

    def stop(self, timeout: float = 60) -> None:
        self._halt.set()
        self.join(timeout)
        assert not self.is_alive(), "the trainer is stuck"
        if self.error is not None:
            raise self.error
        assert not self.twice, f"prompts delivered twice: {self.twice}"


def assert_ledger_refers_only_to_stored_groups(cluster, agent: str) -> None:
    """Commit before receipt: every group the ledger accepted from ``agent`` is in its store."""
    groups, _ = read_store(cluster.tmp / agent)
    for pk, st in read_ledger(cluster.tmp / "coordinator").prompts.items():
        if (st.ready or st.delivered) and st.agent_id == agent:
            assert st.key in groups, f"the ledger accepted {st.key} for {pk} but {agent} never stored it"


# ---------------------------------------------------------------------------- (1, 2) kill between commit and receipt


def test_agent_killed_between_commit_and_receipt_has_every_group_recovered_at_registration(make_cluster, monkeypatch):
    """The agent dies right before a commit, between a commit and its receipt, or (every third run) at a
    random moment; the coordinator is never stopped, so a receipt the agent never sent can only arrive in
    its next Register. After every death the ledger refers only to groups the agent stored."""
    cluster = make_cluster(dynamic_filter="none")
    cluster.start_coordinator()
    data_dir = cluster.tmp / "a1"
    trainer = Trainer(cluster.client(fetch_timeout=2, timeout=120), cluster.config["rollout_batch_size"])
    trainer.start()
    unacked_at_kill: dict[str, Group] = {}  # committed, receipt unanswered when the agent died
    recovered_expected: list[int] = []
    procs = []
    fault_kills = external_kills = 0
    rng = random.Random(12)
    loop_ends = time.monotonic() + 20
    i = 0
    while fault_kills < 3 or (i < 15 and time.monotonic() < loop_ends):
        assert i < 40, f"the agent killed itself only {fault_kills} times in {i} runs"
        i += 1
        external = i % 3 == 0  # every third run dies by an outside SIGKILL at a random moment instead
        spec = "seed=0" if external else f"kill_after_commit=0.3;kill_before_commit=0.1;seed={i}"
        base = len(read_store(data_dir)[0]) if data_dir.exists() else 0
        proc = with_faults(
            monkeypatch, spec, lambda: cluster.start_agent("a1", concurrency=16, sim_args=FAST, wait=False)
        )
        procs.append(proc)
        if external:
            target = base + rng.randint(1, 12)
            wait_for(
                lambda p=proc, n=target: not p.alive() or len(read_store(data_dir)[0]) >= n,
                30,
                "the agent to commit groups",
            )
            proc.signal(signal.SIGKILL)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.signal(signal.SIGKILL)
            proc.wait(10)
        if "fault injected: SIGKILL" in proc.text():
            fault_kills += 1
        elif external and proc.popen.returncode == -signal.SIGKILL:
            external_kills += 1
        assert_ledger_refers_only_to_stored_groups(cluster, "a1")
        groups, outbox = read_store(data_dir)
        assert set(outbox) <= set(groups), "an outbox entry without its group"
        for key in outbox:
            unacked_at_kill[key] = Group.from_wire(groups[key])
        recovered_expected.append(len(outbox))
    survivor = cluster.start_agent("a1", concurrency=16, sim_args=FAST)
    procs.append(survivor)
    # The coordinator lists the agent once it handles the Register; the agent logs its registration when
    # the Welcome comes back, a moment later (on a loaded machine, after the check below had read the log).
    wait_for(lambda: registrations(survivor), 30, "the survivor to log its registration")
    assert fault_kills >= 3 and external_kills >= 1 and unacked_at_kill

    # Each start recovered at registration exactly the receipts the previous process died with.
    for n, (before, proc) in enumerate(zip(recovered_expected, procs[1:], strict=True)):
        got = registrations(proc)
        assert got and got[0] == before, f"run {n + 2} recovered {got[:1]} receipts, {before} were unacknowledged"

    # Every group held unacknowledged at a kill is trained on as committed, under its own key.
    wanted = {prompt(g) for g in unacked_at_kill.values()}
    wait_for(lambda: wanted <= set(trainer.groups), 60, "every recovered group to reach the trainer")
    trainer.stop()
    ledger = read_ledger(cluster.tmp / "coordinator").prompts
    for key, group in unacked_at_kill.items():
        st = ledger.get(prompt(group))
        assert st is not None and st.delivered and st.key == key, f"{key} was not recorded; the ledger has {st}"
        assert trainer.groups[prompt(group)] == group, f"group {key} was regenerated instead of recovered"
    assert_ledger_refers_only_to_stored_groups(cluster, "a1")


# ---------------------------------------------------------------------------- (2) receipts lost in flight


def test_receipts_lost_in_flight_are_resent_and_answered_without_a_new_registration(make_cluster, monkeypatch):
    cluster = make_cluster(dynamic_filter="none")
    cluster.start_coordinator()
    agent = with_faults(
        monkeypatch, "drop_receipts=3", lambda: cluster.start_agent("a1", concurrency=16, sim_args=FAST)
    )
    with cluster.client() as client:
        batches = [client.generate(0)]
        dropped = wait_for(
            lambda: (
                (keys := re.findall(r"fault injected: dropped Receipt (\S+)", agent.text())) and len(keys) == 3 and keys
            ),
            20,
            "three receipts to be lost",
        )
        # Answered while the session lives on: the resend did it, not a Register.
        wait_for(
            lambda: not set(dropped) & set(read_store(cluster.tmp / "a1")[1]), 15, "the lost receipts to be answered"
        )
        assert registrations(agent) == [0], "the agent registered again: the resend did not answer the receipts"
        groups = read_store(cluster.tmp / "a1")[0]
        ledger = read_ledger(cluster.tmp / "coordinator").prompts
        for key in dropped:
            epoch, index, _ = key.split(":")
            st = ledger[(int(epoch), int(index))]
            # Accepted as resent, or (its lease was released and regenerated first) refused and deleted.
            assert st.key == key or key not in groups, f"{key}: held by the agent, but the ledger has {st.key}"
        wanted = {(int(k.split(":")[0]), int(k.split(":")[1])) for k in dropped}
        rid = 1
        while not wanted <= {prompt(g) for b in batches for g in b.groups}:
            assert rid < 8, "the prompts of lost receipts were never delivered"
            batches.append(client.generate(rid))
            rid += 1
    seen = [prompt(g) for b in batches for g in b.groups]
    assert len(seen) == len(set(seen)), "a prompt delivered twice"


# ---------------------------------------------------------------------------- (5) fencing


def test_messages_of_a_session_presumed_dead_are_fenced_and_the_agent_registers_again(make_cluster, monkeypatch):
    """One-way partition: the agent hears the coordinator but what it sends is held until after the
    coordinator presumed it dead; then it all arrives, stale, before the agent's own silence timer
    (one TTL after the coordinator went quiet) could end the session."""
    cluster = make_cluster(dynamic_filter="none")
    cluster.start_coordinator("--agent-ttl", "3")
    hold = cluster.tmp / "hold"
    agent = with_faults(
        monkeypatch, f"hold_file={hold}", lambda: cluster.start_agent("a1", concurrency=16, sim_args=SLOW)
    )
    trainer = Trainer(cluster.client(timeout=120), cluster.config["rollout_batch_size"])
    trainer.start()
    watch = cluster.client(attach=False)
    wait_for(lambda: watch.stats().agents["a1"].leases > 0, 20, "a1 to hold leases")
    hold.touch()
    try:
        # Presumed dead, with receipts committed and sent under the old session (held).
        wait_for(lambda: watch.stats().agents["a1"].status == "dead", 15, "a1 to be presumed dead")
        wait_for(lambda: read_store(cluster.tmp / "a1")[1], 10, "a receipt sent while held")
    finally:
        hold.unlink()
    wait_for(lambda: len(registrations(agent)) >= 2, 20, "a1 to register again")
    fenced = watch.stats().fenced_messages
    assert fenced.get("receipt", 0) >= 1 and fenced.get("heartbeat", 0) >= 1, fenced
    reasons = re.findall(r"reconnecting to the coordinator: (\w+)", agent.text())
    assert reasons[0] == "fenced", f"the agent reconnected because {reasons}, not because it was fenced"
    assert registrations(agent)[1] >= 1, "the refused receipts were not recovered at the next registration"
    wait_for(lambda: len(trainer.groups) >= 32, 60, "the run to go on")
    trainer.stop()
    assert_ledger_refers_only_to_stored_groups(cluster, "a1")


# ---------------------------------------------------------------------------- (2) fetched groups never regenerated


def test_a_fetched_batch_asked_again_after_its_node_retired_gets_only_fresh_prompts(make_cluster):
    cluster = make_cluster(dynamic_filter="none", rows=48)
    cluster.start_coordinator("--retire-after", "3")
    cluster.start_agent("a1", concurrency=16, sim_args=FAST)
    with cluster.client(fetch_timeout=2) as client:
        first = client.generate(0)  # fetched: these prompts were trained on
        trained = {prompt(g) for g in first.groups}
        assert {g.agent_id for g in first.groups} == {"a1"}
        cluster.start_agent("a2", concurrency=16, sim_args=FAST)
        cluster.agents["a1"].signal(signal.SIGKILL)
        wait_for(lambda: client.stats().agents["a1"].status == "retired", 20, "a1 to be retired")
        again = client.generate(0)  # its groups are gone with a1: completed with replacements
        assert again.metrics["rollout/replaced_groups"] == len(first.groups)
        assert {g.agent_id for g in again.groups} == {"a2"}
        assert not trained & {prompt(g) for g in again.groups}, "a trained prompt was generated again"
        assert [prompt(g) for g in client.generate(0).groups] == [prompt(g) for g in again.groups]
        # Epoch 0 can close only once every one of its prompts is delivered or filtered: had the
        # trained prompts been reopened, they would have had to come again before that.
        seen = [prompt(g) for g in again.groups]
        rid = 1
        while 0 in client.stats().data_epochs:
            assert rid < 12, "epoch 0 never closed"
            seen += [prompt(g) for g in client.generate(rid).groups]
            rid += 1
        assert not trained & set(seen), f"trained prompts delivered again: {sorted(trained & set(seen))}"
        assert len(seen) == len(set(seen)), "a prompt delivered twice"


# ---------------------------------------------------------------------------- heartbeat repair


def test_a_lost_grant_is_released_by_heartbeat_reconciliation_and_its_prompts_generated(make_cluster, monkeypatch):
    cluster = make_cluster(dynamic_filter="none")
    with_faults(monkeypatch, "drop_grants=1", cluster.start_coordinator)
    cluster.start_agent("a1", concurrency=32, sim_args=FAST)
    m = wait_for(
        lambda: re.search(
            r"fault injected: dropped Grant \(session \w+\) of leases (\[.*\])", cluster.coordinator.text()
        ),
        10,
        "the first Grant to be lost",
    )
    lost = {(epoch, index) for _, epoch, index in json.loads(m.group(1))}
    assert lost
    with cluster.client(attach=False) as watch:
        prefetch = watch.stats().batches.prefetch
        # No trainer: admission stops once the prefetch is ready. It fills up only if the
        # lost leases were released (the heartbeat told the agent the highest lease granted).
        wait_for(
            lambda: (s := watch.stats()).batches.ready == prefetch and s.leased == 0,
            20,
            "the prefetch to fill despite the lost grant",
        )
    with cluster.client() as client:
        delivered = {prompt(g) for rid in range(2) for g in client.generate(rid).groups}
    assert lost <= delivered, f"prompts of the lost grant never delivered: {sorted(lost - delivered)}"


def test_a_lost_pause_still_pauses_the_agent_by_heartbeat(make_cluster, monkeypatch):
    """A paused agent gives back at once the leases that wait for an engine; the pause reaches it
    only through the coordinator's heartbeat (``paused``), since the Control is lost."""
    cluster = make_cluster(dynamic_filter="none")
    with_faults(monkeypatch, "drop_pauses=1", cluster.start_coordinator)
    engine, url = cluster.start_sim_engine(
        "--token-latency-ms", "50", "--output-len-dist", "fixed", "--output-len-median", "200"
    )
    cluster.start_agent("a1", concurrency=16, engine_urls=[url])  # a url engine is never retired
    with cluster.client(attach=False) as watch:

        def running() -> int:
            with urllib.request.urlopen(url + "/v1/loads", timeout=5) as resp:
                return json.loads(resp.read())["loads"][0]["num_running_reqs"]

        wait_for(lambda: watch.stats().leased > 0 and running() > 0, 20, "groups generating")
        engine.signal(signal.SIGKILL)
        # Its groups fail over to... no engine: they wait, held by the agent, for one to come back.
        wait_for(
            lambda: (s := watch.stats()).agents["a1"].capacity == 0 and s.leased > 0,
            20,
            "the agent's leases to wait for an engine",
        )
        with cluster.client() as trainer:
            trainer.pause(drain=False)
        wait_for(
            lambda: "fault injected: dropped pause Control" in cluster.coordinator.text(),
            5,
            "the pause Control to be lost",
        )
        wait_for(lambda: watch.stats().leased == 0, 5, "the paused agent to give its waiting leases back")
