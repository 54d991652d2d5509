#!/usr/bin/env bash
# Loss parity on a GPU: `python -m models.train` with the kernels and with --kernels xla, the same
# seed and batches; each run's per-step losses as JSON lines in DIR (bench/plot_parity.py plots
# them). Usage: bench/parity.sh DIR PRESET STEPS [more train flags]
set -uo pipefail
dir=$1 preset=$2 steps=$3; shift 3
mkdir -p "$dir"
for kernels in jaxkernels xla; do
  rm -f "$dir/${preset}_${kernels}.jsonl"
  SECONDS=0
  python3 -m models.train --preset "$preset" --steps "$steps" --kernels "$kernels" \
    --no-compilation-cache --log-every 50 --metrics "$dir/${preset}_${kernels}.jsonl" "$@" 2>&1 \
    | grep -v "Warning\|warnings.warn\|ans = f"
  echo "$preset $kernels: ${SECONDS} s wall"
done
