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
# The documentation site (mkdocs.yml) into site/, git-ignored: a broken link or anchor, or a page left out of the
# navigation, fails the run here too (--strict).
# (Not --quiet: with it, mkdocs 1.6 counts no warning and --strict passes anything.)
docs_started=$(date +%s)
docs_log=$(mktemp)
if ! NO_MKDOCS_2_WARNING=1 .venv/bin/python -m mkdocs build --strict >"$docs_log" 2>&1; then
  cat "$docs_log" >&2
  rm -f "$docs_log"
  echo "error: mkdocs build --strict failed (the documentation site: mkdocs.yml, docs/)" >&2
  exit 1
fi
rm -f "$docs_log"
echo "docs site built in $(( $(date +%s) - docs_started )) s (site/)"
# ROLLFLEET_TEST_WORKERS=N (default 2; 1: one process, in order) runs the tests on N workers (pytest-xdist,
# --dist load): each idle worker takes the next test, so the long files (models training, chaos, silent
# partitions) spread over the workers and both stay busy to the end. No test depends on another's order.
workers="${ROLLFLEET_TEST_WORKERS:-2}"
parallel=()
if [ "$workers" -gt 1 ] 2>/dev/null; then
  parallel=(-n "$workers" --dist load)
fi
started=$(date +%s)
.venv/bin/python -m pytest "${parallel[@]}" "$@"
rc=$?
echo "tests ran for $(( $(date +%s) - started )) s on ${workers} worker(s)"
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
