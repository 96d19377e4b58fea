"""The agent's generation pool and lease table (pure)."""

from agent.leases import LeaseState, LeaseTable
from agent.pool import GenerationPool


def test_least_loaded_healthy_engine_gets_the_group_and_capacity_follows_health():
    pool = GenerationPool(16)
    pool.set_engine("e0", "http://a", True)
    pool.set_engine("e1", "http://b", True)
    assert pool.capacity() == 32
    first = pool.pick()
    pool.start(first, 8)
    second = pool.pick()
    assert second.name != first.name
    assert pool.set_engine(second.name, None, False) is True
    assert pool.capacity() == 16
    assert pool.pick().name == first.name
    pool.set_engine(first.name, None, False)
    assert pool.pick() is None and pool.capacity() == 0


def test_a_lease_holds_its_slots_from_assignment_until_freed_or_forgotten_and_never_twice():
    table = LeaseTable(8)
    table.set_engine("e0", "healthy", "http://a")
    rec = table.add(5, 0, 3)
    first = table.assign(rec, 4)
    assert first.request_ids == tuple(f"rf-{5:016x}-000-{i:04d}" for i in range(4))
    assert rec.state is LeaseState.GENERATING and table.pool.engines["e0"].in_flight == 4
    table.free(rec)
    table.free(rec)
    assert table.pool.engines["e0"].in_flight == 0, "freed once, however often asked"
    assert table.assign(rec, 4).request_ids[0].endswith("-001-0000"), "each attempt has new request ids"
    assert table.pop(5) is rec and table.pool.engines["e0"].in_flight == 0 and 5 not in table
    table.set_engine("e0", "down")
    assert table.assign(table.add(6, 0, 4), 4) is None and table.capacity() == 0
