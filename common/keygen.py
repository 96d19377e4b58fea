"""``rollfleet-keygen``: CurveZMQ key pairs in ``zmq.auth.create_certificates`` format.

    rollfleet-keygen NAME [NAME ...] --out DIR
        DIR/NAME.key (public) and DIR/NAME.key_secret (public + secret, mode 0600)

    rollfleet-keygen --fleet DIR [--agents NAME ...] [--trainers NAME ...]
        the coordinator's --curve-dir: DIR/coordinator.key(_secret), the public keys it accepts in
        DIR/agents/NAME.key and DIR/trainers/NAME.key, and each agent's and trainer's pair in
        DIR/secrets/NAME.key_secret (+ .key) to copy to that node and delete here

Invariants: a secret key is never world-readable, not even for a moment (each pair is written in a
private temporary directory, made 0600, then moved into place); an existing key file is never
overwritten without ``--force``; a bad name or directory is one line on stderr and exit status 2,
with nothing written.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import zmq.auth

from common.config import ArgumentParser
from common.curve import fingerprint, load_public
from common.errors import ConfigError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def write_pair(directory: str | os.PathLike, name: str, *, force: bool = False) -> tuple[Path, Path]:
    """Write ``directory/name.key`` and ``directory/name.key_secret`` (0600); the two paths."""
    if not _NAME.match(name) or name.endswith((".key", ".key_secret")):
        raise ConfigError(f"key name {name!r}: use letters, digits, '.', '_' and '-' (no path, no extension)")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    public, secret = directory / f"{name}.key", directory / f"{name}.key_secret"
    if not force:
        for path in (public, secret):
            if path.exists():
                raise ConfigError(f"{path} exists; pass --force to replace it")
    scratch = tempfile.mkdtemp(prefix=".keygen-", dir=directory)  # mode 0700
    try:
        made_public, made_secret = zmq.auth.create_certificates(scratch, name)
        os.chmod(made_secret, 0o600)
        os.chmod(made_public, 0o644)
        os.replace(made_secret, secret)
        os.replace(made_public, public)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return public, secret


def write_fleet(directory, agents, trainers, *, force: bool = False) -> list[tuple[str, Path, Path]]:
    """The coordinator's --curve-dir layout (module docstring); ``(role/name, public, secret)`` per pair."""
    directory = Path(directory)
    names = list(agents) + list(trainers)
    if len(set(names)) != len(names) or "coordinator" in names:
        raise ConfigError("--agents and --trainers names must be unique and not 'coordinator'")
    for name in names:  # every name checked before anything is written
        if not _NAME.match(name):
            raise ConfigError(f"key name {name!r}: use letters, digits, '.', '_' and '-' (no path, no extension)")
    made = [("coordinator", *write_pair(directory, "coordinator", force=force))]
    (directory / "secrets").mkdir(mode=0o700, exist_ok=True)
    for role, group in (("agents", agents), ("trainers", trainers)):
        for name in group:
            public, secret = write_pair(directory / "secrets", name, force=force)
            allowed = directory / role / f"{name}.key"
            allowed.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(public, allowed)
            made.append((f"{role}/{name}", allowed, secret))
    return made


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="rollfleet-keygen", description="write CurveZMQ key pairs for a rollfleet fleet")
    parser.add_argument("names", nargs="*", metavar="NAME", help="key pairs to write into --out")
    parser.add_argument("--out", default=None, help="directory for NAME.key and NAME.key_secret")
    parser.add_argument("--fleet", default=None, metavar="DIR", help="write a whole --curve-dir layout into DIR")
    parser.add_argument("--agents", nargs="*", default=[], metavar="NAME", help="with --fleet: agent key names")
    parser.add_argument("--trainers", nargs="*", default=[], metavar="NAME", help="with --fleet: trainer key names")
    parser.add_argument("--force", action="store_true", help="replace existing key files")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.fleet is not None:
            if args.names or args.out:
                raise ConfigError("--fleet DIR takes --agents and --trainers, not NAME or --out")
            made = write_fleet(args.fleet, args.agents, args.trainers, force=args.force)
        else:
            if not args.names or args.out is None:
                raise ConfigError("give NAME ... --out DIR, or --fleet DIR --agents ... --trainers ...")
            if args.agents or args.trainers:
                raise ConfigError("--agents and --trainers only apply to --fleet DIR")
            made = [(name, *write_pair(args.out, name, force=args.force)) for name in args.names]
    except (ConfigError, OSError) as exc:
        print(f"rollfleet-keygen: error: {exc}", file=sys.stderr)
        return 2
    for label, public, secret in made:
        print(f"{label}: public {public} ({fingerprint(load_public(public, label))}...), secret {secret}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
