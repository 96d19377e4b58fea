"""Silent network partitions (issue 22), on real packets: each agent in its own network namespace
behind a router namespace that drops its packets without a word (harness/netfault.py).

The fleet runs as a user runs it off loopback: CurveZMQ keys on, ``--heartbeat-interval 0.5
--agent-ttl 2 --retire-after 60``, a trainer pulling batches throughout. After each outage the
partitioned agent must be back (heard by the coordinator, alive, holding leases) within 2 s of the
heal, registered at most once, never retired, and every batch complete with no prompt delivered
twice. No group is refused as a duplicate: the leases of an agent presumed dead are held for it
(coordinator/admission.py), so what it made during the outage is accepted when it comes back
(``assert_none_refused``: the coordinator's receipt count and the agents' logs).

Also on the same topology: netem's impairments (delay, jitter, loss, reordering, duplication) on
one agent's link through the userspace TUN impairer (harness/tunimpair.py), and a partition of one
agent's payload endpoint only (the trainer's fetches retried for ``fetch_deadline``, then replaced).

Needs root, iproute2 and nftables (CI installs them: .ci/run), and /dev/net/tun for the impairer;
skipped elsewhere with the reason.
"""

from __future__ import annotations

import re
import threading
import time

import pytest

from harness.netfault import NetFault, NetFaultUnavailable, unavailable
from harness.polling import wait_for

SIM = "--token-latency-ms 5 --output-len-dist fixed --output-len-median 32"
LIVENESS = ("--heartbeat-interval", "0.5", "--agent-ttl", "2", "--retire-after", "60")
AGENTS = ("a0", "a1")
REGISTERED = re.compile(r"registered \(session \w+")
REFUSED = re.compile(r"coordinator refused (?:group \S+ \(duplicate|\d+ recovered groups)")
PAYLOAD_PORT = 7100
"""Each agent's payload endpoint port (in its own namespace): what a payload-only partition drops."""
BACK_WITHIN = 2.0
"""The issue's bound: seconds from the heal to the agent being heard, alive and granted again."""


@pytest.fixture
def net():
    why = unavailable()
    if why:
        pytest.skip(f"packet-level fault harness: {why}")
    try:
        made = NetFault.create(agents=len(AGENTS))
    except NetFaultUnavailable as exc:
        pytest.skip(f"packet-level fault harness: {exc}")
    try:
        yield made
    finally:
        made.close()
        assert not made.leftovers(), f"netfault left {made.leftovers()}"


class Trainer:
    """Pulls batches on a thread until stopped; checks each one as it arrives."""

    def __init__(self, client, size: int, n: int):
        self.client, self.size, self.n = client, size, n
        self.indices: set[int] = set()
        self.batches = 0
        self.replaced = 0
        """Groups replaced in the batches pulled (``rollout/replaced_groups``)."""
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="netfault-trainer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        rollout_id = 0
        try:
            while not self._stop.is_set():
                batch = self.client.generate(rollout_id)
                assert len(batch.groups) == self.size, f"short batch {rollout_id}: {len(batch.groups)} groups"
                for g in batch.groups:
                    assert g.index not in self.indices, f"dataset index {g.index} delivered twice (batch {rollout_id})"
                    assert len(g.samples) == self.n
                    self.indices.add(g.index)
                self.replaced += int(batch.metrics.get("rollout/replaced_groups", 0))
                self.batches += 1
                rollout_id += 1
        except BaseException as exc:  # reported by check(): a thread cannot fail the test itself
            self.error = exc

    def check(self) -> None:
        if self.error is not None:
            raise AssertionError(f"trainer failed: {self.error!r}") from self.error

    def stop(self, timeout: float = 120) -> None:
        self._stop.set()
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the trainer's last generate never returned"
        self.check()


def start_fleet(net, make_cluster):
    cluster = make_cluster(
        host=net.coordinator_host,
        rows=4000,
        curve_agents=AGENTS,
        curve_trainers=("trainer",),
        dynamic_filter="none",
        rollout_batch_size=4,
        prefetch=8,
    )
    cluster.start_coordinator(*LIVENESS)
    for i, name in enumerate(AGENTS):
        cluster.start_agent(
            name,
            "--payload-bind",
            f"tcp://{net.agent_host(i)}:{PAYLOAD_PORT}",
            concurrency=16,
            sim_args=SIM,
            wrap=lambda argv, i=i: net.agent_argv(i, argv),
        )
    return cluster


def outage(cluster, net, watch, trainer, seconds: float, direction: str = "both") -> dict:
    """Partition agent a0 for ``seconds``, heal, and return what the heal looked like."""
    proc = cluster.agents["a0"]
    wait_for(lambda: trainer.batches >= 2 or trainer.check(), 60, "two batches before the partition")
    registrations = len(REGISTERED.findall(proc.text()))
    seen = set()
    net.partition(0, direction)
    ends = time.monotonic() + seconds
    while time.monotonic() < ends:  # the outage itself; meanwhile, watch what the coordinator makes of a0
        seen.add(watch.stats().agents["a0"].status)
        trainer.check()
        time.sleep(min(0.5, max(0.0, ends - time.monotonic())))
    dropped = net.dropped(0)
    net.heal(0)
    healed = time.monotonic()

    def back():
        asked = time.monotonic()
        entry = watch.stats().agents["a0"]
        heard_after_heal = asked - entry.silent_s > healed
        return entry.status == "alive" and heard_after_heal and entry.leases > 0

    wait_for(back, BACK_WITHIN, f"a0 heard, alive and granted within {BACK_WITHIN}s of a {seconds}s outage's heal")
    back_s = time.monotonic() - healed
    batches = trainer.batches
    wait_for(lambda: trainer.batches >= batches + 3 or trainer.check(), 120, "three batches after the heal")
    return {
        "back_s": back_s,
        "registrations": len(REGISTERED.findall(proc.text())) - registrations,
        "seen": seen,
        "dropped": dropped,
    }


def refused(cluster) -> list[str]:
    return [line for name in AGENTS for line in cluster.agents[name].text().splitlines() if REFUSED.search(line)]


def assert_none_refused(cluster, watch) -> None:
    """No group was refused as a duplicate (wasted work): the coordinator counted none, no agent logged one."""
    receipts = watch.stats().receipts
    lines = refused(cluster)
    assert receipts["refused"] == 0 and not lines, f"groups refused as duplicates: {receipts}, {lines}"


@pytest.mark.parametrize("seconds", [1, 6, 15])
def test_a_silent_partition_of_one_agent_heals_within_2s_with_one_registration(net, make_cluster, seconds):
    cluster = start_fleet(net, make_cluster)
    watch = cluster.client(attach=False, timeout=10)
    trainer = Trainer(cluster.client(timeout=120, fetch_timeout=3), 4, cluster.config["n_samples_per_prompt"])
    try:
        healed = outage(cluster, net, watch, trainer, seconds)
    finally:
        trainer.stop()
    assert healed["dropped"] > 0, "the partition dropped no packet"
    assert healed["registrations"] <= 1, f"a0 registered {healed['registrations']} times for one outage"
    if seconds > 2:  # past the TTL both sides end the session: exactly one new one
        assert healed["registrations"] == 1
    assert "retired" not in healed["seen"]
    assert_none_refused(cluster, watch)


def test_a_40s_silent_partition_under_retire_after_60_leaves_the_agent_unretired(net, make_cluster):
    cluster = start_fleet(net, make_cluster)
    watch = cluster.client(attach=False, timeout=10)
    trainer = Trainer(cluster.client(timeout=180, fetch_timeout=3), 4, cluster.config["n_samples_per_prompt"])
    try:
        healed = outage(cluster, net, watch, trainer, 40)
    finally:
        trainer.stop()
    assert healed["seen"] >= {"dead"} and "retired" not in healed["seen"], healed["seen"]
    assert healed["registrations"] == 1, f"a0 registered {healed['registrations']} times for one outage"
    assert_none_refused(cluster, watch)


@pytest.mark.parametrize("direction", ["to_coordinator", "to_agent"])
def test_a_one_way_partition_heals_like_a_two_way_one(net, make_cluster, direction):
    cluster = start_fleet(net, make_cluster)
    watch = cluster.client(attach=False, timeout=10)
    trainer = Trainer(cluster.client(timeout=120, fetch_timeout=3), 4, cluster.config["n_samples_per_prompt"])
    try:
        healed = outage(cluster, net, watch, trainer, 6, direction)
    finally:
        trainer.stop()
    assert healed["registrations"] == 1, f"a0 registered {healed['registrations']} times for one outage"
    assert "retired" not in healed["seen"]


@pytest.fixture
def impaired_net():
    why = unavailable(impair=True)
    if why:
        pytest.skip(f"packet-level fault harness with the TUN impairer: {why}")
    try:
        made = NetFault.create(agents=len(AGENTS), impair=True, seed=22)
    except NetFaultUnavailable as exc:
        pytest.skip(f"packet-level fault harness with the TUN impairer: {exc}")
    try:
        yield made
    finally:
        made.close()
        assert not made.leftovers(), f"netfault left {made.leftovers()}"


def test_delay_jitter_loss_reordering_and_duplication_lose_and_duplicate_nothing(impaired_net, make_cluster):
    """netem's impairments on agent a0's link (harness/tunimpair.py) while batches flow: every batch
    complete, no prompt delivered twice, a0 still contributing, no group refused as a duplicate."""
    net = impaired_net
    cluster = start_fleet(net, make_cluster)
    watch = cluster.client(attach=False, timeout=10)
    trainer = Trainer(cluster.client(timeout=120, fetch_timeout=3), 4, cluster.config["n_samples_per_prompt"])
    try:
        wait_for(lambda: trainer.batches >= 2 or trainer.check(), 60, "two batches before the impairment")
        accepted = watch.stats().receipts["accepted"]
        net.impair(0, delay_ms=20, jitter_ms=10, loss=0.03, reorder=0.1, duplicate=0.02)
        batches = trainer.batches
        wait_for(lambda: trainer.batches >= batches + 15 or trainer.check(), 180, "15 batches under impairment")
        impaired = net.impair_stats()
        stats = watch.stats()
    finally:
        trainer.stop()
    for what in ("lost", "duplicated", "reordered"):
        assert impaired[what] > 0, f"the impairer {what} no packet: {impaired}"
    a0 = stats.agents["a0"]
    assert a0.status == "alive", a0
    assert stats.receipts["accepted"] > accepted
    assert_none_refused(cluster, watch)


def test_a_trainer_cut_off_from_an_agents_payloads_gets_every_batch_completed_with_replacements(net, make_cluster):
    """Only a0's payload endpoint is partitioned (the coordinator still hears a0, so it is never
    retired): the trainer retries its fetches for ``fetch_deadline``, then reports those groups
    missing and gets the batch completed with replacements. Never a hang, never a short batch, no
    prompt delivered twice; after the heal a0's payloads are fetched again."""
    cluster = start_fleet(net, make_cluster)
    watch = cluster.client(attach=False, timeout=10)
    trainer = Trainer(
        cluster.client(timeout=120, fetch_timeout=2, fetch_deadline=3), 4, cluster.config["n_samples_per_prompt"]
    )
    try:
        wait_for(lambda: trainer.batches >= 2 or trainer.check(), 60, "two batches before the partition")
        net.partition(0, "both", port=PAYLOAD_PORT)
        batches = trainer.batches
        wait_for(lambda: trainer.batches >= batches + 2 or trainer.check(), 90, "two batches while cut off")
        assert trainer.replaced > 0, "no group was replaced: the partition never met a fetch"
        assert net.dropped(0) > 0
        net.heal(0)
        batches = trainer.batches
        wait_for(lambda: trainer.batches >= batches + 3 or trainer.check(), 60, "three batches after the heal")
        assert watch.stats().agents["a0"].status == "alive"
    finally:
        trainer.stop()
