"""Test harness: real rollfleet clusters on loopback (processes, ports, data dirs), fault injection
(a TCP proxy that can partition a link) and the chaos run with its invariant checker.

Used by tests/ and by scripts/ (long chaos runs, benchmarks); it may import every package.
"""
