"""The trainer's messages: its requests to the coordinator and its payload fetches from agents.

Part of the protocol: ``common.protocol`` imports and re-exports every one of them, so they are
registered (and versioned) with the rest. Import them from ``common.protocol``.
"""

from __future__ import annotations

from dataclasses import field

from common.wire import Message, message

# --------------------------------------------------------------------------
# Trainer -> coordinator
# --------------------------------------------------------------------------


@message
class Attach(Message):
    """trainer -> coordinator: open a trainer session; fences any previous trainer."""

    TYPE = "attach"
    req: int
    client_id: str
    config_check: dict = field(default_factory=dict)
    rank: int = 0
    """This process's rank in a trainer of ``world_size`` processes: 0 leads (opens the session, fencing any
    other trainer); a rank above 0 joins the leader's session as a member (``no_leader`` if no leader is
    attached, ``other_leader`` if the one attached has another ``run`` or ``world_size``)."""
    world_size: int = 1
    run: str = ""
    """The launch the ranks belong to (torchrun's run id and restart count): members join only its leader."""
    balance: str = "tokens"
    """The leader's: shares of balanced tokens (``tokens``) or of equal group counts (``groups``)."""


@message
class Generate(Message):
    """trainer -> coordinator: the batch for ``rollout_id`` (same id, same batch)."""

    TYPE = "generate"
    session: int
    req: int
    rollout_id: int
    prefetch: int = -1
    deadline: float = 0.0
    """Seconds after the coordinator first got this ``generate`` at which it returns a partial batch
    of the groups ready (at least one); 0: none, wait for the full batch."""
    rank: int = 0
    """The asking rank: it gets its share of the batch (coordinator/shares.py)."""


@message
class BatchRefs(Message):
    """coordinator -> trainer: a batch as references to group payloads on agents.

    ``groups`` entries are ``[data_epoch, index, agent_id, key, payload_address]``
    (``coordinator.records.GroupRef`` in wire form).
    """

    TYPE = "batch"
    req: int
    rollout_id: int
    groups: list[list]
    metrics: dict
    share: dict = field(default_factory=dict)
    """For a trainer of several processes: ``{"rank", "world_size", "lengths"}``, ``groups`` being that rank's
    share and ``lengths`` every rank's sample lengths, one little-endian int32 array (bytes) per rank (None in a
    batch recorded without them); ``metrics`` are the whole batch's. Empty for a trainer of one process."""


@message
class Pause(Message):
    """trainer -> coordinator: stop admission (durably); ``abort`` in-flight work or let it finish.

    With ``drain`` the ``Ok`` comes once no lease is in flight (results durable).
    """

    TYPE = "pause"
    session: int
    req: int
    drain: bool = True
    abort: bool = False


@message
class Resume(Message):
    """trainer -> coordinator: admission on again (durably)."""

    TYPE = "resume"
    session: int
    req: int


@message
class SetMixture(Message):
    """trainer -> coordinator: the training datasets' weights from the next batch not yet recorded on (durably)."""

    TYPE = "set_mixture"
    session: int
    req: int
    weights: dict


@message
class StateDict(Message):
    """trainer -> coordinator: checkpoint the stream at ``consumed`` (highest batch trained on).

    Only while paused and drained; trims what is behind the previous checkpoint.
    """

    TYPE = "state_dict"
    session: int
    req: int
    consumed: int


@message
class LoadStateDict(Message):
    """trainer -> coordinator: check that a checkpoint taken by ``StateDict`` can be resumed here."""

    TYPE = "load_state_dict"
    session: int
    req: int
    state: dict


@message
class Consumed(Message):
    """trainer -> coordinator: batch ``rollout_id`` was fetched completely; its prompts count as trained."""

    TYPE = "consumed"
    session: int
    req: int
    rollout_id: int
    rank: int = 0
    """The rank that holds its share now: the batch is consumed once every rank does."""


@message
class Missing(Message):
    """trainer -> coordinator: an agent that is up no longer holds these groups of a batch; replace them."""

    TYPE = "missing"
    session: int
    req: int
    rollout_id: int
    keys: list[str]


@message
class Detach(Message):
    """trainer -> coordinator: leave the fleet to the next trainer (only the current session may)."""

    TYPE = "detach"
    session: int
    req: int


@message
class Stats(Message):
    """trainer (or ``coordinator status``) -> coordinator: the coordinator's statistics; needs no session."""

    TYPE = "stats"
    req: int


@message
class Evaluate(Message):
    """trainer -> coordinator: one pass over evaluation dataset ``name``; answered with its metrics when done.

    ``token`` names the call: a resend (or the same call after a restart) joins the same pass."""

    TYPE = "evaluate"
    session: int
    req: int
    name: str
    token: str


TRAINER_REQUESTS = (Pause, Resume, SetMixture, StateDict, LoadStateDict, Consumed, Missing, Detach)
"""Trainer requests that carry a session and are refused for any but the current trainer's."""


# --------------------------------------------------------------------------
# Trainer -> agent (data plane)
# --------------------------------------------------------------------------


@message
class Fetch(Message):
    """trainer -> agent: send these group payloads."""

    TYPE = "fetch"
    req: int
    keys: list[str]
    requester: str = ""
    """Who asks (the trainer's client id, with its rank): the agent's debug log of what it served to whom."""


@message
class Payloads(Message):
    """agent -> trainer: ``found`` keys, in order, followed by one raw frame per found key."""

    TYPE = "payloads"
    req: int
    found: list[str]
    missing: list[str]
