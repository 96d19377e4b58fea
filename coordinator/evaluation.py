"""Evaluation passes: one pass over a declared evaluation dataset, on the training fleet.

``coordinator serve --eval-dataset NAME=PATH[,n_samples=..,max_new_tokens=..,temperature=..]``
declares a dataset (``EvalSpec``); a trainer's ``evaluate(NAME)`` (an ``Evaluate`` message)
runs one pass over it and is answered with its metrics (``eval_metrics``). Pure: events in,
effects out, like the rest of the core.

How a pass runs:
- Its prompts are a prompt source of the lease book (``EvalSource``, ``coordinator/sources.py``),
  leased through the same grant loop as training prompts, to agents with free capacity, before any
  training prompt (the trainer waits on it). An evaluation lease has data epoch ``EVAL_EPOCH``
  (-1), which no training epoch has: nothing an agent says about it can touch the training
  frontier, and an agent that re-registers with one in flight has it cancelled (its prompt is
  pending again). Its Grant always carries the rows, read from the evaluation file.
- The agent generates the group with the dataset's own samples per prompt and sampling
  settings, scores it with the fleet's reward, skips the dynamic filter and the store, and
  reports the per-sample rewards, lengths and finish reasons (``EvalResult``).
- Training is not disturbed: evaluation leases count neither in the training bound
  (``leased + ready <= demand + prefetch``) nor in bounded staleness, and no training prompt,
  cursor, batch or epoch changes.

Invariants:
- Counted once: a prompt's result is recorded once per pass (``PutEvalResult``, keyed by
  dataset and index); any later result for it, from a reissued lease or an agent that went on
  generating through a coordinator restart, is ignored.
- Durable: each result is in the ledger before it counts, and the pass itself (``EvalRecord``)
  before its first lease. A restarted coordinator resumes the pass: prompts without a result are
  pending again, finished ones are not generated again. A lost ``EvalResult`` needs no ack or
  retransmission: its lease is released (heartbeat reconciliation) and the prompt generated again.
- Idempotent: each ``evaluate`` call carries a token; a resend, or the same call after a
  restart, joins the same pass or gets its recorded metrics. A new call while a pass runs joins
  it (a restarted trainer resumes its evaluation); a new call after it finished starts the next
  pass, which replaces the previous one's results (at most one pass per dataset in the ledger).
- A prompt whose reward or generation fails ``MAX_FAILURES`` times is recorded as failed (counted
  in ``failed_prompts``, left out of the means): a pass always ends.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from common import protocol as p
from coordinator.effects import Persist, Send
from coordinator.frontier import DELIVERED, LEASED, PENDING, EpochFrontier
from coordinator.records import DropEvalResults, EvalRecord, Lease, LedgerSnapshot, PutEvalResult, SetEvalPass

if TYPE_CHECKING:
    from coordinator.lease_book import LeaseBook

EVAL_EPOCH = -1
"""The data epoch of every evaluation lease (no training epoch is negative)."""

MAX_FAILURES = 3
"""Failed attempts after which an evaluation prompt is recorded as failed."""

TOKENS_KEPT = 8
"""``evaluate`` call tokens a pass remembers (a resend carries the newest)."""

DONE = DELIVERED


@dataclass(frozen=True, slots=True)
class EvalSpec:
    """An evaluation dataset as declared at ``coordinator serve``."""

    name: str
    size: int
    fingerprint: str
    n_samples: int
    sampling: dict = field(default_factory=dict)
    """Overrides of the fleet's sampling parameters (``max_new_tokens``, ``temperature``, ...)."""
    pass_threshold: float = 1.0
    """A sample passes (for pass@k) when its reward is at least this."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of a prompt with ``c`` of ``n`` samples passing: 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def eval_metrics(spec: EvalSpec, pass_id: int, results: dict[int, dict]) -> dict:
    """The metrics of a finished pass from its per-prompt results."""
    scored = [r for r in results.values() if "rewards" in r]
    rewards = [x for r in scored for x in r["rewards"]]
    lengths = [x for r in scored for x in r["lengths"]]
    samples = len(rewards)
    out: dict = {
        "name": spec.name,
        "pass": pass_id,
        "prompts": len(results),
        "samples": samples,
        "failed_prompts": len(results) - len(scored),
        "n_samples": spec.n_samples,
        "reward_mean": sum(rewards) / samples if samples else 0.0,
        "response_length_mean": sum(lengths) / samples if samples else 0.0,
        "truncated_ratio": sum(r["truncated"] for r in scored) / samples if samples else 0.0,
    }
    ks = sorted({1 << i for i in range(spec.n_samples.bit_length()) if 1 << i <= spec.n_samples} | {spec.n_samples})
    for k in ks:
        values = []
        for r in scored:
            n = len(r["rewards"])
            if n >= k:
                values.append(pass_at_k(n, sum(x >= spec.pass_threshold for x in r["rewards"]), k))
        out[f"pass@{k}"] = sum(values) / len(values) if values else 0.0
    out["weight_versions"] = sorted({v for r in scored for v in r.get("versions", ())})
    return out


def check_result(result, n_samples: int) -> str:
    """Why an agent's per-prompt result is malformed; "" if it is well formed."""
    if not isinstance(result, dict):
        return f"an evaluation result is a map, not {type(result).__name__}"
    if "failed" in result:
        return "" if isinstance(result["failed"], str) else "'failed' must be a string"
    rewards, lengths, truncated = result.get("rewards"), result.get("lengths"), result.get("truncated")
    if not (isinstance(rewards, list) and rewards and all(_number(x) for x in rewards)):
        return "'rewards' must be a non-empty list of numbers"
    if not (isinstance(lengths, list) and len(lengths) == len(rewards) and all(_count(x) for x in lengths)):
        return "'lengths' must be one non-negative int per reward"
    if not (_count(truncated) and truncated <= len(rewards)):
        return "'truncated' must count the truncated samples"
    if len(rewards) != n_samples:
        return f"{len(rewards)} samples, the dataset asks for {n_samples}"
    return ""


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


class EvalPass:
    """The prompts of one running pass, kept as a frontier epoch (``coordinator/frontier.py``: a state byte
    each, a cursor, a requeue and per-state tallies) in file order; DONE is the frontier's DELIVERED."""

    def __init__(self, spec: EvalSpec, record: EvalRecord, results: dict[int, dict]):
        self.spec = spec
        self.record = record
        self.prompts = EpochFrontier(EVAL_EPOCH, range(spec.size))
        self.results = dict(results)
        for index in self.results:
            self.prompts.move(index, DONE)
        self.failures: dict[int, int] = {}
        self.waiters: list[tuple[bytes, int]] = []

    @property
    def pending(self) -> int:
        return self.prompts.tally[PENDING]

    def take(self) -> int | None:
        index = self.prompts.take(0.0)
        if index is not None:
            self.prompts.move(index, LEASED)
        return index

    def release(self, index: int) -> None:
        if self.prompts.state[index] == LEASED:
            self.prompts.move(index, PENDING)
            self.prompts.requeue.append(index)

    def finish(self, index: int, result: dict) -> bool:
        """Record ``index``'s result; False if it already has one (counted once)."""
        if self.prompts.state[index] == DONE:
            return False
        self.prompts.move(index, DONE)
        self.results[index] = result
        return True

    @property
    def complete(self) -> bool:
        return len(self.results) == self.spec.size

    def progress(self) -> dict:
        return {"pass": self.record.pass_id, "prompts": self.spec.size, "finished": len(self.results),
                "leased": self.prompts.tally[LEASED], "waiting": len(self.waiters)}  # fmt: skip


class EvalSource:
    """The prompts of one evaluation dataset's running pass, as a prompt source of the lease book
    (``coordinator/sources.py``): leased while a trainer waits on the pass, outside the training bound."""

    bounded = False

    def __init__(self, evaluations: Evaluations, name: str):
        self.evaluations = evaluations
        self.name = name
        self.key = p.EVAL_SOURCE + name

    @property
    def run(self) -> EvalPass | None:
        return self.evaluations.passes.get(self.name)

    @property
    def wanted(self) -> int:
        """Prompts waiting for a lease while a trainer waits on the pass."""
        run = self.run
        return run.pending if run is not None and run.waiters else 0

    def take(self, now: float) -> tuple[int, int] | None:
        run = self.run
        if run is None or not run.waiters:
            return None
        index = run.take()
        return None if index is None else (EVAL_EPOCH, index)

    def grant_fields(self, lease: Lease) -> dict:
        run = self.run
        return {"eval_pass": run.record.pass_id, "n_samples": run.spec.n_samples, "sampling": dict(run.spec.sampling)}

    def with_rows(self, rec) -> bool:
        return True  # read from the evaluation file, which agents do not have

    def note_lease(self, lease: Lease, delta: int) -> None:
        pass  # its pass counts its own leased prompts

    def give_back(self, lease: Lease) -> None:
        run = self.run
        if run is not None and 0 <= lease.index < run.spec.size:
            run.release(lease.index)

    def committed(self, lease: Lease) -> None:
        self.give_back(lease)  # a receipt for an evaluation lease (a broken agent): refused, prompt pending

    def filtered(self, lease: Lease, agent_id: str, reason: str) -> list:
        self.give_back(lease)  # evaluation groups are not filtered (a broken agent): generated again
        return []

    def failed(self, lease: Lease, agent_id: str, kind: str, detail: str) -> list:
        """Recorded as failed after ``MAX_FAILURES`` tries."""
        run = self.run
        if run is None or not 0 <= lease.index < run.spec.size:
            return []
        return self.evaluations.fail(run, lease.index, f"{kind}: {detail}")

    def result(self, lease: Lease, msg: p.EvalResult) -> list:
        if (self.name, lease.index) != (msg.name, msg.index):  # the lease's prompt, whatever the message says
            self.give_back(lease)
            return []
        return self.evaluations.on_result(msg)


class Evaluations:
    """Every declared evaluation dataset, its current pass, and the trainers waiting on it."""

    def __init__(self, specs: list[EvalSpec], restored: LedgerSnapshot, leases: LeaseBook):
        """``leases``: the lease book, where each dataset's pass is a prompt source and is granted from."""
        self._leases = leases
        self.specs = {s.name: s for s in specs}
        self.sources = [leases.add_source(EvalSource(self, s.name)) for s in sorted(specs, key=lambda s: s.name)]
        """One prompt source per dataset, in name order (the order passes are granted in)."""
        self.records: dict[str, EvalRecord] = {}
        self.passes: dict[str, EvalPass] = {}  # the unfinished ones
        results: dict[str, dict[int, dict]] = {}
        for (name, index), result in restored.eval_results.items():
            results.setdefault(name, {})[index] = result
        for name, rec in restored.evals.items():
            spec = self.specs.get(name)
            if spec is None:
                continue  # no longer declared: its record stays in the ledger, unused
            self.records[name] = rec
            if not rec.done and rec.fingerprint == spec.fingerprint:  # a changed file: the next call starts over
                mine = {i: r for i, r in results.get(name, {}).items() if 0 <= i < spec.size}
                self.passes[name] = EvalPass(spec, rec, mine)

    # ------------------------------------------------------------------ trainer

    def answer_now(self, peer: bytes, msg: p.Evaluate) -> list | None:
        """The answer an ``evaluate`` call gets at once (an unknown dataset; a resend of a call already answered),
        or None: it joins the dataset's pass (``join``). Its trainer session was checked (coordinator/trainer.py)."""
        if msg.name not in self.specs:
            declared = ", ".join(sorted(self.specs)) or "none"
            why = (
                f"no evaluation dataset {msg.name!r} (declared: {declared}; coordinator serve --eval-dataset NAME=PATH)"
            )
            return [Send(peer, p.Error("unknown_eval", why, msg.req))]
        rec = self.records.get(msg.name)
        if rec is not None and rec.done and msg.token in rec.tokens:
            return [Send(peer, p.Ok(msg.req, dict(rec.metrics)))]  # a resend of a call already answered
        return None

    def join(self, peer: bytes, msg: p.Evaluate) -> list:
        """The call waits on its dataset's pass, started if none runs (its record written first)."""
        spec, rec = self.specs[msg.name], self.records.get(msg.name)
        ops: list = []
        run = self.passes.get(msg.name)
        if run is None:
            rec = EvalRecord(msg.name, (rec.pass_id if rec else 0) + 1, (msg.token,), spec.fingerprint)
            ops += [DropEvalResults(msg.name), SetEvalPass(rec)]
            run = self.passes[msg.name] = EvalPass(spec, rec, {})
            self.records[msg.name] = rec
        elif msg.token not in run.record.tokens:
            rec = dataclasses.replace(run.record, tokens=run.record.tokens[-(TOKENS_KEPT - 1) :] + (msg.token,))
            run.record = self.records[msg.name] = rec
            ops.append(SetEvalPass(rec))
        if (peer, msg.req) not in run.waiters:
            run.waiters.append((peer, msg.req))
        return [Persist(ops, [])] if ops else []

    def finish(self, name: str) -> list:
        """Dataset ``name``'s running pass, answered if it is complete (a pass of no prompts is at once)."""
        run = self.passes.get(name)
        return self._finish(run) if run is not None else []

    def answer_waiters(self, code: str, why: str) -> list[Send]:
        """Answer every waiting ``evaluate`` with an error (a newer trainer attached: ``fenced``; no engine
        left: ``no_capacity``); the passes stay, and the next call resumes them."""
        out = []
        for run in self.passes.values():
            out += [Send(peer, p.Error(code, why, req)) for peer, req in run.waiters]
            run.waiters.clear()
        return out

    # ------------------------------------------------------------------ leases

    @property
    def wanted(self) -> int:
        """Prompts waiting for a lease, over every running pass with a trainer waiting on it."""
        return sum(source.wanted for source in self.sources)

    def grant(self, rollout_id: int, start: int, now: float) -> list:
        """Lease pending evaluation prompts to agents with free capacity, pass by pass (the lease book's grant);
        ``rollout_id`` and ``start`` as the lease book's."""
        granted: list[Send] = []
        for source in self.sources:
            if source.wanted:
                granted += self._leases.grant(source, source.wanted, rollout_id, start, now)
        return [Persist([], granted)] if granted else []

    def fail(self, run: EvalPass, index: int, reason: str) -> list:
        n = run.failures[index] = run.failures.get(index, 0) + 1
        if n < MAX_FAILURES:
            run.release(index)
            return []
        return self._record(run, index, {"failed": reason[: p.MAX_FAILURE_DETAIL]})

    def on_result(self, msg: p.EvalResult) -> list:
        """An agent's result for one prompt (its lease already ended by the caller)."""
        run = self.passes.get(msg.name)
        if run is None or run.record.pass_id != msg.eval_pass or not 0 <= msg.index < run.spec.size:
            return []  # a pass that ended, or another one: nothing to count
        result = msg.result.to_dict()
        why = check_result(result, run.spec.n_samples)
        if why:  # generated again, a bounded number of times (a reward that returns NaN on this row)
            return self.fail(run, msg.index, f"bad_result: {why}")
        return self._record(run, msg.index, result)

    def _record(self, run: EvalPass, index: int, result: dict) -> list:
        if not run.finish(index, result):
            return []  # counted once
        ops: list = [PutEvalResult(run.spec.name, index, result)]
        return self._finish(run, ops)

    def _finish(self, run: EvalPass, ops: list | None = None) -> list:
        """Write ``ops``; if the pass is complete, its metrics too, and answer its waiters after the commit."""
        ops = list(ops or [])
        then: list[Send] = []
        if run.complete:
            metrics = eval_metrics(run.spec, run.record.pass_id, run.results)
            rec = dataclasses.replace(run.record, done=True, metrics=metrics)
            self.records[run.spec.name] = rec
            del self.passes[run.spec.name]
            ops.append(SetEvalPass(rec))
            then = [Send(peer, p.Ok(req, metrics)) for peer, req in run.waiters]
        return [Persist(ops, then)] if ops or then else []

    def statistics(self) -> dict:
        out = {}
        for name, spec in sorted(self.specs.items()):
            run, rec = self.passes.get(name), self.records.get(name)
            if run is not None:
                out[name] = {"running": True, **run.progress()}
            else:
                last = dict(rec.metrics) if rec is not None and rec.done else {}
                out[name] = {"running": False, "prompts": spec.size, "last": last}
        return out
