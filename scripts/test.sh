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
# ROLLFLEET_TEST_WORKERS=N (default 1: one process) runs the test files on N workers (pytest-xdist), each file's
# tests on one worker in order (--dist loadfile). On 2 cores the heavy files (hf engines, the GRPO example, chaos)
# then starve each other's timing bounds, so CI runs them one at a time.
workers="${ROLLFLEET_TEST_WORKERS:-1}"
parallel=()
if [ "$workers" -gt 1 ] 2>/dev/null; then
  parallel=(-n "$workers" --dist loadfile)
fi
.venv/bin/python -m pytest "${parallel[@]}" "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
