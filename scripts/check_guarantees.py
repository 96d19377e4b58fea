#!/usr/bin/env python3
"""Mutation self-check: does each guarantee's test fail when the guarantee is broken?

For every mutation in ``scripts/guarantee_mutations.py`` (a small deliberate bug: a piece of
source replaced by a broken one) this copies the working tree to a temporary directory, applies
the mutation there, runs the test named for it and expects that test to FAIL. It prints one row
per mutation (guarantee, mutation, test, caught yes/no) and exits non-zero when any mutation
survives, when a mutation no longer applies (its source moved: update the mutation), or when a
named test fails on the unmutated copy (a broken baseline proves nothing).

    python scripts/check_guarantees.py             # every mutation, about 5-10 minutes on 2 cores
    python scripts/check_guarantees.py -k fence    # only mutations whose name contains "fence"
    python scripts/check_guarantees.py --list

It is not part of CI: it runs the named tests many times. Run it before resolving an issue that
touches a guarantee, and paste its table into the closing note.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from guarantee_mutations import MUTATIONS, Mutation  # noqa: E402


def copy_tree(dest: Path) -> None:
    """The working tree as git sees it (tracked and untracked-not-ignored files), without .venv or .git."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for raw in filter(None, listed):
        rel = raw.decode()
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def apply(mutation: Mutation, tree: Path) -> None:
    path = tree / mutation.path
    text = path.read_text()
    count = text.count(mutation.old)
    if count != 1:
        raise LookupError(f"{mutation.name}: expected the snippet once in {mutation.path}, found it {count} times")
    path.write_text(text.replace(mutation.old, mutation.new))


def run_test(tree: Path, test: str, timeout: float) -> tuple[bool, str]:
    """(passed, tail of output) for one pytest node id run in ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
    argv = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "--timeout", str(int(timeout)), test]
    try:
        out = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout + 60)
    except subprocess.TimeoutExpired:
        return False, "timed out"
    return out.returncode == 0, (out.stdout + out.stderr)[-1500:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-k", default="", help="only mutations whose name contains this")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    ap.add_argument("--timeout", type=float, default=240, help="seconds per test run (default 240)")
    ap.add_argument("--skip-baseline", action="store_true", help="do not first run the named tests unmutated")
    ap.add_argument("-v", "--verbose", action="store_true", help="print the output of survived mutations")
    args = ap.parse_args()
    chosen = [m for m in MUTATIONS if args.k in m.name]
    if args.list or not chosen:
        for m in chosen:
            print(f"{m.guarantee:>3}  {m.name:<40} {m.test}")
        return 0 if chosen else 2

    rows, failed = [], False
    with tempfile.TemporaryDirectory(prefix="rollfleet-mutants-") as tmp:
        if not args.skip_baseline:
            base = Path(tmp) / "baseline"
            copy_tree(base)
            for test in sorted({m.test for m in chosen}):
                ok, tail = run_test(base, test, args.timeout)
                print(f"baseline {'passes' if ok else 'FAILS '}  {test}", flush=True)
                if not ok:
                    print(tail)
                    failed = True
            if failed:
                print("a named test fails without any mutation: fix that first", file=sys.stderr)
                return 1
        for i, m in enumerate(chosen):
            tree = Path(tmp) / f"mutant-{i}"
            copy_tree(tree)
            started = time.monotonic()
            try:
                apply(m, tree)
            except LookupError as exc:
                rows.append((m, "STALE", 0.0))
                print(f"[{i + 1}/{len(chosen)}] {exc}", flush=True)
                failed = True
                continue
            passed, tail = run_test(tree, m.test, args.timeout)
            verdict = "no" if passed else "yes"
            rows.append((m, verdict, time.monotonic() - started))
            print(f"[{i + 1}/{len(chosen)}] {m.name}: caught={verdict} ({time.monotonic() - started:.0f}s)", flush=True)
            if passed:
                failed = True
                if args.verbose:
                    print(tail)
            shutil.rmtree(tree, ignore_errors=True)

    print()
    print("| guarantee | mutation | test | caught |")
    print("| --- | --- | --- | --- |")
    for m, verdict, _ in rows:
        print(f"| {m.guarantee} | {m.name}: {m.what} | `{m.test}` | {verdict} |")
    caught = sum(1 for _, v, _ in rows if v == "yes")
    print(f"\n{caught} of {len(rows)} mutations caught")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
