"""Replay: the trainer-facing protocol served from recorded batches, with no agents and no engines.

``ReplayCore.handle(msg)`` takes one decoded trainer message and returns the replies, each
``(message, frames)``; the shell (coordinator/replay_server.py) does the socket. It speaks what a
coordinator speaks to a trainer, and also what an agent's payload endpoint speaks (``Fetch``): a
``generate`` is answered with references whose payload address is this replay itself, so the
client assembles the batch by its one code path, and ``to_tensors()`` is that of the recorded batch.

Invariants:
- ``generate(t)`` of a recorded id returns batch ``t`` as recorded: the same groups in the same
  order, the same samples, the same metrics (``rollout/wait_seconds`` and ``rollout/fetch_seconds``
  are measured again by the client, as on a fleet). Asked again, the same batch. An id not recorded
  is an error (``not_recorded``) naming the ids there are; nothing waits.
- Sessions as on a fleet: an ``attach`` whose expected config differs from the recorded fleet's is
  refused (``config_mismatch``); a newer attach fences the previous trainer's session.
- ``pause``/``resume`` set the state a fleet would; ``state_dict`` needs a pause (``not_drained``
  otherwise) and makes the checkpoint a fleet would, on the recorded dataset's fingerprint, so a
  checkpoint of the recorded run loads here and one made here loads on that fleet.
- Weight updates are accepted and logged as not applied (there are no engines): their versions
  must still rise, as on a fleet (``weights_version``); a broadcast forms a group of the trainer
  alone (world size 1), so the trainer's code runs unchanged.
- ``evaluate(name)`` returns the recorded passes of ``name`` in order, one per call (a resend of
  the same call, the same pass); ``load_state_dict(state)`` moves each name back to the first pass
  recorded after ``state["rollout_id"]``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from common import protocol as p
from common.weight_step import WeightKind
from coordinator.recorded_run import RecordedRun
from coordinator.trainer import config_differences

log = logging.getLogger("rollfleet.replay")

CLIENT_METRICS = ("rollout/wait_seconds", "rollout/fetch_seconds")
"""Metrics the client measures itself on every ``generate``: not served, measured again."""

Reply = tuple[p.Message, list[bytes]]


class ReplayCore:
    def __init__(self, run: RecordedRun, payload_address: str, new_session: Callable[[], int]):
        self.run = run
        self.payload_address = payload_address
        self._new_session = new_session
        self.session = 0
        self.client: str | None = None
        self._last_attach: tuple[str, int] = ("", 0)
        self.paused = False
        self.consumed = -1
        self.served = -1
        """Highest rollout id served: a ``generate`` above it resumes a pause, as on a fleet."""
        fleet = run.fleet
        self.config: dict = dict(fleet.get("config") or {})
        self.weights_version = int(fleet.get("weights_version") or 0)
        self.weight_log: list[dict] = []
        """Every weight update the trainer pushed: ``{"version", "kind", "path"}``, none applied."""
        self._update_id = 0
        self._pending_update: dict[int, dict] = {}
        self._group_formed = False
        self._eval_next: dict[str, int] = {name: 0 for name in run.evals}
        self._eval_tokens: dict[str, dict] = {}
        self._routes: dict[type, Callable] = {
            p.Attach: self._attach,
            p.Stats: self._stats,
            p.Fetch: self._fetch,
            p.Generate: self._generate,
            p.Pause: self._pause,
            p.Resume: self._resume,
            p.StateDict: self._state_dict,
            p.LoadStateDict: self._load_state_dict,
            p.Consumed: self._consumed,
            p.Missing: lambda m: self._ok(m, {"lost": 0}),
            p.Detach: self._detach,
            p.Evaluate: self._evaluate,
            p.UpdateWeights: self._update_weights,
            p.WeightBucket: lambda m: self._ok(m, {}),
            p.FinishWeights: self._finish_weights,
            p.AbortWeights: self._abort_weights,
            p.WeightsAlive: lambda m: self._ok(m, {}),
        }
        self._sessionless = (p.Attach, p.Stats, p.Fetch)

    def handle(self, msg: p.Message) -> list[Reply]:
        route = self._routes.get(type(msg))
        req = getattr(msg, "req", 0)
        if route is None:
            why = f"a replay serves trainers only; it does not accept {msg.TYPE!r} messages"
            return [(p.Error("unexpected", why, req), [])]
        if not isinstance(msg, self._sessionless) and (msg.session != self.session or not self.session):
            if self.session == 0:
                why = f"no trainer session {msg.session:x} here (replay restarted or trainer detached); attach again"
                return [(p.Error("unknown_session", why, req), [])]
            return [(p.Error("fenced", f"trainer session {msg.session:x} was replaced by a newer trainer", req), [])]
        return route(msg)

    @staticmethod
    def _ok(msg, result: dict) -> list[Reply]:
        return [(p.Ok(msg.req, result), [])]

    @staticmethod
    def _error(msg, code: str, why: str) -> list[Reply]:
        return [(p.Error(code, why, msg.req), [])]

    # ------------------------------------------------------------------ sessions

    def _attach(self, msg: p.Attach) -> list[Reply]:
        if (msg.client_id, msg.req) != self._last_attach or not self.session:
            why = config_differences(self.config, msg.config_check)
            if why:
                return self._error(msg, "config_mismatch", why.replace("running fleet", "recorded fleet"))
            self._last_attach = (msg.client_id, msg.req)
            self.session, self.client = self._new_session(), msg.client_id
            self._group_formed = False  # a new trainer process holds no weight-update group
            log.info("trainer %s attached (session %x)", msg.client_id, self.session)
        fleet = self.run.fleet
        return self._ok(
            msg,
            {
                "session": self.session,
                "config": self.config,
                "dataset_size": fleet.get("dataset_size"),
                "dataset_fingerprint": fleet.get("dataset_fingerprint"),
                "last_rollout_id": self.run.ids[-1] if self.run.ids else -1,
                "trimmed_upto": -1,
                "heartbeat_interval": 1.0,
                "ttl": 5.0,
                "weights_version": self.weights_version,
                "replay": self.run.directory,
            },
        )

    def _detach(self, msg: p.Detach) -> list[Reply]:
        self.session, self.client = 0, None
        return self._ok(msg, {})

    def _stats(self, msg: p.Stats) -> list[Reply]:
        return self._ok(msg, self.statistics())

    def statistics(self) -> dict:
        """What ``coordinator status`` shows of a replay: a fleet's keys where they mean something, and ``replay``."""
        return {
            "replay": {"from": self.run.directory, "rollout_ids": self.run.describe(), "served_upto": self.served},
            "agents": {},
            "leased": 0,
            "ready": 0,
            "paused": self.paused,
            "starved": None,
            "trainer": self.client if self.session else None,
            "last_rollout_id": self.served,
            "consumed_upto": self.consumed,
            "weights": {
                "version": self.weights_version,
                "updates": len(self.weight_log),
                "kind": self.weight_log[-1]["kind"] if self.weight_log else "",
                "path": self.weight_log[-1]["path"] if self.weight_log else "",
                "lock": None,
                "engines": {},
                "behind": [],
                "not_applied": list(self.weight_log),
            },
            "evaluations": {name: {"recorded_passes": len(v)} for name, v in self.run.evals.items()},
        }

    # ------------------------------------------------------------------ batches

    def _generate(self, msg: p.Generate) -> list[Reply]:
        rollout_id = msg.rollout_id
        if rollout_id not in self.run:
            why = (
                f"generate({rollout_id}): batch {rollout_id} was not recorded in {self.run.directory}; "
                f"recorded ids: {self.run.describe()}"
            )
            return self._error(msg, "not_recorded", why)
        if self.paused and rollout_id > self.served:
            self.paused = False  # as on a fleet: asking for a batch not served yet resumes
        self.served = max(self.served, rollout_id)
        recorded, _ = self.run.batch(rollout_id)
        refs = [
            [g.data_epoch, g.index, g.agent_id, f"replay:{rollout_id}:{i}", self.payload_address]
            for i, g in enumerate(recorded.groups)
        ]
        metrics = {k: v for k, v in recorded.metrics.items() if k not in CLIENT_METRICS}
        return [(p.BatchRefs(msg.req, rollout_id, refs, metrics), [])]

    def _fetch(self, msg: p.Fetch) -> list[Reply]:
        found, missing, frames = [], [], []
        for key in msg.keys:
            payload = self._payload(key)
            if payload is None:
                missing.append(key)
            else:
                found.append(key)
                frames.append(payload)
        return [(p.Payloads(msg.req, found, missing), frames)]

    def _payload(self, key: str) -> bytes | None:
        try:
            tag, rollout_id, position = key.split(":")
            rollout_id, position = int(rollout_id), int(position)
        except ValueError:
            return None
        if tag != "replay" or rollout_id not in self.run:
            return None
        _, payloads = self.run.batch(rollout_id)
        return payloads[position] if 0 <= position < len(payloads) else None

    def _consumed(self, msg: p.Consumed) -> list[Reply]:
        if msg.rollout_id not in self.run:
            return self._error(msg, "bad_request", f"rollout {msg.rollout_id!r} was never delivered")
        self.consumed = max(self.consumed, msg.rollout_id)
        return self._ok(msg, {"consumed_upto": self.consumed})

    # ------------------------------------------------------------------ pause and checkpoints

    def _pause(self, msg: p.Pause) -> list[Reply]:
        self.paused = True
        return self._ok(msg, {"leased": 0})

    def _resume(self, msg: p.Resume) -> list[Reply]:
        self.paused = False
        return self._ok(msg, {})

    def _state_dict(self, msg: p.StateDict) -> list[Reply]:
        if not self.paused:
            why = (
                f"state_dict needs a paused and drained rollout (paused={self.paused}, leases in flight=0); "
                "call pause(drain=True) first"
            )
            return self._error(msg, "not_drained", why)
        last = self.run.ids[-1] if self.run.ids else -1
        if msg.consumed > last:
            why = f"consumed rollout id {msg.consumed!r} was never recorded (last is {last})"
            return self._error(msg, "bad_request", why)
        fleet = self.run.fleet
        state = {
            "format": 1,
            "rollout_id": msg.consumed,
            "dataset_fingerprint": fleet.get("dataset_fingerprint"),
            "dataset_size": fleet.get("dataset_size"),
            "config": self.config,
        }
        return self._ok(msg, state)

    def _load_state_dict(self, msg: p.LoadStateDict) -> list[Reply]:
        state = msg.state
        if state.get("format") != 1:
            return self._error(msg, "bad_state", "not a rollfleet state_dict (format 1)")
        if state.get("dataset_fingerprint") != self.run.fleet.get("dataset_fingerprint"):
            return self._error(msg, "bad_state", "checkpoint was taken on a different dataset (fingerprint differs)")
        rollout_id = state.get("rollout_id")
        last = self.run.ids[-1] if self.run.ids else -1
        if not isinstance(rollout_id, int) or rollout_id > last:
            why = f"checkpoint at rollout {rollout_id} is newer than anything recorded in {self.run.directory}"
            why += f" (last {last})"
            return self._error(msg, "bad_state", why)
        self.consumed = rollout_id
        for name, passes in self.run.evals.items():
            later = [i for i, rec in enumerate(passes) if rec.get("consumed", -1) > rollout_id]
            self._eval_next[name] = later[0] if later else len(passes)
        return self._ok(msg, {"rollout_id": rollout_id, "last_rollout_id": last})

    # ------------------------------------------------------------------ evaluation

    def _evaluate(self, msg: p.Evaluate) -> list[Reply]:
        seen = self._eval_tokens.get(msg.token)
        if seen is not None:
            return self._ok(msg, seen)  # a resend of a call answered already
        passes = self.run.evals.get(msg.name)
        if passes is None:
            known = sorted(self.run.evals) or "none"
            return self._error(msg, "unknown_eval", f"no evaluation {msg.name!r} was recorded; recorded: {known}")
        i = self._eval_next[msg.name]
        if i >= len(passes):
            recorded = [rec["pass"] for rec in passes]
            why = f"evaluate({msg.name!r}): every recorded pass ({recorded}) was served already"
            return self._error(msg, "not_recorded", why)
        self._eval_next[msg.name] = i + 1
        result = passes[i]["metrics"]
        self._eval_tokens[msg.token] = result
        return self._ok(msg, result)

    # ------------------------------------------------------------------ weights

    def _check_version(self, msg, version: int) -> list[Reply] | None:
        if version <= self.weights_version:
            why = f"weight version {version} is not greater than the fleet's {self.weights_version}"
            return self._error(msg, "weights_version", why)
        return None

    def _update_weights(self, msg: p.UpdateWeights) -> list[Reply]:
        self._update_id += 1
        if msg.kind == WeightKind.CATCH_UP:
            return self._ok(msg, {"update_id": self._update_id, "world_size": 0, "group_name": "", "init": False})
        refused = self._check_version(msg, msg.version)
        if refused:
            return refused
        if msg.kind == WeightKind.DISK:
            self._apply(msg.version, WeightKind.DISK, msg.path)
            return self._ok(msg, {"update_id": self._update_id, "version": msg.version, "engines": {}})
        init, self._group_formed = not self._group_formed, True
        self._pending_update[self._update_id] = {"version": msg.version}
        return self._ok(
            msg,
            {"update_id": self._update_id, "world_size": 1, "group_name": "replay_weight_update_group", "init": init},
        )

    def _finish_weights(self, msg: p.FinishWeights) -> list[Reply]:
        pending = self._pending_update.pop(msg.update_id, None)
        refused = self._check_version(msg, pending["version"]) if pending is not None else None
        if pending is None:
            refused = self._error(msg, "weights", f"no weight update {msg.update_id} in progress")
        if refused:
            self._group_formed = False  # the trainer destroys its group on an error answer
            return refused
        self._apply(pending["version"], WeightKind.DISTRIBUTED, "")
        return self._ok(msg, {"update_id": msg.update_id, "version": pending["version"], "engines": {}})

    def _abort_weights(self, msg: p.AbortWeights) -> list[Reply]:
        self._pending_update.pop(msg.update_id, None)
        self._group_formed = False  # the trainer destroys its group after a failure
        return self._ok(msg, {})

    def _apply(self, version: int, kind: str, path: str) -> None:
        self.weights_version = version
        self.weight_log.append({"version": version, "kind": kind, "path": path})
        log.info("weight update to version %d (%s) accepted and not applied: a replay has no engines", version, kind)
