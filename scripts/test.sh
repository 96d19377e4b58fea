#!/usr/bin/env bash
# Install rollfleet with its test extra into ./.venv (first run only), lint (ruff) and run the tests.
# Extra arguments go to pytest. With CI=true the chaos suite runs its bounded version.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv || exit 1
fi
# torch first, the CPU build: the test extra's TRL needs torch (through accelerate), and left to the
# resolver that would pull the newest CUDA build (gigabytes of nvidia wheels) instead.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0 \
    || echo "note: torch 2.13.0 (CPU) not installed; pip may pull another build for the test extra"
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]' || exit 1
# House style first: a lint or format error fails the run before any test starts.
.venv/bin/python -m ruff check . || exit 1
.venv/bin/python -m ruff format --check . || { echo "run: .venv/bin/ruff format ." >&2; exit 1; }
# ROLLFLEET_TEST_WORKERS=N (default 2; 1: everything in one process, in order) runs the suite in two phases:
# first the tests not marked heavy on N workers (pytest-xdist, each file's tests on one worker, in order:
# --dist loadfile), mostly cluster tests that wait on their processes; then the heavy ones (hf engines
# training, the GRPO example, TRL, chaos: CPU-bound, and timing-sensitive when they share 2 cores) alone, in
# one process. Arguments select tests (paths, -k, -m): then it is one plain run in one process.
workers="${ROLLFLEET_TEST_WORKERS:-2}"
selective=0
for arg in "$@"; do
  case "$arg" in
    -q | -qq | -v | -vv | -x | -ra | -rA | --tb=*) ;;
    *) selective=1 ;;
  esac
done
if [ "$selective" = 1 ] || ! [ "$workers" -gt 1 ] 2>/dev/null; then
  .venv/bin/python -m pytest "$@"
  rc=$?
  if [ "$rc" -eq 5 ]; then
    echo "error: pytest collected no tests" >&2
    exit 1
  fi
  exit "$rc"
fi
started=$(date +%s)
echo "phase 1: tests not marked heavy, on $workers workers"
.venv/bin/python -m pytest -n "$workers" --dist loadfile -m "not heavy" "$@"
rc1=$?
echo "phase 2: heavy tests, one at a time ($(( $(date +%s) - started )) s so far)"
.venv/bin/python -m pytest -m heavy "$@"
rc2=$?
echo "both phases: $(( $(date +%s) - started )) s; exit codes $rc1 and $rc2"
if [ "$rc1" -eq 5 ] && [ "$rc2" -eq 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
for rc in "$rc1" "$rc2"; do
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then
    exit "$rc"
  fi
done
exit 0
