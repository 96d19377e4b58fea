#!/usr/bin/env bash
# Install what the GRPO example needs into ./.venv (transformers, safetensors, matplotlib, torch)
# and run it: model, warm-up, coordinator, agent with an hf engine, training, plot.
# Arguments go to `python -m examples.grpo.run` (e.g. --out runs/grpo --steps 120 --weights disk).
# torch: taken as it is when .venv already has it; else TORCH_SPEC (default torch==2.13.0; a bare
# 'torch' requirement may pull a multi-GB CUDA build where the CPU one would do).
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[hf,examples]'
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q --disable-pip-version-check "${TORCH_SPEC:-torch==2.13.0}"
fi
exec .venv/bin/python -m examples.grpo.run "$@"
