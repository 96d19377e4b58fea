#!/usr/bin/env bash
# Install rollfleet into ./.venv (first run only) and run the demo:
# a coordinator, two agents with sim engines, and a trainer pulling batches.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -e .
exec .venv/bin/python scripts/demo.py "$@"
