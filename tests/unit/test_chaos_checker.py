"""The chaos checker can fail: fabricated evidence with one fault each, and the checker names it.

The baseline is a consistent quiesced run (8 prompts, one open epoch, two batches of two groups, one group
ready, one prompt filtered, two pending; weights at version 3 after a disk update, a broadcast, and a failed
broadcast, a's two engines serving, b's one engine stale); each test breaks one thing the way a bug would.
"""

from collections import Counter

import pytest

from coordinator.frontier import DELIVERED, FILTERED, READY
from coordinator.records import GroupRef, LedgerSnapshot, PromptState, RecordedBatch
from harness.chaos_check import KINDS, RunEvidence, StoreContents, check

SIZE = 8


def _evidence() -> RunEvidence:
    keys = {i: f"0:{i}:{i + 16:x}" for i in range(SIZE)}
    on = {0: "a", 1: "b", 2: "a", 3: "b", 4: "a"}
    prompts = {(0, i): PromptState(DELIVERED, on[i], keys[i], rollout_id=i // 2) for i in range(4)}
    prompts[(0, 4)] = PromptState(READY, "a", keys[4], {"n_samples": 4}, seq=5)
    prompts[(0, 5)] = PromptState(FILTERED, "b", reason="zero_std")
    batches = {
        rid: RecordedBatch(tuple(GroupRef(0, i, on[i], keys[i]) for i in (2 * rid, 2 * rid + 1)), {}) for rid in (0, 1)
    }
    ledger = LedgerSnapshot(cursors={0: SIZE}, prompts=prompts, batches=batches, last_rollout_id=1)
    consumed = [
        {
            "rid": rid,
            "groups": [[0, i, on[i], "default"] for i in (2 * rid, 2 * rid + 1)],
            "replaced": 0,
            "lengths_ok": True,
        }
        for rid in (0, 1)
    ]
    stats = {
        "prompts": {"pending": 2, "leased": 0, "ready": 1, "delivered": 4, "filtered": 1},
        "leased": 0,
        "ready": 1,
        "data_epochs": [0],
        "agents": {
            "a": {"status": "alive", "leases": 0, "engines": [_engine(e, "healthy", 3) for e in ("e0", "e1")]},
            "b": {"status": "alive", "leases": 0, "engines": [_engine("e0", "stale", 1)]},  # out of the pool
        },
        "weights": {"version": 3, "updates": 2, "kind": "distributed", "lock": None},
    }
    stores = {
        "a": StoreContents(frozenset({keys[0], keys[2], keys[4]}), {}),
        "b": StoreContents(frozenset({keys[1], keys[3]}), {}),
    }
    return RunEvidence(
        batches=2,
        batch_size=2,
        dataset_size=SIZE,
        consumed=consumed,
        stats=stats,
        ledger=ledger,
        stores=stores,
        kills=Counter(dict.fromkeys(KINDS, 1)),
        weight_updates=[
            {"kind": "disk", "version": 1, "ok": True, "engines": {"a/e0": 1, "a/e1": 1, "b/e0": 1}},
            {"kind": "distributed", "version": 2, "ok": False, "error": "WeightUpdateError: b/e0 was lost"},
            {"kind": "distributed", "version": 3, "ok": True, "engines": {"a/e0": 3, "a/e1": 3}},
        ],
        weight_kinds=("disk", "distributed"),
        engine_versions={"a/e0": "3", "a/e1": "3"},
    )


def _engine(name: str, state: str, version: int) -> dict:
    return {"name": name, "url": f"http://127.0.0.1/{name}", "state": state, "tp": 1, "version": version}


def _problems(ev: RunEvidence, needle: str) -> list[str]:
    found = check(ev)
    hits = [p for p in found.problems if needle in p]
    assert hits, f"no problem mentioning {needle!r} in {found.problems}"
    return hits


def test_a_consistent_run_passes():
    found = check(_evidence())
    assert found.problems == []
    assert (found.batches, found.duplicated, found.lost, found.unaccounted_prompts) == (2, 0, 0, 0)
    assert found.weight_updates == {
        "disk": 1,
        "distributed": 1,
        "catch_up": 0,
        "retried": 0,
        "failed": 1,
        "failure_causes": {"WeightUpdateError: b# was lost": 1},
        "failed_during": {"none": 1},
    }


def test_a_forgotten_prompt_is_reported():
    """A prompt trained in batch 1 whose ledger record vanished: pending again, it would be trained twice."""
    ev = _evidence()
    del ev.ledger.prompts[(0, 3)]
    ev.stats["prompts"].update(pending=3, delivered=3)
    _problems(ev, "prompt (0, 3) trained in rollout 1 is pending again")
    assert check(ev).unaccounted_prompts >= 1


def test_a_stuck_lease_is_reported():
    ev = _evidence()
    ev.stats["prompts"].update(pending=1, leased=1)
    ev.stats["leased"] = 1
    ev.stats["agents"]["b"]["leases"] = 1
    _problems(ev, "stuck, never reissued")
    _problems(ev, "quiesced agent b (alive) still holds 1 lease")


def test_a_duplicated_prompt_is_reported():
    """The same prompt in two batches of the final stream (and of the ledger)."""
    ev = _evidence()
    ev.consumed[1]["groups"][1] = [0, 0, "a"]
    ev.ledger.batches[1] = RecordedBatch((ev.ledger.batches[1].groups[0], ev.ledger.batches[0].groups[0]), {})
    found = check(ev)
    assert found.duplicated == 2
    _problems(ev, "prompt (0, 0) trained twice: in rollouts 0 and 1")
    _problems(ev, "prompt (0, 0) in recorded batches 0 and 1")


def test_counts_that_disagree_with_the_ledger_are_reported():
    ev = _evidence()
    ev.stats["prompts"].update(ready=2, pending=1)
    _problems(ev, "2 prompts ready in the coordinator, 1 in its ledger")


def test_states_that_do_not_cover_every_prompt_once_are_reported():
    """Frontier counts summing short of epochs x size (a prompt in no state, or one outside the five)."""
    ev = _evidence()
    ev.stats["prompts"]["pending"] = 1
    _problems(ev, "do not cover the 1 open epoch(s) of [8] prompts (8) exactly once")


def test_a_delivered_prompt_no_trainer_fetched_is_reported():
    ev = _evidence()
    ev.ledger.prompts[(0, 6)] = PromptState(DELIVERED, "a", "0:6:1", rollout_id=1)
    ev.stats["prompts"].update(pending=1, delivered=5)
    _problems(ev, "prompt (0, 6) is delivered in rollout 1 (ledger) but no trainer fetched it there")


def test_a_ready_group_missing_from_its_store_is_lost():
    ev = _evidence()
    ev.stores["a"] = StoreContents(ev.stores["a"].groups - {"0:4:14"}, {})
    assert check(ev).lost == 1
    _problems(ev, "0:4:14 is ready or batched on a (ledger) but not in its store")


def test_a_stored_group_nothing_references_is_reported():
    """Committed on b, receipt acknowledged, yet the ledger has its prompt pending: a forgotten commit."""
    ev = _evidence()
    ev.stores["b"] = StoreContents(ev.stores["b"].groups | {"0:6:99"}, {})
    _problems(ev, "b stores 0:6:99, which nothing references and is not trimmable (its prompt is pending)")


def test_trimmable_stored_groups_pass():
    """A group of a trimmed batch and a refused duplicate may remain until reconciliation trims them."""
    ev = _evidence()
    del ev.ledger.batches[0]  # trimmed behind a checkpoint
    ev.ledger.trimmed_upto = 0
    ev.stores["b"] = StoreContents(ev.stores["b"].groups | {"0:4:77"}, {})  # refused: 0:4 is a's group
    assert check(ev).problems == []


def test_an_unsettled_receipt_is_reported():
    ev = _evidence()
    ev.stores["a"] = StoreContents(ev.stores["a"].groups | {"0:7:5"}, {"0:7:5": {"lease": 5}})
    _problems(ev, "a stores 0:7:5 with an unsettled receipt; its prompt is pending")


def test_a_node_lost_for_good_must_be_retired_and_unreferenced():
    ev = _evidence()
    ev.lost_agents = {"a"}
    found = check(ev)
    assert found.lost == 3  # 0:0 and 0:2 batched, 0:4 ready, all on a
    _problems(ev, "a was lost for good but is 'alive', not retired")


def test_a_replay_with_other_groups_is_reported():
    ev = _evidence()
    ev.consumed.append({"rid": 1, "groups": [[0, 2, "a"], [0, 6, "b"]], "replaced": 0, "lengths_ok": True})
    assert check(ev).replay_mismatches == 1


def test_a_short_batch_is_reported():
    ev = _evidence()
    ev.consumed[0]["groups"].pop()
    _problems(ev, "rollout 0 has 1 groups, not 2")


@pytest.mark.parametrize("kind", KINDS)
def test_a_failure_kind_that_never_happened_is_reported(kind):
    ev = _evidence()
    ev.kills[kind] = 0
    assert check(ev).problems == [f"schedule: no {kind} failure happened"]


def test_a_prompt_never_reissued_is_reported():
    ev = _evidence()
    ev.never_reissued = {(0, 6)}
    _problems(ev, "prompt (0, 6) came back to pending and was never leased again")


def test_a_serving_engine_on_another_version_is_reported():
    """One engine back in the pool on the version before (an update that missed it, a restart not brought up)."""
    ev = _evidence()
    ev.engine_versions["a/e1"] = "1"
    assert _problems(ev, "weights:") == ["weights: serving engine a/e1 reports version '1', the fleet is on 3"]


def test_an_engine_the_coordinator_sees_on_another_version_is_reported():
    ev = _evidence()
    ev.stats["agents"]["a"]["engines"][0]["version"] = 2
    _problems(ev, "the coordinator sees serving engine a/e0 on version 2, not 3")


def test_a_serving_engine_that_does_not_report_its_version_is_reported():
    ev = _evidence()
    del ev.engine_versions["a/e0"]
    _problems(ev, "serving engine a/e0 did not report its version")


def test_stale_engines_and_dead_agents_are_not_counted():
    """Out of the pool (stale) or on an agent that is not alive: whatever version they hold is not served."""
    ev = _evidence()
    ev.stats["agents"]["c"] = {"status": "dead", "leases": 0, "engines": [_engine("e0", "healthy", 1)]}
    assert check(ev).problems == []


def test_the_label_default_is_version_zero():
    ev = _evidence()
    ev.weight_updates, ev.weight_kinds = [], ()
    ev.stats["weights"].update(version=0, updates=0)
    for e in ev.stats["agents"]["a"]["engines"]:
        e["version"] = 0
    ev.engine_versions = {"a/e0": "default", "a/e1": "0"}
    assert check(ev).problems == []


def test_versions_that_go_backwards_are_reported():
    """A trainer that resumed and pushed a version at or below one already recorded."""
    ev = _evidence()
    ev.weight_updates.append({"kind": "disk", "version": 2, "ok": True, "engines": {"a/e0": 2}})
    _problems(ev, "weights: version 2 (disk) succeeded after version 3: backwards")


def test_a_coordinator_behind_the_recorded_versions_is_reported():
    """A recorded update the coordinator lost (acknowledged before it was persisted, then a restart)."""
    ev = _evidence()
    ev.stats["weights"].update(version=1, updates=1)
    for e in ev.stats["agents"]["a"]["engines"]:
        e["version"] = 1
    ev.engine_versions = {"a/e0": "1", "a/e1": "1"}
    _problems(ev, "weights: the coordinator is on version 1, below 3, recorded as pushed")
    _problems(ev, "weights: the coordinator counts 1 updates, 2 succeeded")


def test_an_update_answered_ok_with_an_engine_off_its_version_is_reported():
    ev = _evidence()
    ev.weight_updates[2]["engines"]["a/e1"] = 2
    _problems(ev, "weights: update to 3 answered ok with engines {'a/e1': 2} off it")


def test_a_weight_lock_held_at_quiesce_is_reported():
    ev = _evidence()
    ev.stats["weights"]["lock"] = {"holder": "trainer-1", "update_id": 9, "step": "init", "deadline_in_s": 3.0}
    _problems(ev, "weights: the quiesced fleet still holds the weight lock")


@pytest.mark.parametrize("kind", ["disk", "distributed"])
def test_a_kind_of_update_that_never_succeeded_is_reported(kind):
    ev = _evidence()
    for rec in ev.weight_updates:
        if rec["kind"] == kind:
            rec["ok"] = False
    assert f"weights: no {kind} update succeeded (2 failed)" in check(ev).problems


def test_without_broadcasts_only_disk_updates_are_required():
    """No torch: the trainer pushes disk updates only."""
    ev = _evidence()
    ev.weight_updates = ev.weight_updates[:1]
    ev.weight_kinds = ("disk",)
    ev.stats["weights"].update(version=1, updates=1)
    for e in ev.stats["agents"]["a"]["engines"]:
        e["version"] = 1
    ev.engine_versions = {"a/e0": "1", "a/e1": "1"}
    assert check(ev).problems == []


def _timed_failure(ev: RunEvidence, faults: list[tuple[float, str]]) -> None:
    """The baseline's failed broadcast ran from t=100 to t=104; ``faults`` were caused at those times."""
    ev.weight_updates[1].update(t0=100.0, t1=104.0)
    ev.faults = faults


def test_an_update_failed_by_an_engine_death_is_reported():
    """An engine killed inside a broadcast must be left out (or the broadcast retried without it), never fail it."""
    ev = _evidence()
    _timed_failure(ev, [(50.0, "coordinator"), (102.0, "engine_in_update")])
    _problems(ev, "weights: a distributed update to 2 failed with no coordinator or trainer death and fewer than two")
    assert check(ev).weight_updates["failed_during"] == {"engine_in_update": 1}
    ev.faults.append((103.0, "partition"))  # a second member lost: the retry's
    assert check(ev).problems == []


def test_an_update_failed_by_a_coordinator_death_inside_it_is_allowed_and_counted():
    ev = _evidence()
    _timed_failure(ev, [(99.0, "coordinator"), (102.0, "engine"), (200.0, "agent")])  # 1 s before its start counts
    found = check(ev)
    assert found.problems == []
    assert found.weight_updates["failed_during"] == {"coordinator": 1, "engine": 1}
    assert found.weight_updates["failure_causes"] == {"WeightUpdateError: b# was lost": 1}


def test_a_catch_up_below_the_last_version_pushed_is_reported():
    ev = _evidence()
    ev.weight_updates.append({"kind": "catch_up", "version": 3, "ok": True, "engines": {"b/e0": 3}})
    assert check(ev).problems == [] and check(ev).weight_updates["catch_up"] == 1
    ev.weight_updates.append({"kind": "catch_up", "version": 2, "ok": True, "engines": {"b/e0": 2}})
    _problems(ev, "weights: a catch-up sent version 2 after version 3: backwards")


def test_retried_broadcasts_are_counted():
    ev = _evidence()
    ev.weight_updates[2]["retried"] = "WeightUpdateError: engine a/e1 lost"
    assert check(ev).weight_updates["retried"] == 1


def test_an_update_refused_with_no_engine_up_after_an_engine_death_is_allowed():
    """Every engine was down (killed or restarting) when the update began: refused, not an engine lost in a group."""
    ev = _evidence()
    _timed_failure(ev, [(101.0, "engine")])
    ev.weight_updates[1]["error"] = "WeightUpdateError: weight update 0x2 to version 2: no engine is up to receive it"
    assert check(ev).problems == []
    ev.faults = [(150.0, "engine")]  # none inside it: a problem
    _problems(ev, "weights: a distributed update to 2 failed")


def test_a_batch_off_its_datasets_shares_is_reported():
    ev = _evidence()
    ev.shares = {"arith": 1, "exact": 1}
    for rec in ev.consumed:
        rec["composition"] = {"arith": 1, "exact": 1}
    assert check(ev).problems == []
    ev.consumed[1]["composition"] = {"arith": 2, "exact": 0}
    _problems(ev, "rollout 1 holds {'arith': 2, 'exact': 0} groups by dataset, not {'arith': 1, 'exact': 1}")
