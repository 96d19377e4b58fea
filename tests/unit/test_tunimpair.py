"""The TUN impairer's pure part (harness/tunimpair.py ``Impairer``): netem's rules on packets, no device."""

from __future__ import annotations

import pytest

from harness.tunimpair import LIMIT, Impairer

OCTET = 201


def packet(seq: int, to_agent: bool = False, agent: int = 0) -> bytes:
    """A minimal IPv4 header: coordinator 10.X.0.1, agent ``i`` 10.X.(i+1).2; ``seq`` in the payload."""
    ours, theirs = bytes([10, OCTET, agent + 1, 2]), bytes([10, OCTET, 0, 1])
    src, dst = (theirs, ours) if to_agent else (ours, theirs)
    return bytes([0x45]) + bytes(11) + src + dst + seq.to_bytes(4, "big")


def seqs(packets) -> list[int]:
    return [int.from_bytes(p[20:24], "big") for p in packets]


def drain(imp: Impairer, until: float) -> list[bytes]:
    out, t = [], 0.0
    while t <= until:
        out += imp.due(t)
        t += 0.001
    return out


def test_without_rules_packets_pass_at_once_and_links_are_told_apart():
    imp = Impairer(OCTET)
    assert imp.link_of(packet(1)) == (0, "to_coordinator")
    assert imp.link_of(packet(1, to_agent=True, agent=1)) == (1, "to_agent")
    assert imp.link_of(b"\x60" + bytes(39)) is None  # IPv6: not a harness link
    imp.offer(packet(1), 0.0)
    assert seqs(imp.due(0.0)) == [1]


def test_delay_with_jitter_keeps_order_unless_reordering_is_asked():
    imp = Impairer(OCTET, seed=3)
    imp.command({"cmd": "set", "agent": 0, "delay_ms": 20, "jitter_ms": 15})
    for i in range(200):
        imp.offer(packet(i), i * 0.001)
    assert imp.due(0.004) == []  # nothing before delay - jitter
    assert seqs(drain(imp, 1.0)) == list(range(200))


def test_reorder_loss_and_duplication_follow_their_probabilities():
    imp = Impairer(OCTET, seed=5)
    imp.command({"cmd": "set", "agent": 0, "direction": "to_coordinator", "delay_ms": 30, "reorder": 0.25})
    for i in range(400):
        imp.offer(packet(i), i * 0.001)
    got = seqs(drain(imp, 2.0))
    assert sorted(got) == list(range(400)) and got != list(range(400))
    assert 60 < imp.stats["reordered"] < 140
    imp.command({"cmd": "set", "agent": 0, "loss": 0.1, "duplicate": 0.1})
    for i in range(800):  # the queue holds at most LIMIT (1000)
        imp.offer(packet(i, to_agent=True), 3.0)
    got = seqs(imp.due(3.0))
    assert 40 < imp.stats["lost"] < 120 and 40 < imp.stats["duplicated"] < 120
    assert len(got) == 800 - imp.stats["lost"] + imp.stats["duplicated"] and imp.stats["overflow"] == 0


def test_drop_is_a_silent_partition_and_clear_lifts_it():
    imp = Impairer(OCTET)
    imp.command({"cmd": "set", "agent": 0, "drop": True})
    imp.offer(packet(1), 0.0)
    imp.offer(packet(2, agent=1), 0.0)  # the other agent's link is untouched
    assert seqs(imp.due(0.0)) == [2]
    imp.command({"cmd": "clear", "agent": 0})
    imp.offer(packet(3), 0.0)
    assert seqs(imp.due(0.0)) == [3]


def test_the_queue_is_bounded_and_bad_rules_are_refused():
    imp = Impairer(OCTET)
    imp.command({"cmd": "set", "agent": 0, "delay_ms": 1000})
    for i in range(LIMIT + 10):
        imp.offer(packet(i), 0.0)
    assert len(imp.queue) == LIMIT and imp.stats["overflow"] == 10
    with pytest.raises(ValueError, match="loss"):
        imp.command({"cmd": "set", "agent": 0, "loss": 1.5})
    with pytest.raises(ValueError, match="unknown command"):
        imp.command({"cmd": "reboot"})
