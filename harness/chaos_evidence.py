"""What the chaos run reads back: the trainers' logs, agents' stores, views of the coordinator's ledger and the
weight versions engines report.

The readers open LMDB read-only; ``read_store`` is meant for a stopped agent, the ledger views work on a
running coordinator's ledger (``coordinator.ledger.read_ledger`` takes a consistent snapshot).
"""

from __future__ import annotations

import json
import urllib.request
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import lmdb
import msgpack

from coordinator.records import LedgerSnapshot
from harness.chaos_check import StoreContents


def read_consumed(path: Path) -> list[dict]:
    """A JSON-lines log (the consumed stream, the weight-update attempts); empty if it was never written."""
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


def alive_engines(stats: dict) -> dict[str, dict]:
    """``agent/engine`` -> the status entry of every engine of an alive agent in the coordinator's ``stats``."""
    return {
        f"{agent_id}/{e['name']}": e
        for agent_id, entry in stats["agents"].items()
        if entry["status"] == "alive"
        for e in entry.get("engines", ())
    }


def serving_engines(stats: dict) -> dict[str, str]:
    """``agent/engine`` -> URL of every engine the coordinator's ``stats`` call healthy on an alive agent."""
    return {key: e["url"] for key, e in alive_engines(stats).items() if e.get("state") == "healthy" and e.get("url")}


def read_engine_versions(engines: dict[str, str], timeout: float = 2.0) -> dict[str, str | None]:
    """``/model_info`` ``weight_version`` of each engine (None for one that does not answer)."""
    out: dict[str, str | None] = {}
    for key, url in engines.items():
        try:
            with urllib.request.urlopen(f"{url}/model_info", timeout=timeout) as resp:
                out[key] = str(json.loads(resp.read())["weight_version"])
        except (OSError, ValueError, KeyError):
            out[key] = None
    return out
