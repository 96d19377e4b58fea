"""A packet-level fault harness: agents in network namespaces, silent drops applied to real packets.

    with NetFault.create(agents=2) as net:          # needs root, ip (iproute2) and nft (nftables)
        net.coordinator_host                          # bind the coordinator here (root namespace)
        net.agent_argv(0, argv)                       # run agent 0 inside its namespace
        net.partition(0)                              # agent 0's packets vanish, both directions
        net.partition(0, "to_coordinator")            # one way: agent -> coordinator lost only
        net.heal(0)

Topology (everything below is made by the harness, named ``rf<tag>...``, and removed by name)::

    root namespace                router namespace ``rf<tag>-r``        agent namespace ``rf<tag>-a<i>``
    rf<tag>h  10.X.0.1/30  <--veth-->  rf<tag>r  10.X.0.2/30
                                   rf<tag>g<i> 10.X.(i+1).1/30  <--veth-->  rf<tag>a<i> 10.X.(i+1).2/30

The coordinator and the test's trainer run in the root namespace and talk to the agents through
the router namespace, which forwards between its links. Each agent namespace routes the harness's
whole ``10.X.0.0/16`` through the router, so a slot may also host a trainer (``agent_argv`` runs any
command there) that reaches the coordinator and every agent, and is partitioned like an agent.
The root namespace gets one interface and one route per agent subnet through it, both gone with
the interface; no address, rule or route that the harness did not make is touched, and no
firewall rule is added outside the router namespace.

Impairments (``create(..., impair=True)``, needs ``/dev/net/tun``): the router namespace also
gets a TUN device ``rf<tag>t`` (10.X.250.1/30) and policy routing (table 100) that sends every
packet forwarded to or from an agent through it; ``harness/tunimpair.py``, started in the router
namespace, reads them and writes them back after applying netem's rules (delay, jitter, loss,
duplication, reordering, silent drops), set at runtime per agent link and direction::

        net.impair(0, delay_ms=30, jitter_ms=10, loss=0.03, reorder=0.1, duplicate=0.02)
        net.impair(0)                                 # no rules: straight through
        net.impair_stats()                            # forwarded, lost, duplicated, reordered, ...

Faults are nftables rules in the router namespace's ``forward`` chain, so a dropped packet
vanishes between the hosts: neither end gets a reset, an ICMP error or a local send error, as
when a switch or a link fails. ``to_coordinator`` drops what agent ``i`` sends, ``to_agent`` what
it is sent, ``both`` is a full partition (one-way partitions are one of the two).

The second octet ``X`` is picked at creation among 10.200-10.249 so that no address or route of
this machine is in ``10.X.0.0/16``; ``create`` fails if none is free. Every command runs with a
timeout; ``close`` removes the namespaces (which takes their interfaces and rules with them) and
the root end of the first link, and is safe to call twice or after a half-made ``create``; the
impairer process is stopped first (by its pid: a process inside a namespace keeps it alive).
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

DIRECTIONS = ("both", "to_coordinator", "to_agent")
_TIMEOUT = 10
ROOT = Path(__file__).resolve().parent.parent


class NetFaultUnavailable(RuntimeError):
    """The harness cannot run here (not root, no ip/nft, namespaces refused); the text says why."""


def unavailable(impair: bool = False) -> str:
    """Why the harness (with ``impair``: and its TUN impairer) cannot run here; "" when it can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and nftables)"
    for tool, package in (("ip", "iproute2"), ("nft", "nftables")):
        if shutil.which(tool) is None:
            return f"needs the {tool!r} command (Debian package {package})"
    if impair and not os.access("/dev/net/tun", os.R_OK | os.W_OK):
        return "the TUN impairer needs /dev/net/tun (a container without it: --device /dev/net/tun)"
    return ""


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=_TIMEOUT)
    if check and out.returncode != 0:
        raise NetFaultUnavailable(f"{' '.join(argv)} failed: {out.stderr.strip() or out.stdout.strip()}")
    return out


def _taken_networks() -> list:
    """Every IPv4 network this machine has an address in or a route to (default route aside)."""
    nets = []
    for line in _run("ip", "-4", "-o", "addr", "show").stdout.splitlines():
        parts = line.split()
        if "inet" in parts:
            nets.append(ipaddress.ip_network(parts[parts.index("inet") + 1], strict=False))
    for line in _run("ip", "-4", "route", "show", "table", "all").stdout.splitlines():
        dest = line.split()[0] if line.split() else ""
        if dest in ("default", "broadcast", "local", "unreachable", "blackhole", "prohibit"):
            dest = line.split()[1] if dest != "default" and len(line.split()) > 1 else ""
        try:
            nets.append(ipaddress.ip_network(dest, strict=False))
        except ValueError:
            continue
    return [n for n in nets if n.prefixlen > 0]


def _free_octet() -> int:
    taken = _taken_networks()
    for octet in range(200, 250):
        block = ipaddress.ip_network(f"10.{octet}.0.0/16")
        if not any(block.overlaps(n) for n in taken):
            return octet
    raise NetFaultUnavailable("no free 10.X.0.0/16 (X in 200..249) for the harness's links")


class NetFault:
    def __init__(self, agents: int):
        self.tag = secrets.token_hex(2)
        self.agents = agents
        self.router_ns = f"rf{self.tag}-r"
        self.agent_ns = [f"rf{self.tag}-a{i}" for i in range(agents)]
        self.host_if = f"rf{self.tag}h"
        self.octet = 0
        self._made_ns: list[str] = []
        self._faults: dict[int, str] = {}
        self.tun_if = f"rf{self.tag}t"
        self._impairer: subprocess.Popen | None = None
        self._impairer_out = b""

    @classmethod
    def create(cls, agents: int, impair: bool = False, seed: int = 0) -> NetFault:
        why = unavailable(impair)
        if why:
            raise NetFaultUnavailable(why)
        net = cls(agents)
        try:
            net._build()
            if impair:
                net._build_impairer(seed)
        except BaseException:
            net.close()
            raise
        return net

    # ------------------------------------------------------------ addresses

    @property
    def coordinator_host(self) -> str:
        """The root namespace's address on the harness's link: bind the coordinator here."""
        return f"10.{self.octet}.0.1"

    def agent_host(self, i: int) -> str:
        return f"10.{self.octet}.{i + 1}.2"

    def agent_argv(self, i: int, argv: list[str]) -> list[str]:
        """``argv`` run inside agent ``i``'s namespace (the process keeps its pid: ``ip netns exec`` execs)."""
        return ["ip", "netns", "exec", self.agent_ns[i], *argv]

    # ------------------------------------------------------------ faults

    def partition(self, i: int, direction: str = "both", port: int | None = None) -> None:
        """From now on agent ``i``'s packets in ``direction`` are dropped silently, in the router; with
        ``port``, only those of TCP connections to that port of the agent (its payload endpoint, say)."""
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        if port is not None and not (isinstance(port, int) and 0 < port < 65536):
            raise ValueError(f"port must be a TCP port number, got {port!r}")
        self.heal(i)
        gw = f"rf{self.tag}g{i}"
        sport = f"tcp sport {port} " if port else ""
        dport = f"tcp dport {port} " if port else ""
        rules = []
        if direction in ("both", "to_coordinator"):
            rules.append(f'iifname "{gw}" {sport}counter drop')
        if direction in ("both", "to_agent"):
            rules.append(f'oifname "{gw}" {dport}counter drop')
        for rule in rules:
            self._nft(f"add rule inet rollfleet_netfault a{i} {rule}")
        self._faults[i] = direction

    def heal(self, i: int) -> None:
        """Agent ``i``'s packets flow again (a no-op when none were dropped)."""
        self._nft(f"flush chain inet rollfleet_netfault a{i}")
        self._faults.pop(i, None)

    def dropped(self, i: int) -> int:
        """Packets dropped for agent ``i`` so far (the rules' counters; those of a healed fault are gone)."""
        out = self._nft(f"list chain inet rollfleet_netfault a{i}").stdout
        return sum(int(w.split()[1]) for w in out.split("counter")[1:] if w.split()[0] == "packets")

    def impair(self, i: int, direction: str = "both", **rule) -> None:
        """Agent ``i``'s packets in ``direction`` go through these rules from now on (``harness/tunimpair.py``:
        delay_ms, jitter_ms, loss, duplicate, reorder, drop); no rule: straight through."""
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        self._ask({"cmd": "clear", "agent": i})
        if rule:
            self._ask({"cmd": "set", "agent": i, "direction": direction, **rule})

    def impair_stats(self) -> dict:
        """The impairer's counts: forwarded, dropped, lost, duplicated, reordered, overflow."""
        return self._ask({"cmd": "stats"})["stats"]

    def _ask(self, cmd: dict) -> dict:
        proc = self._impairer
        if proc is None:
            raise RuntimeError("no impairer: create the harness with impair=True")
        proc.stdin.write((json.dumps(cmd) + "\n").encode())
        proc.stdin.flush()
        answer = json.loads(self._read_line(_TIMEOUT))
        if not answer.get("ok"):
            raise ValueError(f"impairer refused {cmd}: {answer.get('error')}")
        return answer

    def _read_line(self, timeout: float) -> bytes:
        proc, deadline = self._impairer, time.monotonic() + timeout
        while b"\n" not in self._impairer_out:
            left = deadline - time.monotonic()
            if left <= 0 or proc.poll() is not None:
                raise NetFaultUnavailable(f"the TUN impairer did not answer (exit {proc.poll()})")
            if select.select([proc.stdout], [], [], min(left, 0.5))[0]:
                chunk = os.read(proc.stdout.fileno(), 65536)
                if not chunk:
                    raise NetFaultUnavailable(f"the TUN impairer exited ({proc.wait(_TIMEOUT)})")
                self._impairer_out += chunk
        line, self._impairer_out = self._impairer_out.split(b"\n", 1)
        return line

    # ------------------------------------------------------------ build and teardown

    def _build_impairer(self, seed: int) -> None:
        """A TUN device in the router namespace that every agent packet is routed through, and its reader."""
        o, r, tun = self.octet, self.router_ns, self.tun_if
        self._ns(r, "ip", "tuntap", "add", "dev", tun, "mode", "tun")
        self._ns(r, "ip", "addr", "add", f"10.{o}.250.1/30", "dev", tun)
        self._ns(r, "ip", "link", "set", tun, "up")
        # Packets the impairer writes back arrive on the TUN device with sources routed elsewhere.
        for conf in ("all", "default", tun):
            self._ns(r, "sysctl", "-q", "-w", f"net.ipv4.conf.{conf}.rp_filter=0")
        self._ns(r, "ip", "route", "add", "default", "dev", tun, "table", "100")
        for i in range(self.agents):
            self._ns(r, "ip", "rule", "add", "iif", f"rf{self.tag}g{i}", "lookup", "100")
            self._ns(r, "ip", "rule", "add", "iif", f"rf{self.tag}r", "to", f"10.{o}.{i + 1}.0/30", "lookup", "100")
        argv = [sys.executable, "-m", "harness.tunimpair", "--dev", tun, "--octet", str(o), "--seed", str(seed)]
        self._impairer = subprocess.Popen(
            ["ip", "netns", "exec", r, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT
        )
        ready = json.loads(self._read_line(_TIMEOUT))
        if ready.get("ready") != tun:
            raise NetFaultUnavailable(f"the TUN impairer did not start: {ready}")

    def _stop_impairer(self) -> None:
        proc, self._impairer = self._impairer, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()  # by its pid (ip netns exec execs the interpreter)
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        for stream in (proc.stdin, proc.stdout):
            try:
                stream.close()
            except OSError:
                pass

    def _nft(self, command: str) -> subprocess.CompletedProcess:
        return _run("ip", "netns", "exec", self.router_ns, "nft", *command.split())

    def _ns(self, ns: str, *argv: str) -> None:
        _run("ip", "netns", "exec", ns, *argv)

    def _add_ns(self, ns: str) -> None:
        _run("ip", "netns", "add", ns)
        self._made_ns.append(ns)
        self._ns(ns, "ip", "link", "set", "lo", "up")

    def _build(self) -> None:
        self.octet = _free_octet()
        o, r = self.octet, self.router_ns
        self._add_ns(r)
        self._ns(r, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
        _run("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", f"rf{self.tag}r", "netns", r)
        _run("ip", "addr", "add", f"10.{o}.0.1/30", "dev", self.host_if)
        _run("ip", "link", "set", self.host_if, "up")
        self._ns(r, "ip", "addr", "add", f"10.{o}.0.2/30", "dev", f"rf{self.tag}r")
        self._ns(r, "ip", "link", "set", f"rf{self.tag}r", "up")
        self._nft("add table inet rollfleet_netfault")
        self._nft("add chain inet rollfleet_netfault forward { type filter hook forward priority 0 ; policy accept ; }")
        for i, ns in enumerate(self.agent_ns):
            gw, ag = f"rf{self.tag}g{i}", f"rf{self.tag}a{i}"
            self._add_ns(ns)
            self._ns(r, "ip", "link", "add", gw, "type", "veth", "peer", "name", ag, "netns", ns)
            self._ns(r, "ip", "addr", "add", f"10.{o}.{i + 1}.1/30", "dev", gw)
            self._ns(r, "ip", "link", "set", gw, "up")
            self._ns(ns, "ip", "addr", "add", f"10.{o}.{i + 1}.2/30", "dev", ag)
            self._ns(ns, "ip", "link", "set", ag, "up")
            # The whole 10.X.0.0/16 through the router: the coordinator's link, and the other slots (a
            # trainer run in a slot of its own fetches payloads from the agents' namespaces).
            self._ns(ns, "ip", "route", "add", f"10.{o}.0.0/16", "via", f"10.{o}.{i + 1}.1")
            _run("ip", "route", "add", f"10.{o}.{i + 1}.0/30", "via", f"10.{o}.0.2", "dev", self.host_if)
            # One chain per agent, jumped to from forward: healing agent i flushes only its own rules.
            self._nft(f"add chain inet rollfleet_netfault a{i}")
            self._nft(f"add rule inet rollfleet_netfault forward jump a{i}")

    def close(self) -> None:
        """Remove everything the harness made, by name; errors are collected, not raised half-way."""
        errors = []
        self._stop_impairer()
        # Deleting a namespace deletes its interfaces, their veth peers (the root end too), their
        # routes and its nftables ruleset.
        for ns in reversed(self._made_ns):
            out = _run("ip", "netns", "del", ns, check=False)
            if out.returncode != 0:
                errors.append(out.stderr.strip())
        self._made_ns.clear()
        if _run("ip", "link", "show", self.host_if, check=False).returncode == 0:
            _run("ip", "link", "del", self.host_if, check=False)
        if errors:
            raise NetFaultUnavailable("netfault cleanup: " + "; ".join(errors))

    def leftovers(self) -> list[str]:
        """What of this harness still exists (empty after ``close``)."""
        left = []
        names = _run("ip", "netns", "list").stdout
        left += [ns for ns in (self.router_ns, *self.agent_ns) if ns in names.split()]
        if _run("ip", "link", "show", self.host_if, check=False).returncode == 0:
            left.append(self.host_if)
        return left

    def __enter__(self) -> NetFault:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
