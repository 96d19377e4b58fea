"""rollfleet's exceptions, in one tree.

    RolloutError                      base of everything rollfleet raises
    ├── ConfigError                   bad flag, config value or cross-field combination
    ├── DatasetError                  a dataset row or file is unusable (names file and line)
    ├── ProtocolError                 a message could not be decoded or is not allowed
    │   ├── VersionMismatch           the peer speaks another protocol version
    │   └── MessageTooLarge           over the configured size limit
    ├── EngineError                   an inference engine failed
    │   ├── EngineRejected            HTTP 4xx: the engine refused the request itself (a bad prompt)
    │   ├── EngineUnavailable         unreachable, crashed or a server error (broken by the peer)
    │   │   └── EngineBusy            HTTP 503 "The request queue is full.": backpressure, not death
    │   └── EngineStartError          never became healthy; names the engine and its log
    ├── RemoteError                   the coordinator or an agent answered with an error reply
    │   ├── Fenced                    our lease or session was superseded by a newer one
    │   ├── NoCapacity                no agent or engine is left to generate on
    │   ├── Starved                   every recent group failed in user code (reward or filter
    │   │                             raised, generation failed): no batch can come; says why
    │   └── WeightUpdateError         a weight update failed or was aborted (names agent and engine,
    │                                 or the deadline missed); the fleet stays on its last version
    ├── StorageFull                   an LMDB map (or its disk) is full: names the data dir and --map-size
    ├── StateError                    call not allowed now (e.g. state_dict while running)
    └── Closed                        the object was closed by us; further calls are refused

"Closed by us" (``Closed``) is distinct from "broken by the peer"
(``EngineUnavailable``, ``RemoteError``): the first is never retried.
"""

from __future__ import annotations


class RolloutError(Exception):
    """Base class of every rollfleet error."""


class ConfigError(RolloutError, ValueError):
    """A configuration value or combination is invalid."""


class DatasetError(RolloutError, ValueError):
    """A dataset file or row is unusable."""

    def __init__(self, message: str, *, path: str | None = None, line: int | None = None):
        where = ""
        if path is not None:
            where = f"{path}:{line}: " if line is not None else f"{path}: "
        super().__init__(where + message)
        self.path = path
        self.line = line


class ProtocolError(RolloutError):
    """A message could not be decoded, or its type is not accepted here."""


class VersionMismatch(ProtocolError):
    """The peer speaks a protocol version this process does not."""


class MessageTooLarge(ProtocolError):
    """A message exceeds the configured size limit."""


class EngineError(RolloutError):
    """An inference engine failed."""


class EngineUnavailable(EngineError):
    """An engine is unreachable, crashed, or answered with a server error."""


class EngineRejected(EngineError):
    """The engine answered HTTP 4xx: the request itself is wrong (over-long prompt, bad parameter)."""

    def __init__(self, message: str, *, status: int = 400):
        super().__init__(message)
        self.status = status


class EngineBusy(EngineUnavailable):
    """SGLang's ``--max-queued-requests`` is reached (HTTP 503 "The request queue is full."): the
    engine is healthy and answers again once its queue drains. A subclass of EngineUnavailable so a
    caller that knows no better treats it as before; the generation path retries it with backoff."""


class EngineStartError(EngineError):
    """An engine never became healthy within its start deadline."""


class EngineLogUnwritable(EngineStartError):
    """An engine could not be started because its log cannot be written (a full or read-only disk): the disk's
    fault, not the engine's, so a restart that meets it is not charged to the engine's restart budget."""


class RemoteError(RolloutError):
    """A peer answered a request with an error reply."""

    def __init__(self, message: str, *, code: str = "error"):
        super().__init__(message)
        self.code = code


class Fenced(RemoteError):
    """A newer lease or session superseded ours."""


class NoCapacity(RemoteError):
    """No agent or engine is left to generate on."""


class Starved(RemoteError):
    """Every one of the last ``--starve-after`` groups failed (a reward or filter that raises, a
    prompt every engine rejects): no batch can ever be assembled, so ``generate()`` fails at once
    instead of waiting. The message names the dominant failure, e.g. ``every group of the last 64
    failed: reward_error: reward 'my_mod:score' raised RuntimeError: boom``.

    Nothing is lost: the prompts that failed are pending again and admission stops until the next
    ``generate()``, which starts over (e.g. after the agents were restarted with a fixed reward).
    """


class WeightUpdateError(RemoteError):
    """A weight update failed: an engine's step failed (the message names agent and engine), the
    update missed its deadline, or it was aborted (its trainer replaced, a group member lost).
    Every serving engine is still on the fleet's last recorded version (docs/weights.md)."""


class StorageFull(RolloutError):
    """An LMDB environment's map (``--map-size``) or the disk under it is full. The write that hit
    it did not happen, and nothing acknowledged before it is lost: a restart on the same data dir
    with a larger ``--map-size`` (or more disk) carries on."""


class StateError(RolloutError):
    """The call is not allowed in the current state."""


class Closed(RolloutError):
    """The object was closed by its owner."""
