"""The agent's generation pool (pure)."""

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
