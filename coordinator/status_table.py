"""``coordinator status`` for people: the statistics as aligned tables.

Renders the same dict ``--json`` prints (``CoordinatorStats`` as
``dataclasses.asdict`` gives it, ``coordinator/records.py``) and nothing
more, so the two never disagree. Keys a table does not know are left to
``--json``; a key it expects but that is missing prints as ``-``, never an
error (an older coordinator answers with fewer keys).
"""

from __future__ import annotations


def _table(header: list[str], rows: list[list]) -> list[str]:
    cells = [header] + [["-" if v is None else str(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in cells]


def _pairs(d: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in d.items()) if d else "none"


def render(stats: dict) -> str:
    agents = stats.get("agents") or {}
    weights = stats.get("weights") or {}
    counts: dict[str, int] = {"alive": 0, "dead": 0, "retired": 0}
    for a in agents.values():
        counts[a.get("status", "?")] = counts.get(a.get("status", "?"), 0) + 1
    state = "starved" if stats.get("starved") else "paused" if stats.get("paused") else "running"
    out = [
        f"agents: {_pairs(counts)}    weights: version {weights.get('version', '-')} "
        f"({weights.get('updates', '-')} updates)    trainer: {stats.get('trainer') or 'none'}    {state}",
        "",
    ]
    rows = []
    for agent_id in sorted(agents):
        a = agents[agent_id]
        engines = a.get("engines") or [{}]
        for i, e in enumerate(engines):
            head = [agent_id, a.get("status"), a.get("capacity"), a.get("leases")] if i == 0 else ["", "", "", ""]
            rows.append(head + [e.get("name"), e.get("state"), e.get("in_flight"), e.get("version")])
    out += _table(["AGENT", "STATUS", "CAPACITY", "LEASES", "ENGINE", "STATE", "IN FLIGHT", "VERSION"], rows)
    if not agents:
        out.append("(no agents)")
    prompts = stats.get("prompts") or {}
    epochs = ", ".join(str(e) for e in stats.get("data_epochs") or ()) or "-"
    repair = ", ".join(str(r) for r in stats.get("batches_in_repair") or ()) or "none"
    out += [
        "",
        f"frontier: data epochs {epochs}; prompts {_pairs(prompts)}",
        f"          leases in flight {stats.get('leased', '-')}, ready groups {stats.get('ready', '-')}, "
        f"prefetch {stats.get('prefetch', '-')}",
        f"batches:  last rollout {stats.get('last_rollout_id', '-')}, consumed up to "
        f"{stats.get('consumed_upto', '-')}, trimmed up to {stats.get('trimmed_upto', '-')}, "
        f"waiting generates {stats.get('pending_generates', '-')}, in repair {repair}",
        f"drops:    filtered prompts {stats.get('filtered_total', '-')}; "
        f"fenced messages {_pairs(stats.get('fenced_messages') or {})}",
    ]
    sources = stats.get("sources") or {}
    if len(sources) > 1 or (sources and "default" not in sources):
        for name, src in sources.items():
            epochs = ", ".join(str(e) for e in src.get("data_epochs") or ()) or "-"
            out.append(
                f"dataset {name}: weight {src.get('weight')}, data epochs {epochs}, "
                f"prompts {_pairs(src.get('prompts') or {})}, filtered {src.get('filtered')}"
            )
    for g in stats.get("gateways") or ():
        out.append(
            f"gateway {g.get('gateway')}: {'up' if g.get('up') else 'DOWN'}, pid {g.get('pid')}, "
            f"{g.get('peers', '-')} peers, messages in {g.get('messages_in', '-')} / out "
            f"{g.get('messages_out', '-')}, restarts {g.get('restarts')}"
        )
    lock = weights.get("lock")
    if lock:
        out.append(f"weights:  update {lock.get('update_id')} by {lock.get('holder')} at step {lock.get('step')}")
    for name, e in sorted((stats.get("evaluations") or {}).items()):
        if e.get("running"):
            line = (
                f"pass {e.get('pass')} running: {e.get('finished')}/{e.get('prompts')} prompts done, "
                f"{e.get('leased')} leased, {e.get('waiting')} caller(s) waiting"
            )
        else:
            last = e.get("last") or {}
            line = f"no pass yet ({e.get('prompts')} prompts)"
            if last:
                line = f"last pass {last.get('pass')}: reward_mean {last.get('reward_mean', 0):.4f}"
                line += f", pass@1 {last.get('pass@1', 0):.4f}"
        out.append(f"eval:     {name}: {line}")
    if stats.get("starved"):
        out.append(f"starved:  {stats['starved']}")
    if stats.get("waiting_for_update"):
        out.append(f"waiting:  {stats['waiting_for_update']}")
    return "\n".join(out)
