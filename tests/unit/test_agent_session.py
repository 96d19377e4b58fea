"""The agent's pure core: events in, instructions out; no sockets, no event loop, no clock."""

from __future__ import annotations

import logging

import pytest

from agent.events import (
    AbortRequests,
    AckReceipt,
    AssignEngine,
    CancelLease,
    CloseLink,
    Configure,
    Connected,
    EngineChanged,
    EngineFailed,
    EnginesStarted,
    EngineWanted,
    Exit,
    GenerationEnded,
    LeaseCommitted,
    LeaseFailed,
    LeaseFiltered,
    LeaseScored,
    Log,
    MessageReceived,
    PendingReceipt,
    Reconnect,
    ReportEngineFailure,
    Send,
    ShutdownRequested,
    StartLease,
    Tick,
    TrimGroups,
)
from agent.session import AgentSession, LeaseState, Phase
from common import protocol as p
from common.config import RolloutConfig
from common.engine_info import EngineState

failure = p.Failure.of
GENERATION_FAILED = p.FailureKind.GENERATION_FAILED
PAUSED = p.ReleaseReason.PAUSED

N = 4  # samples per prompt
SLOTS = 2 * N  # concurrency per engine: two groups
CONFIG = RolloutConfig(n_samples_per_prompt=N, rollout_batch_size=2)


def make_session(engines=("e0",)) -> AgentSession:
    s = AgentSession(
        agent_id="a1",
        incarnation=3,
        payload_address="tcp://a1:7000",
        concurrency_per_engine=SLOTS,
        coordinator="tcp://c:5555",
        dataset_fingerprint="fp",
        dataset_size=100,
    )
    s.handle(EnginesStarted(tuple((name, f"http://{name}") for name in engines)), 0.0)
    return s


def welcome(session=7, *, acks=(), cancel=(), paused=False, config=CONFIG, heartbeat=1.0, ttl=5.0) -> p.Welcome:
    return p.Welcome(session, config.to_dict(), heartbeat, ttl, [list(a) for a in acks], list(cancel), paused)


def recv(s, msg, now=0.0) -> list:
    return s.handle(MessageReceived(msg), now)


def join(s, now=0.0, *, stored=(), unacked=(), **kw) -> list:
    """Connect and be welcomed; returns the Welcome's instructions."""
    s.handle(Connected(tuple(stored), tuple(unacked)), now)
    return recv(s, welcome(**kw), now)


def of(instructions, kind) -> list:
    return [i for i in instructions if isinstance(i, kind)]


def sent(instructions, kind=p.Message) -> list:
    return [i.msg for i in instructions if isinstance(i, Send) and isinstance(i.msg, kind)]


def logs(instructions) -> str:
    return "\n".join(i.text for i in of(instructions, Log))


def grant(lease, index=None, epoch=0) -> p.LeaseGrant:
    return p.LeaseGrant(lease, epoch, lease if index is None else index, 0, prompt="1+1", label=2)


def start(s, *leases, now=0.0) -> list[AssignEngine]:
    """Grant the leases and let their runners ask for an engine; returns the assignments."""
    recv(s, p.Grant(s.session, [grant(lease) for lease in leases]), now)
    return [a for lease in leases for a in of(s.handle(EngineWanted(lease), now), AssignEngine)]


def receipt(lease, epoch=0, index=None) -> PendingReceipt:
    index = lease if index is None else index
    return PendingReceipt(lease, epoch, index, f"{epoch}:{index}:{lease:x}", N, {"n_samples": N})


def commit(s, lease, now=0.0) -> list:
    """The runner generates, scores and commits the lease's group; returns the commit's instructions."""
    s.handle(GenerationEnded(lease), now)
    s.handle(LeaseScored(lease, N), now)
    return s.handle(LeaseCommitted(lease, receipt(lease)), now)


def heartbeat(s, now) -> p.Heartbeat:
    return sent(s.handle(Tick(stored_groups=5), now), p.Heartbeat)[0]


def in_flight(s) -> int:
    return sum(e.in_flight for e in s.leases.pool.engines.values())


# ---------------------------------------------------------------------------- registration


def test_connecting_sends_a_register_that_describes_the_node_and_its_store():
    s = make_session(engines=("e0", "e1"))
    assert s.handle(Tick(), 0.0) == [], "nothing is said before the link is up"
    out = s.handle(Connected(("0:1:1", "0:2:2"), (receipt(1).to_dict(),)), 0.0)
    [reg] = sent(out, p.Register)
    assert (reg.agent_id, reg.incarnation, reg.payload_address) == ("a1", 3, "tcp://a1:7000")
    assert reg.capacity == 2 * SLOTS
    assert [e.name for e in reg.engines] == ["e0", "e1"] and all(e.state is EngineState.HEALTHY for e in reg.engines)
    assert reg.unacked == [receipt(1).to_dict()] and reg.stored == ["0:1:1", "0:2:2"] and reg.in_flight == []
    assert (reg.dataset_fingerprint, reg.dataset_size) == ("fp", 100)
    assert s.phase is Phase.REGISTERING and s.session == 0


def test_register_lists_the_leases_still_in_flight_when_the_agent_registers_again():
    s = make_session()
    join(s)
    start(s, 5)
    s.handle(Tick(), 6.0)  # silence past the TTL
    reg = sent(s.handle(Connected((), ()), 6.5), p.Register)[0]
    assert reg.in_flight == [[5, 0, 5]]


def test_an_unanswered_register_is_sent_again_after_1_2_4_8_8_seconds():
    s = make_session()
    first = sent(s.handle(Connected((), ()), 0.0), p.Register)[0]
    resent_at = []
    now = 0.0
    while now < 40:
        now = s.next_tick_at
        out = s.handle(Tick(), now)
        assert sent(out) == [first], "the same Register: its lists match the store read with it"
        assert "no answer from coordinator tcp://c:5555 yet; retrying" in logs(out)
        resent_at.append(now)
    assert resent_at[:5] == [1.0, 3.0, 7.0, 15.0, 23.0]


def test_while_registering_only_a_welcome_or_an_error_is_heard():
    s = make_session()
    s.handle(Connected((), ()), 0.0)
    for msg in (
        p.Grant(0, [grant(1)]),
        p.ReceiptAck(1, "k", True),
        p.Control("pause", abort=True),
        p.Fence("stale"),
        p.Trim(["k"]),
        p.Heartbeat(0, paused=True),
        None,
    ):
        assert recv(s, msg) == [], msg
    assert not s.paused and not s.leases and s.phase is Phase.REGISTERING


@pytest.mark.parametrize("code", ["dataset_mismatch", "too_small", "bad_register"])
def test_a_refusal_of_the_register_makes_the_agent_exit(code):
    s = make_session()
    s.handle(Connected((), ()), 0.0)
    [exit_] = recv(s, p.Error(code, "no"))
    assert isinstance(exit_, Exit) and exit_.reason == "coordinator refused agent a1: no"


def test_any_other_error_during_registration_is_logged_and_registration_goes_on():
    s = make_session()
    s.handle(Connected((), ()), 0.0)
    out = recv(s, p.Error("internal", "oops"))
    assert of(out, Log) and not of(out, Exit) and s.phase is Phase.REGISTERING


def test_welcome_starts_the_session_and_configures_reward_and_filter_only_when_the_config_changes():
    s = make_session()
    out = join(s)
    assert s.phase is Phase.ACTIVE and s.session == 7
    assert of(out, Configure) == [Configure(CONFIG)]
    assert "registered (session 7, capacity 8 samples, 0 receipts recovered)" in logs(out)
    s.handle(Tick(), 6.0)
    assert not of(join(s, 6.0, session=8), Configure), "same config: reward and filter are kept"
    other = RolloutConfig(n_samples_per_prompt=N, rollout_batch_size=2, reward="exact")
    s.handle(Tick(), 12.0)
    assert of(join(s, 12.0, session=9, config=other), Configure) == [Configure(other)]


def test_welcome_answers_recovered_receipts_and_resends_none_of_them():
    s = make_session()
    stored = (receipt(1).to_dict(), receipt(2).to_dict())
    out = join(s, unacked=stored, acks=[(receipt(1).key, True), (receipt(2).key, False)])
    assert of(out, AckReceipt) == [AckReceipt(receipt(1).key, True), AckReceipt(receipt(2).key, False)]
    assert not sent(out, p.Receipt) and not s.outbox
    assert "2 receipts recovered" in logs(out)


def test_receipts_committed_while_registering_are_sent_after_the_welcome():
    s = make_session()
    join(s)
    start(s, 1)
    s.handle(Tick(), 6.0)  # session lost; the lease keeps running
    s.handle(Connected((), ()), 6.5)
    assert commit(s, 1, 6.6) == [], "no session: the receipt waits in the outbox"
    out = recv(s, welcome(8), 7.0)
    assert sent(out, p.Receipt) == [receipt(1).to_message(8)]


def test_a_receipt_the_store_recovered_but_the_welcome_did_not_answer_is_sent():
    s = make_session()
    out = join(s, unacked=(receipt(1).to_dict(),), acks=[])
    assert sent(out, p.Receipt) == [receipt(1).to_message(7)]


def test_a_malformed_outbox_entry_is_registered_as_stored_but_not_resent():
    s = make_session()
    out = s.handle(Connected((), ({"key": "x"},)), 0.0)
    assert sent(out, p.Register)[0].unacked == [{"key": "x"}]
    assert "malformed receipt" in logs(out) and not s.outbox


def test_welcome_cancels_leases_reissued_meanwhile_without_releasing_them():
    s = make_session()
    join(s)
    start(s, 1, 2)
    assert in_flight(s) == 2 * N
    s.handle(Tick(), 6.0)
    s.handle(Connected((), ()), 6.5)
    out = recv(s, welcome(8, cancel=[1]), 7.0)
    assert of(out, CancelLease) == [CancelLease(1)] and not sent(out, p.Release)
    assert list(s.leases) == [2] and in_flight(s) == N, "the cancelled lease's slots are free again"
    assert heartbeat(s, 7.0).leases == [2]


def test_a_second_welcome_in_a_session_is_ignored():
    s = make_session()
    join(s)
    assert recv(s, welcome(99), 0.5) == [] and s.session == 7


# ---------------------------------------------------------------------------- heartbeats, silence, fencing


def test_heartbeats_go_out_at_once_then_every_interval_and_list_the_leases_held():
    s = make_session()
    join(s)
    start(s, 3)
    recv(s, p.Heartbeat(7, max_lease=9), 0.0)
    hb = heartbeat(s, 0.0)
    assert (hb.session, hb.leases, hb.max_lease, hb.paused) == (7, [3], 9, None)
    assert [(e.name, e.state, e.in_flight) for e in hb.engines] == [("e0", EngineState.HEALTHY, N)]
    assert hb.stats["in_flight"] == 1 and hb.stats["capacity"] == SLOTS and hb.stats["stored_groups"] == 5
    assert s.handle(Tick(), 0.5) == [] and s.next_tick_at == 1.0
    assert heartbeat(s, 1.0).leases == [3]


def test_any_message_counts_as_a_sign_of_life_even_an_undecodable_one():
    s = make_session()
    join(s)
    for t in range(1, 12):
        recv(s, None, float(t))
        assert not of(s.handle(Tick(), float(t)), Reconnect)
    assert s.phase is Phase.ACTIVE


def test_silence_past_the_ttl_ends_the_session_and_asks_for_a_reconnect():
    s = make_session()
    join(s)
    assert s.next_tick_at == 0.0
    s.handle(Tick(), 0.0)
    assert not of(s.handle(Tick(), 5.0), Reconnect), "the TTL itself is not past"
    out = s.handle(Tick(), 5.1)
    assert of(out, Reconnect) == [Reconnect("coordinator silent for 5.1s (TTL 5.0s)")]
    assert s.phase is Phase.DISCONNECTED and s.session == 0 and s.next_tick_at == float("inf")


def test_a_fence_ends_the_session_and_the_next_connect_registers_again():
    s = make_session()
    join(s)
    start(s, 1)
    assert recv(s, p.Fence("session 7 is not current"), 1.0) == [Reconnect("fenced: session 7 is not current")]
    assert s.session == 0 and list(s.leases) == [1], "leases keep running across a reconnect"
    reg = sent(s.handle(Connected((), ()), 1.5), p.Register)[0]
    assert reg.in_flight == [[1, 0, 1]]
    recv(s, welcome(8), 2.0)
    assert s.session == 8


def test_messages_of_a_stale_session_change_nothing():
    s = make_session()
    join(s, session=8)
    assert recv(s, p.Grant(7, [grant(1)])) == [] and not s.leases
    assert recv(s, p.Heartbeat(7, max_lease=50, paused=True)) == []
    assert not s.paused and s.max_lease == 0


def test_outcomes_while_disconnected_are_not_sent_and_their_receipts_wait_for_the_next_welcome():
    s = make_session()
    join(s)
    start(s, 1, 2)
    recv(s, p.Fence("stale"), 1.0)
    assert commit(s, 1, 1.1) == []
    s.handle(GenerationEnded(2), 1.2)
    failed = LeaseFailed(2, failure(GENERATION_FAILED, "boom"))
    assert s.handle(failed, 1.2) == [], "a Release without a session would only be fenced"
    s.handle(Connected((), ()), 1.5)
    out = recv(s, welcome(8), 2.0)
    assert sent(out, p.Receipt) == [receipt(1).to_message(8)] and not sent(out, p.Release)


def test_a_fence_while_shutting_down_closes_the_link_instead_of_reconnecting():
    s = make_session()
    join(s)
    s.handle(ShutdownRequested(), 1.0)
    assert recv(s, p.Fence("stale"), 1.1) == [CloseLink("fenced: stale")]


# ---------------------------------------------------------------------------- grants


def test_a_grant_starts_a_runner_that_gets_one_engine_and_one_request_id_per_sample():
    s = make_session()
    join(s)
    out = recv(s, p.Grant(7, [grant(0x2A, index=4)]))
    assert out == [StartLease(0x2A, grant(0x2A, index=4))] and s.max_lease == 0x2A
    assert s.leases[0x2A].state is LeaseState.STARTING
    [assign] = s.handle(EngineWanted(0x2A), 0.0)
    assert assign == AssignEngine(0x2A, "e0", "http://e0", tuple(f"rf-{0x2A:016x}-000-{i:04d}" for i in range(N)))
    assert s.leases[0x2A].state is LeaseState.GENERATING and in_flight(s) == N


def test_a_duplicate_grant_is_ignored():
    s = make_session()
    join(s)
    start(s, 1)
    assert recv(s, p.Grant(7, [grant(1)])) == []
    assert len(s.leases) == 1 and in_flight(s) == N


def test_groups_go_to_the_least_loaded_engine():
    s = make_session(engines=("e0", "e1"))
    join(s)
    assert [a.engine for a in start(s, 1, 2, 3, 4)] == ["e0", "e1", "e0", "e1"]


def test_max_lease_follows_grants_and_the_coordinators_heartbeat():
    s = make_session()
    join(s)
    start(s, 4)
    recv(s, p.Heartbeat(7, max_lease=2))
    assert s.max_lease == 4
    recv(s, p.Heartbeat(7, max_lease=11))
    assert heartbeat(s, 0.0).max_lease == 11


# ---------------------------------------------------------------------------- receipts


def test_a_receipt_is_sent_once_the_commit_returned_and_kept_until_acknowledged():
    s = make_session()
    join(s)
    start(s, 1)
    s.handle(GenerationEnded(1), 0.1)
    assert s.handle(LeaseScored(1, N), 0.1) == [], "scored is not committed: nothing to report yet"
    out = s.handle(LeaseCommitted(1, receipt(1)), 0.2)
    assert sent(out) == [receipt(1).to_message(7)]
    assert not s.leases and in_flight(s) == 0 and s.counters.groups_committed == 1 and s.counters.samples == N
    assert list(s.outbox) == [receipt(1).key]
    out = recv(s, p.ReceiptAck(1, receipt(1).key, True), 0.3)
    assert out == [AckReceipt(receipt(1).key, True)] and not s.outbox


def test_a_lost_ack_is_repaired_by_sending_the_receipt_again_after_the_ttl():
    s = make_session()
    join(s)
    s.handle(Tick(), 0.0)
    start(s, 1)
    commit(s, 1, 0.5)
    for t in (1.0, 2.0, 3.0, 4.0, 5.0):
        recv(s, p.Heartbeat(7), t)
        assert not sent(s.handle(Tick(), t), p.Receipt), f"resent too early at {t}"
    recv(s, p.Heartbeat(7), 6.0)
    assert sent(s.handle(Tick(), 6.0), p.Receipt) == [receipt(1).to_message(7)]
    recv(s, p.Heartbeat(7), 7.0)
    assert not sent(s.handle(Tick(), 7.0), p.Receipt), "the resend restarts the clock"
    recv(s, p.ReceiptAck(1, receipt(1).key, True), 7.5)
    for t in (8.0, 12.0, 16.0):
        recv(s, p.Heartbeat(7), t)
        assert not sent(s.handle(Tick(), t), p.Receipt)


def test_an_ack_for_an_unknown_receipt_still_clears_the_store():
    s = make_session()
    join(s)
    assert recv(s, p.ReceiptAck(9, "0:9:9", True)) == [AckReceipt("0:9:9", True)]


def test_a_refused_receipt_is_logged_and_its_group_deleted():
    s = make_session()
    join(s)
    start(s, 1)
    commit(s, 1)
    out = recv(s, p.ReceiptAck(1, receipt(1).key, False, "duplicate: prompt already accepted"))
    assert AckReceipt(receipt(1).key, False) in out
    assert "coordinator refused group 0:1:1 (duplicate: prompt already accepted); deleting it" in logs(out)


def test_a_filtered_group_is_reported_for_its_leases_prompt_and_counted():
    s = make_session()
    join(s)
    recv(s, p.Grant(7, [grant(1, index=12, epoch=2)]))
    s.handle(EngineWanted(1), 0.0)
    s.handle(GenerationEnded(1), 0.0)
    s.handle(LeaseScored(1, N), 0.0)
    out = s.handle(LeaseFiltered(1, "zero_std_1", {"n_samples": N}), 0.0)
    assert sent(out) == [p.Filtered(7, 1, 2, 12, "zero_std_1", {"n_samples": N})]
    assert s.counters.groups_filtered == 1 and not s.leases and not s.outbox


def test_a_failed_lease_is_released_as_failed_and_its_slots_freed():
    s = make_session()
    join(s)
    start(s, 1)
    why = failure(GENERATION_FAILED, "EngineError: HTTP 400")
    out = s.handle(LeaseFailed(1, why), 0.0)
    assert sent(out) == [p.Release(7, [1], p.ReleaseReason.FAILED, why)]
    assert in_flight(s) == 0 and not s.leases and s.counters.groups_released == 0


def test_a_group_the_full_store_could_not_commit_is_given_back_uncounted():
    s = make_session()
    join(s)
    start(s, 1)
    out = s.handle(LeaseFailed(1, None), 0.0)
    assert sent(out) == [p.Release(7, [1], p.ReleaseReason.NOT_COMMITTED)] and 1 not in s.leases


def test_trim_deletes_the_named_groups():
    s = make_session()
    join(s)
    assert recv(s, p.Trim(["0:1:1", "0:2:2"])) == [TrimGroups(("0:1:1", "0:2:2"))]


def test_events_for_leases_no_longer_held_are_ignored():
    s = make_session()
    join(s)
    for event in (
        EngineWanted(5),
        GenerationEnded(5, aborted=True),
        EngineFailed(5, "x"),
        LeaseScored(5, N),
        LeaseFiltered(5, "r"),
        LeaseFailed(5, failure(GENERATION_FAILED, "x")),
    ):
        assert s.handle(event, 0.0) == [], event


# ---------------------------------------------------------------------------- pause and resume


def test_pause_lets_groups_on_an_engine_finish_and_gives_back_the_rest_at_once():
    s = make_session()
    join(s)
    start(s, 1)
    recv(s, p.Grant(7, [grant(2)]))  # its runner has not asked for an engine yet
    out = recv(s, p.Control("pause"))
    assert sent(out) == [p.Release(7, [2], PAUSED)] and of(out, CancelLease) == [CancelLease(2)]
    assert not of(out, AbortRequests) and list(s.leases) == [1]
    assert sent(commit(s, 1), p.Receipt), "the group on an engine completes and reports"


def test_pause_with_abort_aborts_the_requests_on_engines_and_releases_their_leases():
    s = make_session()
    join(s)
    [assign] = start(s, 1)
    out = recv(s, p.Control("pause", abort=True))
    assert out == [AbortRequests("http://e0", assign.request_ids)]
    out = s.handle(GenerationEnded(1, aborted=True), 0.1)
    assert sent(out) == [p.Release(7, [1], PAUSED)] and CancelLease(1) in out
    assert in_flight(s) == 0 and s.counters.groups_released == 1


def test_a_group_aborted_by_a_pause_is_given_back_even_if_resumed_before_it_came_back():
    s = make_session()
    join(s)
    start(s, 1)
    recv(s, p.Control("pause", abort=True))
    recv(s, p.Control("resume"))
    out = s.handle(GenerationEnded(1, aborted=True), 0.1)
    assert sent(out) == [p.Release(7, [1], PAUSED)] and not of(out, AssignEngine)


def test_an_abort_that_came_too_late_lets_the_finished_group_commit():
    s = make_session()
    join(s)
    start(s, 1)
    recv(s, p.Control("pause", abort=True))
    assert sent(commit(s, 1), p.Receipt) == [receipt(1).to_message(7)]


def test_a_group_the_engine_aborted_by_itself_is_generated_again_under_new_request_ids():
    s = make_session()
    join(s)
    [first] = start(s, 1)
    [again] = s.handle(GenerationEnded(1, aborted=True), 0.1)
    assert isinstance(again, AssignEngine) and again.request_ids[0] == f"rf-{1:016x}-001-0000"
    assert set(again.request_ids).isdisjoint(first.request_ids) and in_flight(s) == N


def test_a_grant_while_paused_is_given_back_and_resume_lets_grants_run_again():
    s = make_session()
    join(s)
    recv(s, p.Control("pause"))
    out = recv(s, p.Grant(7, [grant(1), grant(2)]))
    assert sent(out) == [p.Release(7, [1], PAUSED), p.Release(7, [2], PAUSED)]
    assert not s.leases and s.max_lease == 2
    recv(s, p.Control("resume"))
    assert len(start(s, 3)) == 1


def test_the_coordinators_heartbeat_repairs_a_lost_pause_or_resume():
    s = make_session()
    join(s)
    recv(s, p.Heartbeat(7, paused=True))
    assert s.paused
    recv(s, p.Heartbeat(7))
    assert s.paused, "a heartbeat that says nothing about pause changes nothing"
    recv(s, p.Heartbeat(7, paused=False))
    assert not s.paused


def test_a_welcome_that_says_paused_pauses_the_agent():
    s = make_session()
    join(s, paused=True)
    assert s.paused
    assert sent(recv(s, p.Grant(7, [grant(1)])), p.Release)


def test_a_runner_retrying_after_an_engine_failure_is_given_back_when_paused():
    s = make_session(engines=("e0", "e1"))
    join(s)
    start(s, 1)
    s.handle(EngineFailed(1, "connection reset"), 0.1)
    out = recv(s, p.Control("pause"), 0.15)
    assert sent(out, p.Release) == [p.Release(7, [1], PAUSED)] and CancelLease(1) in out


# ---------------------------------------------------------------------------- engines and capacity


def test_an_engine_failure_under_a_group_retries_it_elsewhere_and_lowers_capacity():
    s = make_session(engines=("e0", "e1"))
    join(s)
    [assign] = start(s, 1)
    out = s.handle(EngineFailed(1, "connection refused"), 0.1)
    assert ReportEngineFailure(assign.engine, "connection refused") in out
    assert sent(out, p.Capacity)[0].capacity == SLOTS
    assert f"lease 1: engine {assign.engine} failed (connection refused); retrying on another engine" in logs(out)
    assert s.leases[1].state is LeaseState.RETRYING and s.counters.engine_retries == 1 and in_flight(s) == 0
    [again] = s.handle(EngineWanted(1), 0.2)
    assert again.engine != assign.engine and again.request_ids[0].endswith("-001-0000")


def test_engine_changes_are_logged_and_reported_to_the_coordinator():
    s = make_session(engines=("e0", "e1"))
    join(s)
    out = s.handle(EngineChanged("e0", "down"), 1.0)
    assert sent(out) == [p.Capacity(7, SLOTS, s.engines())]
    assert "engine e0 is down (capacity now 8 samples)" in logs(out) and of(out, Log)[0].level == logging.WARNING
    assert [e.state for e in s.engines()] == [EngineState.DOWN, EngineState.HEALTHY]
    out = s.handle(EngineChanged("e0", "healthy", "http://e0:2"), 2.0)
    assert sent(out)[0].capacity == 2 * SLOTS and s.leases.pool.engines["e0"].url == "http://e0:2"
    assert "engine e0 is healthy (capacity now 16 samples)" in logs(out)
    assert not sent(s.handle(EngineChanged("e0", "healthy", "http://e0:2"), 3.0)), "no change, nothing to say"


def test_engine_changes_before_registration_are_only_logged_and_count_in_the_register():
    s = make_session(engines=("e0", "e1"))
    out = s.handle(EngineChanged("e1", "down"), 0.0)
    assert not sent(out) and of(out, Log)
    assert sent(s.handle(Connected((), ()), 0.0), p.Register)[0].capacity == SLOTS


def test_a_lease_waits_while_no_engine_is_healthy_and_runs_when_one_comes_back():
    s = make_session()
    join(s)
    s.handle(EngineChanged("e0", "down"), 0.0)
    recv(s, p.Grant(7, [grant(1)]))
    assert s.handle(EngineWanted(1), 0.0) == [] and s.leases[1].state is LeaseState.WAITING
    out = s.handle(EngineChanged("e0", "healthy", "http://e0"), 1.0)
    assert of(out, AssignEngine)[0].lease == 1 and s.leases[1].state is LeaseState.GENERATING


def test_losing_the_last_engine_gives_every_waiting_lease_back():
    s = make_session()
    join(s)
    start(s, 1)
    s.handle(EngineFailed(1, "connection refused"), 0.1)
    assert s.handle(EngineWanted(1), 0.2) == [] and s.leases[1].state is LeaseState.WAITING
    recv(s, p.Grant(7, [grant(2)]))
    out = s.handle(EngineChanged("e0", "retired", None, all_retired=True), 1.0)
    assert sent(out, p.Capacity) == [p.Capacity(7, 0, s.engines())], "retirement is always reported"
    assert sent(out, p.Release) == [p.Release(7, [1], p.ReleaseReason.NO_ENGINE)]
    assert sent(s.handle(EngineWanted(2), 1.1), p.Release) == [p.Release(7, [2], p.ReleaseReason.NO_ENGINE)]
    assert not s.leases and s.counters.groups_released == 2


# ---------------------------------------------------------------------------- shutdown


def test_shutdown_stops_grants_releases_unfinished_leases_at_once_and_lets_commits_finish():
    s = make_session(engines=("e0", "e1"))
    join(s)
    start(s, 1, 2, 3)
    s.handle(GenerationEnded(3), 0.1)
    s.handle(LeaseScored(3, N), 0.1)  # past generation: committing
    s.handle(GenerationEnded(2), 0.1)  # scoring: still cancelled
    out = s.handle(ShutdownRequested(), 1.0)
    capacity, release = sent(out)
    assert isinstance(capacity, p.Capacity) and capacity.capacity == 0, "no new grants"
    assert release == p.Release(7, [1, 2], p.ReleaseReason.SHUTDOWN)
    assert of(out, CancelLease) == [CancelLease(1), CancelLease(2)] and list(s.leases) == [3]
    assert s.capacity() == 0 and s.counters.groups_released == 0
    assert sent(s.handle(LeaseCommitted(3, receipt(3)), 1.1), p.Receipt)


def test_grants_that_arrive_during_shutdown_are_given_back_in_one_release():
    s = make_session()
    join(s)
    s.handle(ShutdownRequested(), 1.0)
    out = recv(s, p.Grant(7, [grant(4), grant(5)]), 1.1)
    assert out == [Send(p.Release(7, [4, 5], p.ReleaseReason.SHUTDOWN))] and s.max_lease == 5 and not s.leases


def test_shutdown_waits_for_acks_only_while_the_coordinator_still_talks():
    s = make_session()
    join(s)
    start(s, 1)
    commit(s, 1, 0.5)
    s.handle(ShutdownRequested(), 1.0)
    assert s.awaiting_acks(1.0)
    assert not s.awaiting_acks(2.1), "silent for two heartbeats: the next start recovers the receipt"
    recv(s, p.ReceiptAck(1, receipt(1).key, True), 1.2)
    assert not s.awaiting_acks(1.2)


def test_shutdown_without_a_session_sends_nothing_but_still_cancels():
    s = make_session()
    join(s)
    start(s, 1)
    recv(s, p.Fence("stale"))
    out = s.handle(ShutdownRequested(), 1.0)
    assert out == [CancelLease(1)] and not s.awaiting_acks(1.0)


def test_every_resend_of_a_register_carries_its_req_and_a_new_attempt_a_new_one():
    s = make_session()
    first = sent(s.handle(Connected((), ()), 0.0), p.Register)[0]
    resends = [sent(s.handle(Tick(), s.next_tick_at), p.Register)[0] for _ in range(4)]
    assert first.req > 0 and {r.req for r in resends} == {first.req}
    recv(s, welcome(7), 16.0)
    s.handle(Tick(), 22.0)  # silence past the TTL: the session is over, the next attempt is a new request
    again = sent(s.handle(Connected((), ()), 22.5), p.Register)[0]
    assert again.req != first.req and again.incarnation == first.incarnation
