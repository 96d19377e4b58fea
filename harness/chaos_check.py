"""The chaos run's invariant checker: pure, over what a quiesced run left behind.

Inputs (``RunEvidence``), all read after the fleet was quiesced (trainer done,
admission paused, no lease in flight, every surviving agent registered) and
then stopped:

- the trainer's consumed stream: one record per batch it returned, across its
  kills and resumes (a batch after the resume checkpoint is fetched again);
- the coordinator's statistics at quiesce (its in-memory frontier counts);
- the coordinator's ledger (``coordinator.ledger.read_ledger``);
- every agent's store (committed groups and unacknowledged receipts);
- which agents were lost for good, and how many failures of each kind the
  schedule actually caused.

Checks, each reported as a problem naming the prompt, group or agent:

1. The stream: batch ids 0..N-1, each exactly ``rollout_batch_size`` groups
   (never a silent short batch); a batch fetched again after a resume has the
   same groups unless it was repaired (a node was retired); no prompt in two
   batches of the final stream (``duplicated``).
2. Prompt accounting over every state: the ledger's records lie in open
   epochs only; its READY/DELIVERED/FILTERED counts equal the coordinator's
   frontier counts, and the five states sum to epochs x dataset size (a state
   outside the five would make them fall short); nothing is LEASED in a
   quiesced fleet ("no prompt forgotten"); every prompt of the final stream
   in an open epoch is DELIVERED in the ledger, in that batch, from that
   agent; every DELIVERED record is in a batch some trainer fetched; every
   recorded batch's groups are DELIVERED records of that batch; FILTERED ones
   have a reason (``unaccounted``).
3. Ledger against stores: a group the ledger says is READY, or in a recorded
   (untrimmed) batch, on agent X is in X's store unless X was lost for good
   (``lost``); every group X stores is referenced by the ledger or trimmable
   (its epoch closed, its batch trimmed, its prompt accounted for by another
   group); an unacknowledged receipt names a group the coordinator holds; a
   node lost for good was retired and nothing READY or batched points at it.
4. Weights (``weight_updates``): at quiesce no update holds the weight lock; every
   serving (healthy) engine of every alive agent is on the coordinator's version,
   as the engine itself reports it (``/model_info``) and as the coordinator sees
   it (stale engines are out of the pool and not counted); versions never went
   backwards: the trainer's successful updates, in the order it recorded them
   across its restarts, rise strictly, each answered with every engine on its
   version, and the coordinator's version is at least the last of them, its
   update count at least their number; at least one update of each kind pushed
   succeeded. A version update may fail only when the coordinator or a trainer
   died inside it (``EXPLAINED_BY``), it found no engine up at all with a member
   lost inside it (``NO_ENGINE_UP``), or two members were lost inside it (``MEMBER_FAULTS``: one
   is left out or costs the one retry); each failure's cause and the faults
   inside it are counted. A
   catch-up resends the fleet's version, never one below the last pushed.
5. The schedule: every failure kind happened at least once.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

from common.mixture import EPOCH_BITS, epoch_key
from coordinator.records import LedgerSnapshot
from harness.chaos_eval import check_evaluations

KINDS = ("agent", "engine", "hang", "coordinator", "trainer", "partition", "node_lost", "node_join")
"""Failure kinds the chaos schedule causes; a run that misses one fails."""
WEIGHT_FAULTS = ("engine_in_update", "trainer_in_update")
"""Faults timed to a weight update in flight, caused too when the run pushes weights (the trainer's
only with torch: it needs a broadcast)."""
EXPLAINED_BY = ("coordinator", "trainer", "trainer_in_update")
"""Faults that may fail a weight update inside which they fall: the coordinator holds the update's state, and
a trainer killed meanwhile leaves its own update unrecorded in the log while a disk update of it goes on
without it, so the resumed trainer's next version can meet "not greater than the fleet's current version"."""
MEMBER_FAULTS = ("engine", "engine_in_update", "agent", "partition", "node_lost", "disk_full")
"""Faults that lose a member of an update: one is left out, or costs the broadcast its one retry; a failure
needs two of them inside it (one per attempt). Any other failure of a version update is a problem."""
NO_ENGINE_UP = "no engine is up to receive it"
"""The coordinator's refusal of an update whose begin found no engine to confirm anywhere."""
FAULT_SLACK = 3.0
"""Seconds before an update's start within which a fault still counts as inside it (a coordinator killed
just before, still restarting (its ledger read on loaded cores) when the update's first request is sent)."""

STATES = ("pending", "leased", "ready", "delivered", "filtered")


@dataclass(frozen=True)
class StoreContents:
    groups: frozenset[str]
    """Keys of the committed groups."""
    outbox: dict[str, dict]
    """Key -> the receipt still waiting for its acknowledgement."""


@dataclass
class RunEvidence:
    batches: int
    batch_size: int
    dataset_size: int
    """The first dataset's prompts (of a single-dataset run, all)."""
    consumed: list[dict]
    """Trainer records in write order: ``rid``, ``groups`` ([data_epoch, index, agent_id] each),
    ``replaced``, ``lengths_ok``."""
    stats: dict
    """Coordinator statistics at quiesce (``CoordinatorStats`` as a dict)."""
    ledger: LedgerSnapshot
    stores: dict[str, StoreContents]
    lost_agents: set[str] = field(default_factory=set)
    kills: Counter = field(default_factory=Counter)
    kinds: tuple[str, ...] = KINDS
    """The failure kinds the schedule had to cause, each at least once."""
    faults: list[tuple[float, str]] = field(default_factory=list)
    """``(wall-clock time, kind)`` of every failure caused, to find the ones inside a failed update."""
    never_reissued: set[tuple[int, int]] = field(default_factory=set)
    """Prompts behind the cursor still without a record after the extra batches pulled at quiesce."""
    weight_updates: list[dict] = field(default_factory=list)
    """The trainers' update attempts in write order: ``kind`` (``disk``, ``distributed`` or ``catch_up``),
    ``version``, ``ok``, ``engines`` (when ok) or ``error``, ``retried`` (a broadcast retried once), ``t0``
    and ``t1`` (wall-clock start and end)."""
    weight_kinds: tuple[str, ...] = ()
    """Kinds of update pushed, each of which must have succeeded at least once (none: no updates pushed)."""
    engine_versions: dict[str, str | None] = field(default_factory=dict)
    """``agent/engine`` -> ``/model_info`` ``weight_version`` at quiesce, for every engine ``stats`` calls
    healthy on an alive agent (None: it did not answer)."""
    evaluations: list[dict] = field(default_factory=list)
    """The trainers' ``evaluate`` calls in write order: ``rid``, ``ok``, ``metrics`` or ``error``."""
    dataset_sizes: dict[str, int] = field(default_factory=dict)
    """Each training dataset's prompts, by name in ``SOURCES`` order (empty: one dataset of ``dataset_size``)."""
    shares: dict[str, int] = field(default_factory=dict)
    """Each dataset's groups in every full batch (empty: not checked)."""

    def sizes(self) -> list[int]:
        """Prompts by dataset number."""
        return list(self.dataset_sizes.values()) or [self.dataset_size]

    def open_keys(self) -> set[int]:
        """The open data epochs of every dataset, as prompt keys (common/mixture.py)."""
        sources = self.stats.get("sources") or {}
        if not self.dataset_sizes:
            return set(self.stats["data_epochs"])
        return {epoch_key(s, e) for s, name in enumerate(self.dataset_sizes) for e in sources[name]["data_epochs"]}


SOURCES = ("arith", "exact")
"""The chaos run's two training datasets (``--dataset NAME=PATH,...``), in order: a group's dataset number."""


def batch_record(batch, run: str) -> dict:
    """One consumed-stream record of a ``RolloutBatch`` (what the trainers write, one JSON line each). A group is
    ``[key, index, agent_id, source]``: ``key`` its dataset's number and data epoch as the coordinator's prompt key
    (common/mixture.py ``epoch_key``), so prompts compare with the ledger's."""
    number = {name: i for i, name in enumerate(SOURCES)}
    return {
        "rid": batch.rollout_id,
        "run": run,
        "groups": [
            [epoch_key(number.get(g.source, 0), g.data_epoch), g.index, g.agent_id, g.source] for g in batch.groups
        ],
        "composition": {name: sum(g.source == name for g in batch.groups) for name in SOURCES},
        "lengths_ok": all(
            len(s.response_tokens) == len(s.response_logprobs) == len(s.loss_mask) for s in batch.samples
        ),
        "tool_samples": sum(0 in s.loss_mask for s in batch.samples),  # multi-turn: a tool's tokens inserted
        "replaced": batch.metrics.get("rollout/replaced_groups", 0),
    }


@dataclass
class Findings:
    batches: int = 0
    duplicated: int = 0
    lost: int = 0
    replay_mismatches: int = 0
    unaccounted_prompts: int = 0
    replaced_groups: int = 0
    tool_samples: int = 0
    """Samples in the final stream with tokens a generate function inserted (multi-turn runs)."""
    evaluations: int = 0
    """Evaluation passes that returned, each counting every evaluation prompt once (harness/chaos_eval.py)."""
    weight_updates: dict = field(default_factory=dict)
    """Update attempts by outcome: ``{"disk": ok, "distributed": ok, "catch_up": ok, "retried": n,
    "failed": n}``, and with failures ``failure_causes`` (how many failed of each cause: the error with its
    numbers and ids taken out) and ``failed_during`` (the faults that fell inside failed updates, by kind;
    ``none`` for a failure with none inside)."""
    problems: list[str] = field(default_factory=list)


def check(ev: RunEvidence) -> Findings:
    out = Findings()
    final, ever = _check_stream(ev, out)
    _check_accounting(ev, final, ever, out)
    _check_stores(ev, out)
    _check_weights(ev, out)
    out.evaluations = check_evaluations(ev.evaluations, ev.ledger, out.problems)
    for prompt in sorted(ev.never_reissued):
        _unaccounted(out, f"prompt {prompt} came back to pending and was never leased again (forgotten)")
    for kind in ev.kinds:
        if ev.kills[kind] < 1:
            out.problems.append(f"schedule: no {kind} failure happened")
    return out


def _unaccounted(out: Findings, why: str) -> None:
    out.unaccounted_prompts += 1
    out.problems.append(why)


# ---------------------------------------------------------------------- 1. the consumed stream


def _check_stream(ev: RunEvidence, out: Findings) -> tuple[dict, dict]:
    """Returns the final stream ``rid -> record`` and ``prompt -> rids`` it appeared in, in any version."""
    final: dict[int, dict] = {}
    ever: dict[tuple[int, int], set[int]] = {}
    for rec in ev.consumed:
        rid = rec["rid"]
        prev = final.get(rid)
        if prev is not None and _keys(prev) != _keys(rec) and not rec["replaced"]:
            out.replay_mismatches += 1
            out.problems.append(f"rollout {rid} fetched again with different groups and no replacement")
        final[rid] = rec
        if not rec["lengths_ok"]:
            out.problems.append(f"rollout {rid}: token, logprob and loss-mask lengths differ")
        if len(rec["groups"]) != ev.batch_size:
            out.problems.append(f"rollout {rid} has {len(rec['groups'])} groups, not {ev.batch_size}")
        if ev.shares and rec.get("composition") != ev.shares and not rec["replaced"]:
            out.problems.append(f"rollout {rid} holds {rec.get('composition')} groups by dataset, not {ev.shares}")
        for epoch, index, *_ in rec["groups"]:
            ever.setdefault((epoch, index), set()).add(rid)
    out.batches = len(final)
    if sorted(final) != list(range(ev.batches)):
        out.problems.append(f"consumed rollout ids {sorted(final)} != 0..{ev.batches - 1}")
    seen: dict[tuple[int, int], int] = {}
    for rid, rec in sorted(final.items()):
        out.replaced_groups += int(rec["replaced"])
        out.tool_samples += int(rec.get("tool_samples", 0))
        for epoch, index, *_ in rec["groups"]:
            if (epoch, index) in seen:
                out.duplicated += 1
                first = seen[(epoch, index)]
                out.problems.append(f"prompt {(epoch, index)} trained twice: in rollouts {first} and {rid}")
            seen[(epoch, index)] = rid
    return final, ever


def _keys(rec: dict) -> list:
    return sorted(map(tuple, rec["groups"]))


# ---------------------------------------------------------------------- 2. prompt accounting


def _check_accounting(ev: RunEvidence, final: dict, ever: dict, out: Findings) -> None:
    ledger, stats = ev.ledger, ev.stats
    open_epochs = ev.open_keys()
    sizes = ev.sizes()
    if set(ledger.cursors) != open_epochs:
        out.problems.append(
            f"open epochs differ: ledger cursors {sorted(ledger.cursors)}, coordinator {sorted(open_epochs)}"
        )
    counts = Counter()
    for (epoch, index), st in ledger.prompts.items():
        if epoch not in open_epochs or not 0 <= index < sizes[epoch >> EPOCH_BITS]:
            _unaccounted(out, f"ledger holds prompt {(epoch, index)} outside the open epochs {sorted(open_epochs)}")
            continue
        counts[st.status_name] += 1
        if st.filtered and not st.reason:
            _unaccounted(out, f"prompt {(epoch, index)} filtered without a reason")
        if st.delivered and st.rollout_id not in ever.get((epoch, index), ()):
            _unaccounted(
                out,
                f"prompt {(epoch, index)} is delivered in rollout {st.rollout_id} (ledger) "
                "but no trainer fetched it there",
            )
    frontier = stats["prompts"]
    expected = sum(sizes[key >> EPOCH_BITS] for key in open_epochs)
    if set(frontier) != set(STATES) or sum(frontier.values()) != expected:
        _unaccounted(
            out,
            f"frontier states {frontier} do not cover the {len(open_epochs)} open epoch(s) "
            f"of {sizes} prompts ({expected}) exactly once",
        )
    for name in ("ready", "delivered", "filtered"):
        if frontier.get(name, 0) != counts[name]:
            n = frontier.get(name, 0)
            _unaccounted(out, f"{n} prompts {name} in the coordinator, {counts[name]} in its ledger")
    if stats["ready"] != counts["ready"]:
        _unaccounted(out, f"coordinator holds {stats['ready']} ready groups, its ledger {counts['ready']}")
    if frontier.get("leased", 0) or stats["leased"]:
        _unaccounted(
            out,
            f"quiesced fleet still has {stats['leased']} lease(s), "
            f"{frontier.get('leased', 0)} prompt(s) leased: stuck, never reissued",
        )
    for agent_id, entry in stats["agents"].items():
        if entry["leases"]:
            _unaccounted(out, f"quiesced agent {agent_id} ({entry['status']}) still holds {entry['leases']} lease(s)")
    # Every prompt of the final stream in an open epoch is delivered there, from that agent.
    for rid, rec in sorted(final.items()):
        for epoch, index, agent_id, *_ in rec["groups"]:
            if epoch not in open_epochs:
                continue  # a closed epoch: every prompt of it is done
            st = ledger.prompts.get((epoch, index))
            if st is None:
                _unaccounted(
                    out,
                    f"prompt {(epoch, index)} trained in rollout {rid} is pending again "
                    "(forgotten: it would be generated and trained twice)",
                )
            elif not st.delivered or st.rollout_id != rid or st.agent_id != agent_id:
                _unaccounted(
                    out,
                    f"prompt {(epoch, index)} trained in rollout {rid} from {agent_id}, but the "
                    f"ledger has it {st.status_name} in rollout {st.rollout_id} from {st.agent_id}",
                )
    in_batch: dict[tuple[int, int], int] = {}
    for rid, batch in sorted(ledger.batches.items()):
        for g in batch.groups:
            if g.prompt in in_batch:
                out.duplicated += 1
                out.problems.append(f"prompt {g.prompt} in recorded batches {in_batch[g.prompt]} and {rid}")
            in_batch[g.prompt] = rid
            st = ledger.prompts.get(g.prompt)
            if g.data_epoch in open_epochs and (
                st is None or not st.delivered or st.rollout_id != rid or st.key != g.key
            ):
                _unaccounted(
                    out,
                    f"recorded batch {rid} holds {g.key} but the ledger's prompt {g.prompt} is "
                    f"{st.status_name + ' ' + repr(st.key) if st else 'pending'}",
                )


# ---------------------------------------------------------------------- 3. ledger against stores


def _prompt_of(key: str) -> tuple[int, int]:
    epoch, index, _ = key.split(":", 2)
    return int(epoch), int(index)


def _check_stores(ev: RunEvidence, out: Findings) -> None:
    ledger = ev.ledger
    floors: dict[int, int] = {}  # the oldest open epoch key of each dataset
    for key in ev.open_keys():
        source = key >> EPOCH_BITS
        floors[source] = min(floors.get(source, key), key)
    expected: dict[str, set[str]] = {}
    for st in ledger.prompts.values():
        if st.ready:
            expected.setdefault(st.agent_id, set()).add(st.key)
    for batch in ledger.batches.values():
        for g in batch.groups:
            expected.setdefault(g.agent_id, set()).add(g.key)
    for agent_id in sorted(ev.lost_agents):
        entry = ev.stats["agents"].get(agent_id)
        if entry is not None and entry["status"] != "retired":
            out.problems.append(f"{agent_id} was lost for good but is {entry['status']!r}, not retired")
        for key in sorted(expected.get(agent_id, ())):
            out.lost += 1
            out.problems.append(f"{key} is ready or batched on {agent_id}, a node lost for good (never regenerated)")
    for agent_id, store in sorted(ev.stores.items()):
        if agent_id in ev.lost_agents:
            continue
        for key in sorted(expected.get(agent_id, set()) - store.groups):
            out.lost += 1
            out.problems.append(f"{key} is ready or batched on {agent_id} (ledger) but not in its store")
        referenced = expected.get(agent_id, set())
        for key in sorted(store.groups - referenced):
            prompt = _prompt_of(key)
            st = ledger.prompts.get(prompt)
            if key in store.outbox:
                if st is None or st.key != key:
                    what = f"{st.status_name} as {st.key}" if st else "pending"
                    _unaccounted(out, f"{agent_id} stores {key} with an unsettled receipt; its prompt is {what}")
                continue
            trimmable = (
                prompt[0] < floors.get(prompt[0] >> EPOCH_BITS, 0)  # its epoch closed
                or (st is not None and st.key != key)  # refused: the prompt is another group's
                or (st is not None and st.delivered and st.rollout_id not in ledger.batches)  # batch trimmed
                or (st is not None and st.filtered)
            )
            if not trimmable:
                what = f"{st.status_name} in rollout {st.rollout_id}" if st else "pending"
                _unaccounted(
                    out,
                    f"{agent_id} stores {key}, which nothing references and is not trimmable (its prompt is {what})",
                )
        for key in sorted(set(store.outbox) - store.groups):
            out.problems.append(f"{agent_id} has a receipt for {key} without the group")


# ---------------------------------------------------------------------- 4. weights


def _label(version) -> int | None:
    """A weight version as an int (SGLang's label ``"default"`` is 0); None if it is no version."""
    if version == "default":
        return 0
    try:
        return int(version)
    except (TypeError, ValueError):
        return None


def _check_weights(ev: RunEvidence, out: Findings) -> None:
    weights = ev.stats.get("weights") or {}
    current = weights.get("version", 0)
    if weights.get("lock") is not None:
        out.problems.append(f"weights: the quiesced fleet still holds the weight lock {weights['lock']}")
    serving = {
        f"{agent_id}/{e['name']}": e.get("version")
        for agent_id, entry in ev.stats["agents"].items()
        if entry["status"] == "alive"
        for e in entry.get("engines", ())
        if e.get("state") == "healthy"
    }
    for key, seen in sorted(serving.items()):
        if _label(seen) != current:
            out.problems.append(f"weights: the coordinator sees serving engine {key} on version {seen}, not {current}")
        label = ev.engine_versions.get(key)
        if label is None:
            out.problems.append(f"weights: serving engine {key} did not report its version (/model_info)")
        elif _label(label) != current:
            out.problems.append(f"weights: serving engine {key} reports version {label!r}, the fleet is on {current}")
    counts = Counter(dict.fromkeys(("disk", "distributed", "catch_up", "retried", "failed"), 0))
    last = None
    causes: Counter = Counter()
    during: Counter = Counter()
    for rec in ev.weight_updates:
        if not rec["ok"]:
            counts["failed"] += 1
            cause = failure_cause(rec.get("error", ""))
            causes[cause] += 1
            inside = _faults_inside(ev.faults, rec)
            during.update(inside or ["none"])
            members_lost = sum(k in MEMBER_FAULTS for k in inside)
            # Refused at its begin because no engine was up at all (every one killed or restarting): the faults
            # inside it took the fleet's engines down, not an engine out of a formed group.
            nothing_up = NO_ENGINE_UP in rec.get("error", "") and members_lost >= 1
            explained = set(inside) & set(EXPLAINED_BY) or members_lost >= 2 or nothing_up
            if rec["kind"] != "catch_up" and ev.faults and not explained:
                out.problems.append(
                    f"weights: a {rec['kind']} update to {rec.get('version')} failed with no coordinator or trainer "
                    f"death and fewer than two members lost inside it (faults inside: {sorted(inside) or 'none'}): "
                    f"{rec.get('error', '')[:200]}"
                )
            continue
        counts[rec["kind"]] += 1
        counts["retried"] += bool(rec.get("retried"))
        version = rec["version"]
        if rec["kind"] == "catch_up":  # the fleet's version again, to the engines behind it
            if last is not None and version < last:
                out.problems.append(f"weights: a catch-up sent version {version} after version {last}: backwards")
            off = {e: v for e, v in rec.get("engines", {}).items() if v != version}
            if off:
                out.problems.append(f"weights: catch-up to {version} answered ok with engines {off} off it")
            continue
        if last is not None and version <= last:
            out.problems.append(f"weights: version {version} ({rec['kind']}) succeeded after version {last}: backwards")
        last = version if last is None else max(last, version)
        off = {e: v for e, v in rec.get("engines", {}).items() if v != version}
        if off:
            out.problems.append(f"weights: update to {version} answered ok with engines {off} off it")
    out.weight_updates = dict(counts)
    if causes:
        out.weight_updates["failure_causes"] = dict(causes.most_common())
        out.weight_updates["failed_during"] = dict(during.most_common())
    if last is not None and current < last:
        out.problems.append(f"weights: the coordinator is on version {current}, below {last}, recorded as pushed")
    pushed = counts["disk"] + counts["distributed"]
    if weights.get("updates", 0) < pushed:
        out.problems.append(f"weights: the coordinator counts {weights.get('updates', 0)} updates, {pushed} succeeded")
    for kind in ev.weight_kinds:
        if counts[kind] < 1:
            out.problems.append(f"weights: no {kind} update succeeded ({counts['failed']} failed)")


def _faults_inside(faults: list[tuple[float, str]], rec: dict) -> list[str]:
    """Kinds of the faults caused while the update ``rec`` ran (from ``FAULT_SLACK`` before its start)."""
    if "t0" not in rec or "t1" not in rec:
        return []
    return [kind for at, kind in faults if rec["t0"] - FAULT_SLACK <= at <= rec["t1"]]


def failure_cause(error: str) -> str:
    """A failed weight update's error with its numbers, ids, addresses and paths taken out, so that
    failures of one cause count together in the summary."""
    text = re.sub(r"0x[0-9a-f]+|\[[^\]]*\]|/\S+|\d+(\.\d+)?", "#", error)
    return re.sub(r"\s+", " ", text).strip()[:160]
