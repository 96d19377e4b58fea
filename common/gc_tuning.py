"""Garbage-collector settings for the long-running processes (coordinator, gateways, agents).

Each of them holds a large live heap built at start-up (the dataset's index, the ledger's state,
the lease book) and churns through small short-lived objects per message. With CPython's default
thresholds a full collection then runs about twice a second at high load, rescans the whole live
heap and frees almost nothing: measured in the coordinator under W3 at N = 1000, 15-66 ms per
collection, which is the event loop stalled and every grant behind it late. Freezing the start-up
heap takes it out of every later collection; higher thresholds make collections rarer, and the
few reference cycles these processes make (tasks, exceptions) wait a little longer to be freed.
"""

from __future__ import annotations

import gc

# A young collection every 50,000 net allocations, a middle one every 50 of those and a full one
# every 100 middle ones (CPython's further rule, a full pass only once the objects promoted since
# the last one are a quarter of the old heap, still applies).
THRESHOLDS = (50_000, 50, 100)


def quiet_gc() -> None:
    """Call once start-up is done, just before serving."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)
