"""What the chaos run reads back: the consumed stream, agents' stores, and views of the coordinator's ledger.

The readers open LMDB read-only; ``read_store`` is meant for a stopped agent, the ledger views work on a
running coordinator's ledger (``coordinator.ledger.read_ledger`` takes a consistent snapshot).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import lmdb
import msgpack

from coordinator.records import LedgerSnapshot
from harness.chaos_check import StoreContents


def read_consumed(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_store(data_dir: Path) -> StoreContents:
    """An agent's committed groups and unacknowledged receipts, read after it stopped."""
    if not (data_dir / "store").exists():
        return StoreContents(frozenset(), {})
    env = lmdb.open(str(data_dir / "store"), readonly=True, lock=False, max_dbs=4)
    try:
        with env.begin() as txn:
            groups = frozenset(k.decode() for k, _ in txn.cursor(db=env.open_db(b"groups", txn=txn, create=False)))
            outbox = {
                k.decode(): msgpack.unpackb(v, raw=False)
                for k, v in txn.cursor(db=env.open_db(b"outbox", txn=txn, create=False))
            }
        return StoreContents(groups, outbox)
    finally:
        env.close()


def unfetched_by_agent(ledger: LedgerSnapshot) -> Counter:
    """Groups per agent that no trainer has fetched: ready, or in a batch past ``consumed_upto``."""
    held = Counter(st.agent_id for st in ledger.prompts.values() if st.ready)
    for rid, batch in ledger.batches.items():
        if rid > ledger.consumed_upto:
            held.update(g.agent_id for g in batch.groups)
    return held


def pending_behind_cursor(ledger: LedgerSnapshot, order: Sequence[int]) -> set[tuple[int, int]]:
    """Prompts of open epochs handed out before (below the cursor in ``order``) that have no ledger record:
    in flight, or back to pending (requeued, orphaned, reopened)."""
    return {
        (e, order[pos])
        for e, cursor in ledger.cursors.items()
        for pos in range(cursor)
        if (e, order[pos]) not in ledger.prompts
    }
