"""A userspace packet impairer on a TUN device: netem's rules without the kernel's ``sch_netem``.

Run by ``harness/netfault.py`` (``NetFault.create(..., impair=True)``) inside the router
namespace, where policy routing sends every packet forwarded to or from an agent into the TUN
device ``--dev``. This process reads each packet, decides its fate by the rules of the agent link
it belongs to (agent ``i`` is the /30 ``10.X.(i+1).0``; ``to_coordinator`` is what the agent
sends, ``to_agent`` what it is sent) and writes it back to the device, where the kernel routes it
on to its destination. Rules, per link and direction, with netem's meaning:

    delay_ms, jitter_ms   each packet waits delay ± jitter (uniform); without reordering a packet
                          never overtakes the one before it on the same link and direction
    loss                  probability a packet is dropped
    duplicate             probability a packet is sent twice
    reorder               probability a packet skips the delay and goes at once (it overtakes the
                          delayed ones before it: netem's ``reorder``, which needs a delay)
    drop                  every packet dropped: a silent partition

Control is JSON lines on stdin, one answer line on stdout each::

    {"cmd": "set", "agent": 0, "direction": "both", "delay_ms": 20, "loss": 0.03, ...}
    {"cmd": "clear", "agent": 0}
    {"cmd": "stats"}                 -> {"ok": true, "stats": {"forwarded": .., "dropped": .., ...}}
    {"cmd": "stop"}

End of stdin (the parent gone) stops it too. Bounded: at most ``LIMIT`` packets wait (netem's
default limit, 1000; more are dropped and counted), every wait is a ``select`` with a timeout, and
the process exits when told or orphaned. It touches nothing but its own device's file descriptor.
"""

from __future__ import annotations

import argparse
import fcntl
import heapq
import json
import os
import random
import select
import struct
import sys
import time
from dataclasses import dataclass

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
LIMIT = 1000
"""Packets that may wait at once (netem's default ``limit``)."""
DIRECTIONS = ("to_coordinator", "to_agent")


@dataclass
class Rule:
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0
    drop: bool = False

    @classmethod
    def parse(cls, d: dict) -> Rule:
        rule = cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})
        for name in ("loss", "duplicate", "reorder"):
            if not 0.0 <= getattr(rule, name) <= 1.0:
                raise ValueError(f"{name} is a probability in [0, 1], got {getattr(rule, name)!r}")
        if rule.delay_ms < 0 or rule.jitter_ms < 0:
            raise ValueError("delay_ms and jitter_ms must be >= 0")
        return rule


class Impairer:
    """The pure part: which packets go when. ``now`` in seconds, passed in."""

    def __init__(self, octet: int, seed: int = 0):
        self.octet = octet
        self.rules: dict[tuple[int, str], Rule] = {}
        self.rng = random.Random(seed)
        self.queue: list[tuple[float, int, bytes]] = []
        self._seq = 0
        self._last: dict[tuple[int, str], float] = {}
        self.stats = {"forwarded": 0, "dropped": 0, "lost": 0, "duplicated": 0, "reordered": 0, "overflow": 0}

    def link_of(self, packet: bytes) -> tuple[int, str] | None:
        """``(agent, direction)`` of an IPv4 packet between an agent and the root namespace, else None."""
        if len(packet) < 20 or packet[0] >> 4 != 4:
            return None
        src, dst = packet[12:16], packet[16:20]
        if src[0] == 10 and src[1] == self.octet and src[2] >= 1:
            return src[2] - 1, "to_coordinator"
        if dst[0] == 10 and dst[1] == self.octet and dst[2] >= 1:
            return dst[2] - 1, "to_agent"
        return None

    def offer(self, packet: bytes, now: float) -> None:
        link = self.link_of(packet)
        rule = self.rules.get(link) if link is not None else None
        if rule is None:
            self._push(now, packet)
            return
        if rule.drop:
            self.stats["dropped"] += 1
            return
        if rule.loss and self.rng.random() < rule.loss:
            self.stats["lost"] += 1
            return
        copies = 2 if rule.duplicate and self.rng.random() < rule.duplicate else 1
        if copies == 2:
            self.stats["duplicated"] += 1
        for _ in range(copies):
            if rule.reorder and self.rng.random() < rule.reorder:
                self.stats["reordered"] += 1
                self._push(now, packet)  # at once: overtakes the delayed ones
                continue
            wait = rule.delay_ms + (self.rng.uniform(-rule.jitter_ms, rule.jitter_ms) if rule.jitter_ms else 0.0)
            at = now + max(0.0, wait) / 1000.0
            if not rule.reorder:
                at = max(at, self._last.get(link, 0.0))  # jitter alone keeps the order, as a FIFO link
                self._last[link] = at
            self._push(at, packet)

    def _push(self, at: float, packet: bytes) -> None:
        if len(self.queue) >= LIMIT:
            self.stats["overflow"] += 1
            return
        self._seq += 1
        heapq.heappush(self.queue, (at, self._seq, packet))

    def due(self, now: float) -> list[bytes]:
        out = []
        while self.queue and self.queue[0][0] <= now:
            out.append(heapq.heappop(self.queue)[2])
        self.stats["forwarded"] += len(out)
        return out

    def next_at(self) -> float | None:
        return self.queue[0][0] if self.queue else None

    def command(self, cmd: dict) -> dict:
        kind = cmd.get("cmd")
        if kind == "set":
            agent, direction = int(cmd["agent"]), cmd.get("direction", "both")
            if direction not in (*DIRECTIONS, "both"):
                raise ValueError(f"direction must be both, to_coordinator or to_agent, got {direction!r}")
            rule = Rule.parse(cmd)
            for d in DIRECTIONS if direction == "both" else (direction,):
                self.rules[(agent, d)] = rule
            return {"ok": True}
        if kind == "clear":
            agent = int(cmd["agent"])
            for d in DIRECTIONS:
                self.rules.pop((agent, d), None)
                self._last.pop((agent, d), None)
            return {"ok": True}
        if kind == "stats":
            return {"ok": True, "stats": dict(self.stats), "queued": len(self.queue)}
        raise ValueError(f"unknown command {kind!r}")


def open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), IFF_TUN | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


def serve(dev: str, octet: int, seed: int) -> int:
    fd = open_tun(dev)
    imp = Impairer(octet, seed)
    stdin = sys.stdin.fileno()
    os.set_blocking(stdin, False)
    pending = b""
    print(json.dumps({"ok": True, "ready": dev}), flush=True)
    while True:
        now = time.monotonic()
        at = imp.next_at()
        timeout = 0.5 if at is None else min(0.5, max(0.0, at - now))
        readable, _, _ = select.select([fd, stdin], [], [], timeout)
        now = time.monotonic()
        if fd in readable:
            for _ in range(256):  # a bounded burst per wake-up
                try:
                    packet = os.read(fd, 65536)
                except BlockingIOError:
                    break
                imp.offer(packet, now)
        if stdin in readable:
            chunk = os.read(stdin, 65536)
            if not chunk:
                return 0  # the parent is gone
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                try:
                    cmd = json.loads(line)
                    if cmd.get("cmd") == "stop":
                        print(json.dumps({"ok": True}), flush=True)
                        return 0
                    answer = imp.command(cmd)
                except (ValueError, KeyError, TypeError) as exc:
                    answer = {"ok": False, "error": str(exc)}
                print(json.dumps(answer), flush=True)
        for packet in imp.due(time.monotonic()):
            try:
                os.write(fd, packet)
            except (BlockingIOError, OSError):
                imp.stats["overflow"] += 1  # the kernel would not take it: lost, as on a full link


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dev", required=True)
    ap.add_argument("--octet", type=int, required=True, help="X of the harness's 10.X.0.0/16")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    return serve(args.dev, args.octet, args.seed)


if __name__ == "__main__":
    sys.exit(main())
