"""Coordinator-side faults of issue 3, each on a real loopback cluster.

Every test asserts what a user would notice, not timings:
- no dataset index is ever delivered twice (within the run's one data epoch);
- a recorded batch replays identically (same groups, same samples);
- nothing the coordinator acknowledged is lost: every group an agent holds as
  acknowledged is recorded in the coordinator's ledger under the same key, and
  every group the ledger records as ready/delivered is still on its agent;
- every prompt is delivered, filtered or pending (ledger vs. trainer view).

Readiness is always polled (``wait_for``); processes are tracked by pid
through the harness. The agent and coordinator LMDBs are opened read-only
from this process to prove what is durable where.
"""

from __future__ import annotations

import json
import signal
import sys
import textwrap
import threading
from dataclasses import astuple
from pathlib import Path

import lmdb

from coordinator.client_stats import AgentInfo
from coordinator.ledger import read_ledger as read_coordinator_ledger
from coordinator.records import LedgerSnapshot
from harness.polling import wait_for
from harness.proxy import TcpProxy

# ~1 s per group: work is reliably in flight when a fault is injected.
SLOW = "--token-latency-ms 20 --output-len-dist fixed --output-len-median 48"
MEDIUM = "--token-latency-ms 6 --output-len-dist fixed --output-len-median 48"


# --------------------------------------------------------------------------- helpers


def group_id(g) -> tuple:
    """What makes a delivered group *that* group: prompt, producer and every sample."""
    return (g.data_epoch, g.index, g.agent_id, tuple(tuple(s.response_tokens) for s in g.samples))


def batch_ids(batch) -> list[tuple]:
    return [group_id(g) for g in batch.groups]


def assert_no_index_twice(batches) -> set[int]:
    seen: dict[tuple[int, int], int] = {}
    for rid, batch in sorted(batches.items()):
        assert len(batch.groups) == 8, f"batch {rid} has {len(batch.groups)} groups"
        for g in batch.groups:
            key = (g.data_epoch, g.index)
            assert key not in seen, (
                f"dataset index {g.index} (epoch {g.data_epoch}) delivered in batch {seen[key]} "
                f"and again in batch {rid}"
            )
            seen[key] = rid
    return {i for _, i in seen}


def _read_env(path, dbs: list[bytes]) -> dict[bytes, dict[bytes, bytes]]:
    """One consistent read-only snapshot of some named databases of an LMDB env."""
    env = lmdb.open(str(path), readonly=True, max_dbs=4, lock=True, create=False)
    try:
        handles = {name: env.open_db(name, create=False) for name in dbs}
        with env.begin(buffers=False) as txn:
            return {name: dict(txn.cursor(db=h)) for name, h in handles.items()}
    finally:
        env.close()


def read_store(cluster, agent: str) -> tuple[set[str], set[str]]:
    """An agent's store: (keys of groups held, keys whose receipt is unacknowledged)."""
    snap = _read_env(cluster.tmp / agent / "store", [b"groups", b"outbox"])
    return {k.decode() for k in snap[b"groups"]}, {k.decode() for k in snap[b"outbox"]}


def read_ledger(cluster) -> LedgerSnapshot:
    """The coordinator's ledger, typed (readable while the coordinator runs)."""
    return read_coordinator_ledger(cluster.tmp / "coordinator")


def assert_ledger_matches_stores(cluster, agents, *, trimmed_indices=frozenset()):
    """Nothing accepted is lost, nothing is held twice.

    - a group an agent holds as acknowledged (not in its outbox) is recorded in
      the ledger as ready/delivered from that agent under the same key;
    - a group the ledger records as ready/delivered is on its agent (unless a
      checkpoint trimmed it);
    - no prompt is held acknowledged by two agents.
    """
    prompts = read_ledger(cluster).prompts
    holders: dict[tuple[int, int], str] = {}
    held_keys: dict[str, set[str]] = {}
    for agent in agents:
        groups, outbox = read_store(cluster, agent)
        held_keys[agent] = groups
        for key in groups - outbox:
            epoch, index, _ = key.split(":")
            pk = (int(epoch), int(index))
            assert pk not in holders, f"prompt {pk} is held acknowledged by {holders[pk]} and {agent}"
            holders[pk] = agent
            st = prompts.get(pk)
            assert st is not None and (st.ready or st.delivered), (
                f"{agent} holds acknowledged group {key} the ledger does not record ({st})"
            )
            assert st.key == key and st.agent_id == agent, (
                f"{agent} holds {key} but the ledger accepted {st.key} from {st.agent_id}"
            )
    for pk, st in prompts.items():
        if (st.ready or st.delivered) and pk[1] not in trimmed_indices:
            held = held_keys.get(st.agent_id, set())
            assert st.key in held, f"ledger records {st.key} on {st.agent_id} but the agent lost it"


def stop(proc, sig=signal.SIGTERM, timeout: float = 30) -> int:
    proc.signal(sig)
    return proc.wait(timeout)


def stop_cluster(cluster) -> None:
    """Coordinator first (no ack can arrive after it), then every agent at once."""
    assert stop(cluster.coordinator) == 0
    procs = list(cluster.agents.values())
    for proc in procs:
        proc.signal(signal.SIGTERM)
    for proc in procs:
        proc.wait(30)


def sessions(watch) -> dict[str, int]:
    """Each agent's fencing session, as the coordinator's status shows it now."""
    return {name: entry.session for name, entry in watch.stats().agents.items()}


def wait_registered_again(watch, name: str, old_session: int, timeout: float = 30) -> AgentInfo:
    """Wait until the status lists ``name`` alive under a session other than ``old_session``.

    Sessions are never reused, across coordinator restarts too (membership.py), so a new one is
    a registration that happened after ``old_session`` was read.
    """

    def again():
        entry = watch.stats().agents.get(name)
        return entry if entry and entry.status == "alive" and entry.session not in (0, old_session) else None

    return wait_for(again, timeout, f"{name} to register again")


def stopped(pid: int) -> bool:
    """True once every thread of ``pid`` is stopped by a signal (delivery is asynchronous)."""
    states = []
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that just exited
    return bool(states) and all(state == "T" for state in states)


def regenerated(procs) -> list[str]:
    """Groups an agent generated for nothing: the coordinator refused them as duplicates."""
    return [line for proc in procs for line in proc.text().splitlines() if "coordinator refused group" in line]


# A restarted coordinator keeps prompts that were in flight for their agents for
# one TTL; make it comfortably longer than re-registration on a loaded CI box.
RESTART_TTL = ("--agent-ttl", "5")


class TrainerLoop(threading.Thread):
    """Pulls rollouts ``first .. last`` in the background; keeps batches or the error."""

    def __init__(self, client, rollout_ids):
        super().__init__(daemon=True)
        self.client = client
        self.rollout_ids = list(rollout_ids)
        self.batches: dict = {}
        self.error: BaseException | None = None

    def run(self):
        try:
            for rid in self.rollout_ids:
                self.batches[rid] = self.client.generate(rid)
        except BaseException as exc:  # reported by finish()
            self.error = exc

    def finish(self, timeout: float = 60) -> dict:
        self.join(timeout)
        assert not self.is_alive(), f"trainer stuck after {sorted(self.batches)}"
        if self.error is not None:
            raise self.error
        return self.batches


# --------------------------------------------------------------------------- (1) SIGSTOP


def test_stopped_agent_has_its_leases_held_then_is_fenced_and_delivers_nothing_twice(make_cluster):
    cluster = make_cluster(dynamic_filter="none")
    cluster.start_coordinator()
    # a1's groups take about 3 s: leases seen in the stats are still held when it is stopped, also when the
    # stats lag on a loaded machine.
    a1 = cluster.start_agent("a1", sim_args=SLOW.replace("-ms 20", "-ms 60"))
    cluster.start_agent("a2", sim_args=SLOW)
    watch = cluster.client(attach=False)
    trainer = TrainerLoop(cluster.client(), range(6))
    trainer.start()

    wait_for(lambda: watch.stats().agents["a1"].leases > 0, 30, "a1 to hold leases")
    before = sessions(watch)["a1"]
    a1.signal(signal.SIGSTOP)
    try:
        # Silent past the TTL: presumed dead. Its leases are held for it (not re-leased, so its
        # groups are not generated twice), while a2 takes the work the batches need.
        def held():
            s = watch.stats()
            a = s.agents
            return a["a1"].status == "dead" and s.held > 0 and a["a2"].leases > 0

        wait_for(held, 20, "a1's leases held while a2 generates")
    finally:
        a1.signal(signal.SIGCONT)
    # It comes back, is fenced and registers again (reporting what it committed meanwhile).
    wait_registered_again(watch, "a1", before)
    batches = trainer.finish()
    delivered = assert_no_index_twice(batches)
    # Recorded batches replay identically, to a new trainer too.
    with cluster.client() as other:
        for rid in (0, 3, 5):
            assert batch_ids(other.generate(rid)) == batch_ids(batches[rid])
    s = watch.stats()
    assert s.prompts.delivered == len(delivered)
    assert sum(astuple(s.prompts)) == 400
    stop_cluster(cluster)
    assert_ledger_matches_stores(cluster, ["a1", "a2"])


# --------------------------------------------------------------------------- (3) coordinator SIGKILL


def test_coordinator_sigkill_restart_loses_and_duplicates_nothing(make_cluster):
    cluster = make_cluster(dynamic_filter="none", prefetch=0)
    coordinator = cluster.start_coordinator()
    agents = {name: cluster.start_agent(name, sim_args=SLOW) for name in ("a1", "a2")}
    client = cluster.client()
    batches = {rid: client.generate(rid) for rid in range(2)}
    watch = cluster.client(attach=False)

    in_flight = TrainerLoop(client, [2, 3])
    in_flight.start()
    wait_for(
        lambda: watch.stats().batches.pending_generates == 1 and len(in_flight.batches) == 0,
        30,
        "generate(2) to be waiting on the coordinator",
    )
    before = sessions(watch)
    # Stopped, the coordinator can record nothing more: a batch 2 it has not recorded (persist,
    # then reply) has not been answered, and the SIGKILL finds generate(2) in flight for certain.
    coordinator.signal(signal.SIGSTOP)
    wait_for(lambda: stopped(coordinator.pid), 10, "the coordinator to stop")
    assert 2 not in read_ledger(cluster).batches, "batch 2 was recorded before the kill: slow the engines down"
    stop(coordinator, signal.SIGKILL)
    cluster.start_coordinator(*RESTART_TTL)

    # The call in flight during the kill completes; agents re-register after backoff.
    batches.update(in_flight.finish())
    for name in agents:
        wait_registered_again(watch, name, before[name])
    batches.update({rid: client.generate(rid) for rid in (4, 5)})
    delivered = assert_no_index_twice(batches)
    # Batches recorded before the kill replay identically after it (asked again by the
    # same trainer: a second trainer attaching would fence this one).
    for rid in range(4):
        assert batch_ids(client.generate(rid)) == batch_ids(batches[rid]), f"batch {rid} changed across the restart"
    s = watch.stats()
    assert s.prompts.delivered == len(delivered)
    assert sum(astuple(s.prompts)) == 400
    # Work in flight at the kill was adopted back by its agents, not generated a second time.
    assert not regenerated(agents.values())

    # A trainer checkpointing across a crash: paused and drained before the kill,
    # still paused and drained after it, so state_dict() just works.
    client.pause(drain=True)
    stop(cluster.coordinator, signal.SIGKILL)
    cluster.start_coordinator(*RESTART_TTL)
    state = client.state_dict()
    assert state["rollout_id"] == 5
    assert watch.stats().paused
    batches[6] = client.generate(6)  # generating again resumes admission
    delivered = assert_no_index_twice(batches)
    stop_cluster(cluster)
    assert_ledger_matches_stores(
        cluster, list(agents), trimmed_indices={g.index for rid in range(6) for g in batches[rid].groups}
    )


# --------------------------------------------------------------------------- (5) trainer checkpoint


TRAINER = textwrap.dedent(
    """
    import json, sys, time
    from common.errors import StateError
    from coordinator.client import RolloutClient

    address, mode, state_path, out_path = sys.argv[1:5]

    def ids(batch):
        return [[g.data_epoch, g.index, g.agent_id, [list(s.response_tokens) for s in g.samples]] for g in batch.groups]

    with RolloutClient(address, timeout=60, retry_interval=0.5) as client:
        out = {}
        if mode == "first":
            for rid in range(4):
                out[rid] = ids(client.generate(rid))
            try:
                client.state_dict()
                refused = ""
            except StateError as exc:
                refused = str(exc)
            client.pause(drain=True)
            state = client.state_dict()
            with open(state_path, "w") as f:
                json.dump(state, f)  # plain JSON data, or this raises
            client.resume()
            for rid in (4, 5):
                out[rid] = ids(client.generate(rid))
            client.pause(drain=True)  # e.g. to save the next checkpoint
            with open(out_path, "w") as f:
                json.dump({"batches": out, "refused": refused}, f)
            print("CHECKPOINTED", flush=True)
            time.sleep(600)  # the test SIGKILLs the trainer here, paused
        else:
            with open(state_path) as f:
                client.load_state_dict(json.load(f))
            for rid in (4, 5, 6, 7):
                out[rid] = ids(client.generate(rid))
            # The next checkpoint trims what is behind the previous one (rollout 3):
            # until this one is taken, a trainer dying mid-save can still go back to 3.
            client.pause(drain=True)
            client.state_dict()
            client.resume()
            with open(out_path, "w") as f:
                json.dump({"batches": out}, f)
            print("RESUMED", flush=True)
    """
)


def test_killed_trainer_resumes_from_checkpoint_and_consumed_payloads_are_trimmed(make_cluster):
    cluster = make_cluster(dynamic_filter="none")
    cluster.start_coordinator()
    cluster.start_agent("a1", sim_args=MEDIUM)
    cluster.start_agent("a2", sim_args=MEDIUM)
    script = cluster.tmp / "trainer.py"
    script.write_text(TRAINER)
    state_path, out1, out2 = (cluster.tmp / n for n in ("state.json", "first.json", "second.json"))

    first = cluster._spawn(
        "trainer-first", [sys.executable, str(script), cluster.address, "first", str(state_path), str(out1)]
    )
    wait_for(lambda: "CHECKPOINTED" in first.text() or not first.alive(), 60, "the first trainer to checkpoint")
    assert first.alive(), first.text()
    stop(first, signal.SIGKILL)  # dies paused, after consuming 4..5 past its checkpoint
    state = json.loads(state_path.read_text())
    assert state["rollout_id"] == 3
    before = json.loads(out1.read_text())
    assert "paused and drained" in before["refused"], "state_dict while running must be refused clearly"

    second = cluster._spawn(
        "trainer-second", [sys.executable, str(script), cluster.address, "second", str(state_path), str(out2)]
    )
    assert second.wait(60) == 0, second.text()
    after = json.loads(out2.read_text())["batches"]
    # Batches delivered after the checkpoint come again, with the same groups and samples;
    # then generation goes on although the dead trainer left the rollout paused.
    for rid in ("4", "5"):
        assert after[rid] == before["batches"][rid], f"batch {rid} differs after resuming from the checkpoint"
    consumed = {(e, i) for rid in "0123" for e, i, _, _ in before["batches"][rid]}
    later = [(e, i) for rid in "4567" for e, i, _, _ in after[rid]]
    assert len(later) == len(set(later)) == 32
    assert not consumed & set(later), "a group consumed before the checkpoint came back"

    # The trainer's view says the same as the ledger will: the second trainer's checkpoint trimmed up to batch 3.
    batches = cluster.client(attach=False).stats().batches
    assert (batches.trimmed_upto, batches.last_rollout_id, batches.consumed_upto) == (3, 7, 7), batches

    # Payloads behind the previous checkpoint are gone from the agents; later ones stay.
    stop_cluster(cluster)
    held = {}
    for name in cluster.agents:
        groups, _ = read_store(cluster, name)
        held.update({(int(k.split(":")[0]), int(k.split(":")[1])): k for k in groups})
    assert not consumed & set(held), f"consumed groups still stored: {sorted(consumed & set(held))[:5]}"
    assert set(later) <= set(held)
    ledger = read_ledger(cluster)
    assert ledger.trimmed_upto == 3
    assert sorted(ledger.batches) == [4, 5, 6, 7]
    assert_ledger_matches_stores(cluster, list(cluster.agents), trimmed_indices={i for _, i in consumed})


# --------------------------------------------------------------------------- (8) partition


def test_partitioned_agent_is_presumed_dead_and_its_late_receipts_create_no_duplicates(make_cluster):
    cluster = make_cluster(dynamic_filter="none")
    cluster.start_coordinator()
    proxy = TcpProxy("127.0.0.1", cluster.port)
    try:
        # The cut-off agent's groups take about 3 s, so one seen generating is still generating when the
        # partition starts, also on a loaded machine whose stats lag a second behind.
        cluster.start_agent("cut", "--coordinator", proxy.address, sim_args=SLOW.replace("-ms 20", "-ms 60"))
        cluster.start_agent("direct", sim_args=SLOW)
        watch = cluster.client(attach=False)  # the trainer connects directly
        trainer = TrainerLoop(cluster.client(), range(6))
        trainer.start()

        def generating() -> bool:
            # Leases granted by the coordinator, and work the agent reports on its engines: the grant
            # reached it before the partition (a grant still in flight is lost with it, and the agent
            # would have nothing to commit while cut off).
            cut = watch.stats().agents["cut"]
            return cut.leases > 0 and sum(e.get("in_flight", 0) for e in cut.engines) > 0

        wait_for(generating, 30, "the cut-off agent to hold leases and generate them")
        before, connections = sessions(watch)["cut"], proxy.connections
        proxy.partition()

        def held():
            # Presumed dead: its leases are held for it (not generated again elsewhere) while the
            # direct agent takes the work the batches need.
            s = watch.stats()
            a = s.agents
            return a["cut"].status == "dead" and s.held > 0 and a["direct"].leases > 0

        wait_for(held, 20, "the cut-off agent's leases held while the direct agent generates")
        # Alive but cut off, it keeps committing groups whose receipts cannot arrive,
        # and gives up on its connection: it reconnects and registers into the void.
        wait_for(lambda: read_store(cluster, "cut")[1], 30, "the cut-off agent to commit groups during the partition")
        # A new connection through the proxy is the agent's new socket (the old one stays open).
        wait_for(lambda: proxy.connections > connections, 20, "the cut-off agent to notice the silence")
        # Healing delivers the old connection's held bytes (receipts and heartbeats of
        # the fenced session) late, racing the agent's new registration.
        proxy.heal()

        wait_registered_again(watch, "cut", before)
        batches = trainer.finish()
        delivered = assert_no_index_twice(batches)
        s = watch.stats()
        assert s.prompts.delivered == len(delivered)
        assert sum(astuple(s.prompts)) == 400
        with cluster.client() as other:
            assert batch_ids(other.generate(2)) == batch_ids(batches[2])
        stop_cluster(cluster)
        assert_ledger_matches_stores(cluster, list(cluster.agents))
    finally:
        proxy.close()


# --------------------------------------------------------------------------- (9) SIGTERM


def test_sigterm_flushes_the_ledger_and_restart_resumes_with_everything(make_cluster):
    cluster = make_cluster(dynamic_filter="none")
    coordinator = cluster.start_coordinator()
    cluster.start_agent("a1", sim_args=MEDIUM)
    cluster.start_agent("a2", sim_args=MEDIUM)
    client = cluster.client()
    watch = cluster.client(attach=False)
    trainer = TrainerLoop(client, range(8))
    trainer.start()
    wait_for(lambda: len(trainer.batches) >= 2 and watch.stats().leased > 0, 60, "receipts to be flowing")

    assert stop(coordinator, signal.SIGTERM) == 0, coordinator.text()[-3000:]
    assert len(trainer.batches) < 8, "the trainer must have a call in flight across the restart"
    assert "flushing the ledger" in coordinator.text()
    # With the coordinator gone, everything it acknowledged to an agent is in its ledger.
    assert_ledger_matches_stores(cluster, ["a1", "a2"])
    at_exit = read_ledger(cluster)
    recorded = at_exit.batches
    assert recorded, "batches recorded before the shutdown must be durable"

    cluster.start_coordinator(*RESTART_TTL)
    batches = trainer.finish()  # calls in progress retried against the new process
    delivered = assert_no_index_twice(batches)
    with cluster.client() as other:
        for rid in sorted(recorded):
            assert batch_ids(other.generate(rid)) == batch_ids(batches[rid])
    assert watch.stats().prompts.delivered == len(delivered)
    stop_cluster(cluster)
    final = read_ledger(cluster).prompts
    for pk, st in at_exit.prompts.items():
        lost = f"prompt {pk} accepted before SIGTERM was lost: {st} -> {final.get(pk)}"
        assert pk in final and final[pk].key == st.key, lost
    # Leases in flight at the shutdown went back to their agents; nothing was generated twice.
    assert not regenerated(cluster.agents.values())
