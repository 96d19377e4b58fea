#!/usr/bin/env bash
# Issue 24's comparison: five runs of the GRPO example, same seed, engine and trainer on CPU, then one figure.
#
#   eta1-none       --max-staleness 1 --correction none
#   eta4-none       --max-staleness 4 --correction none
#   eta4-token_tis  --max-staleness 4 --correction token_tis
#   eta4-icepop     --max-staleness 4 --correction icepop
#   eta4-ppo_clip   --max-staleness 4 --correction ppo_clip   (the example's default loss when ETA > 0)
#
# Usage: bash examples/grpo/curves.sh OUT_ROOT [more examples.grpo.run flags, e.g. --steps 100]
# Runs one after another (a 2-core machine). With CORES_PER_RUN=2 on a machine of 8 or more cores the
# five run at once, each pinned to cores of its own (taskset), so each still has exactly 2.
# PYTHON (default .venv/bin/python) runs them; the figure goes to OUT_ROOT/correction.png. RUNS="eta4-none ..."
# runs only those (the others' directories must already be there for the figure).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: curves.sh OUT_ROOT [run flags]}
shift
py=${PYTHON:-.venv/bin/python}
mkdir -p "$out"
runs=("eta1-none 1 none" "eta4-none 4 none" "eta4-token_tis 4 token_tis" "eta4-icepop 4 icepop" "eta4-ppo_clip 4 ppo_clip")
i=0
for spec in "${runs[@]}"; do
  read -r name eta mode <<<"$spec"
  if [ -n "${RUNS:-}" ] && [[ " $RUNS " != *" $name "* ]]; then continue; fi
  rm -rf "${out:?}/$name"
  cmd=("$py" -m examples.grpo.run --out "$out/$name" --max-staleness "$eta" --correction "$mode" --seed 0
       --steps 150 --eval-every 0 --engine-device cpu --trainer-device cpu "$@")
  if [ -n "${CORES_PER_RUN:-}" ]; then
    first=$((i * CORES_PER_RUN))
    taskset -c "$first-$((first + CORES_PER_RUN - 1))" "${cmd[@]}" >"$out/$name.log" 2>&1 &
  else
    nice -n 10 "${cmd[@]}" >"$out/$name.log" 2>&1
  fi
  i=$((i + 1))
done
wait
"$py" -m examples.grpo.compare "$out/correction.png" "eta 1, none=$out/eta1-none" "eta 4, none=$out/eta4-none" \
  "eta 4, token_tis=$out/eta4-token_tis" "eta 4, icepop=$out/eta4-icepop" "eta 4, ppo_clip=$out/eta4-ppo_clip"
