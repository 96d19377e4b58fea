"""agent.custom_rollout.LiveRids: the call rids an abort of a sample's base rid must name."""

from __future__ import annotations

from agent.custom_rollout import LiveRids
from agent.lease_runner import LeaseContext

A = "rf-00000000000000a1-000-0001"
B = "rf-00000000000000a1-000-0002"


def test_expand_names_every_live_call_of_a_sample_and_only_its_own():
    live = LiveRids()
    live.add(A, f"{A}-c1")
    live.add(A, f"{A}-c2")
    live.add(B, f"{B}-c1")
    assert live.expand(A) == [f"{A}-c1", f"{A}-c2"]
    assert live.expand(B) == [f"{B}-c1"]
    assert live.expand_all([A, B]) == [f"{A}-c1", f"{A}-c2", f"{B}-c1"]
    # The base ids are fixed width: no call rid of one sample starts with another sample's base.
    assert not any(rid.startswith(B) for rid in live.expand(A))


def test_a_sample_without_live_calls_is_aborted_by_its_base_rid_and_nothing_is_left_behind():
    live = LiveRids()
    assert live.expand(A) == [A]  # the built-in single-turn path runs as the base rid itself
    live.add(A, f"{A}-c1")
    live.discard(A, f"{A}-c1")
    live.discard(A, f"{A}-c1")  # twice: harmless
    live.discard(B, f"{B}-c9")  # never added: harmless
    assert live.expand(A) == [A] and len(live) == 0 and live._live == {}


def test_each_lease_context_has_a_registry_unless_the_agent_shares_its_own():
    ctx = dict(config=None, reward=None, filter=None, tokenizer=None, dataset=None, client=None, store=None)
    one, two = LeaseContext(**ctx, agent_id="a"), LeaseContext(**ctx, agent_id="a")
    assert one.live_rids is not two.live_rids
    shared = LiveRids()
    assert LeaseContext(**ctx, agent_id="a", live_rids=shared).live_rids is shared
