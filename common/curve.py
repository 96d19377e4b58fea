"""CurveZMQ keys for rollfleet's sockets: loading, the key layout, socket options, the loopback rule.

Key files are ``zmq.auth.create_certificates``'s: ``NAME.key`` holds the public key,
``NAME.key_secret`` the public and the secret key (mode 0600). Keys travel as Z85 text.

Layout (docs/operate/keys.md):

- the coordinator's ``--curve-dir DIR`` holds ``coordinator.key_secret`` (its own pair) and the
  public keys it accepts: ``DIR/agents/*.key`` and ``DIR/trainers/*.key``;
- an agent has its own pair (``--curve-secret``) and the coordinator's public key
  (``--curve-server-key``); its payload endpoint is a CURVE server with that same pair and accepts
  only the trainers' keys, which the coordinator hands it in its Welcome; its payload address
  carries its public key (``tcp://HOST:PORT#curve=KEY``, ``with_server_key``), so a trainer
  knows which key the endpoint must prove;
- a trainer has its own pair and the coordinator's public key (``RolloutClient(curve_secret=...,
  curve_server_key=...)``).

Invariants: a CURVE server socket sets ``ZAP_ENFORCE_DOMAIN``, so until its authenticator answers
(common/zap.py) every handshake fails instead of being let through; a key file that is missing,
unreadable or malformed is a ConfigError naming the file and the flag it came from; a secret
file readable by others is refused. Nothing here logs or prints a secret key.
"""

from __future__ import annotations

import ipaddress
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import zmq
import zmq.auth
from zmq.utils import z85

from common.errors import ConfigError

ZAP_DOMAIN = "rollfleet"
"""The ZAP domain of every rollfleet CURVE server socket."""

ADDRESS_KEY_MARK = "#curve="
"""Separates a payload endpoint from its server public key in a payload address."""


@dataclass(frozen=True)
class KeyPair:
    """A CURVE key pair, Z85 text as bytes (what pyzmq's socket options take)."""

    public: bytes
    secret: bytes

    def __repr__(self) -> str:  # never the secret, not even in a traceback
        return f"KeyPair(public={fingerprint(self.public)}...)"


@dataclass(frozen=True)
class ClientKeys:
    """What a CURVE client needs: its own pair and the public key the server must prove."""

    pair: KeyPair
    server_public: bytes


def fingerprint(public: bytes | str) -> str:
    """A short, loggable name for a public key: the first 8 characters of its Z85 text."""
    text = public.decode("ascii", "replace") if isinstance(public, bytes) else public
    return text[:8]


def _load(path: str | os.PathLike, what: str, *, secret: bool) -> tuple[bytes, bytes | None]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what}: no key file at {path}")
    mode = os.stat(path).st_mode & 0o777
    if secret and mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"{what}: {path} is readable by others (mode {oct(mode)}); chmod 600 it")
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{what}: {path} is not a CurveZMQ key file: {exc}") from None
    if not _valid(public) or (secret_key is not None and not _valid(secret_key)):
        raise ConfigError(f"{what}: {path} holds a malformed key (expected 40 Z85 characters)")
    if secret and secret_key is None:
        raise ConfigError(f"{what}: {path} holds no secret key (give the NAME.key_secret file)")
    return public, secret_key


def _valid(key: bytes) -> bool:
    if len(key) != 40:
        return False
    try:
        z85.decode(key)
    except (ValueError, KeyError, TypeError):
        return False
    return True


def load_pair(path: str | os.PathLike, what: str) -> KeyPair:
    """The key pair of a ``NAME.key_secret`` file."""
    public, secret = _load(path, what, secret=True)
    return KeyPair(public, secret)


def load_public(path: str | os.PathLike, what: str) -> bytes:
    """The public key of a ``NAME.key`` (or ``NAME.key_secret``) file."""
    return _load(path, what, secret=False)[0]


def load_allowed(directory: str | os.PathLike, what: str) -> dict[bytes, str]:
    """Public key -> key name for every ``*.key`` file in ``directory``; at least one is required."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ConfigError(f"{what}: no directory {directory} (it holds the allowed public keys, NAME.key)")
    allowed = {load_public(p, what): p.stem for p in sorted(directory.glob("*.key"))}
    if not allowed:
        raise ConfigError(f"{what}: {directory} holds no public key (NAME.key); nobody could connect")
    return allowed


@dataclass(frozen=True)
class CoordinatorKeys:
    """The coordinator's ``--curve-dir``: its pair and the keys it accepts, by role."""

    pair: KeyPair
    agents: dict[bytes, str]
    trainers: dict[bytes, str]

    @classmethod
    def load(cls, directory: str | os.PathLike, what: str = "--curve-dir") -> CoordinatorKeys:
        directory = Path(directory)
        if not directory.is_dir():
            raise ConfigError(f"{what}: no directory {directory}")
        return cls(
            load_pair(directory / "coordinator.key_secret", what),
            load_allowed(directory / "agents", what),
            load_allowed(directory / "trainers", what),
        )

    @property
    def allowed(self) -> dict[bytes, str]:
        """Every key the coordinator endpoint accepts (agents' and trainers')."""
        named = {k: f"agents/{n}" for k, n in self.agents.items()}
        named.update({k: f"trainers/{n}" for k, n in self.trainers.items()})
        return named


def client_keys(secret_file, server_key_file, *, secret_flag: str, server_flag: str) -> ClientKeys | None:
    """Both files, or neither (no CURVE); one without the other is a ConfigError naming the missing flag."""
    if secret_file is None and server_key_file is None:
        return None
    if secret_file is None or server_key_file is None:
        given, missing = (secret_flag, server_flag) if server_key_file is None else (server_flag, secret_flag)
        raise ConfigError(f"{given} needs {missing} too (CurveZMQ needs this side's key pair and the server's key)")
    return ClientKeys(load_pair(secret_file, secret_flag), load_public(server_key_file, server_flag))


# ------------------------------------------------------------------ sockets


def make_server(sock: zmq.Socket, pair: KeyPair) -> None:
    """Make ``sock`` a CURVE server (before bind). ZAP is enforced: no authenticator, no peer."""
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, pair.secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, pair.public)
    sock.setsockopt(zmq.CURVE_SERVER, 1)


def make_client(sock: zmq.Socket, keys: ClientKeys, server_public: bytes | None = None) -> None:
    """Make ``sock`` a CURVE client of the server holding ``server_public`` (default: ``keys``')."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_public or keys.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.pair.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.pair.secret)


def with_server_key(endpoint: str, public: bytes | None) -> str:
    """A payload address: the endpoint, and the key its server proves when CURVE is on."""
    return endpoint if public is None else f"{endpoint}{ADDRESS_KEY_MARK}{public.decode('ascii')}"


def split_address(address: str) -> tuple[str, bytes | None]:
    """``(endpoint, server public key or None)`` of a payload address; a malformed key is a ConfigError."""
    endpoint, mark, key = address.partition(ADDRESS_KEY_MARK)
    if not mark:
        return address, None
    public = key.encode("ascii", "replace")
    if not _valid(public):
        raise ConfigError(f"payload address {endpoint}: malformed server key {key[:8]!r}...")
    return endpoint, public


# ------------------------------------------------------------------ the loopback rule


def is_loopback(bind: str) -> bool:
    """True for ipc://, inproc:// and tcp:// on 127.0.0.0/8, ::1 or localhost: not reachable off this host."""
    if bind.startswith(("ipc://", "inproc://")):
        return True
    try:
        host = urlparse(bind).hostname
    except ValueError:
        return False
    if host in (None, ""):
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # an interface name or host name: may be reachable


def check_exposure(bind: str, flag: str, *, keyed: bool, insecure: bool, keys_flag: str) -> str | None:
    """An endpoint reachable off this host needs CurveZMQ keys, unless ``--insecure`` says otherwise.

    Raises ConfigError naming ``flag``. With ``--insecure`` it returns the WARNING to log once the
    endpoint is bound (a start that fails says only why it failed); None when nothing is exposed.
    """
    if keyed or is_loopback(bind):
        return None
    if not insecure:
        raise ConfigError(
            f"{flag} {bind} is reachable from other hosts but no CurveZMQ keys are given: anyone reaching it "
            f"could join the fleet. Give {keys_flag} (docs/operate/keys.md), bind to 127.0.0.1, or pass --insecure"
        )
    return f"{flag} {bind} is reachable from other hosts without CurveZMQ keys (--insecure): anyone gets in"
