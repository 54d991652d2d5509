#!/usr/bin/env bash
# Loss parity on a GPU: `python -m models.train` with the kernels and with --kernels xla, the same
# seed and batches; each run's per-step losses as JSON lines in DIR (bench/plot_parity.py plots
# them and says whether the gap exceeds what a change of seed does to it).
#   bench/parity.sh DIR PRESET STEPS [more train flags]
# Environment: SEEDS (default "0"): one run of each variant per seed; VARIANTS (default
# "jaxkernels xla"): also "ref-OPS", the kernels with OPS ("+"-separated, of norm, matmul,
# attention, mlp, loss) on XLA's path (--reference-ops), to find which kernel a gap comes from;
# "fp8": the kernels with --fp8; "xla-again": xla a second time, the control (two runs of one program part ways too: XLA's
# scatter-add of the embedding gradient sums in a varying order on a GPU).
set -uo pipefail
dir=$1 preset=$2 steps=$3; shift 3
mkdir -p "$dir"
for seed in ${SEEDS:-0}; do
  for variant in ${VARIANTS:-jaxkernels xla}; do
    case $variant in
      ref-*) flags=(--kernels jaxkernels --reference-ops "${variant#ref-}") ;;
      fp8) flags=(--kernels jaxkernels --fp8) ;;
      *-again) flags=(--kernels "${variant%-again}") ;;
      *) flags=(--kernels "$variant") ;;
    esac
    out="$dir/${preset}_${variant}_s${seed}.jsonl"
    rm -f "$out"
    SECONDS=0
    python3 -m models.train --preset "$preset" --steps "$steps" --seed "$seed" "${flags[@]//+/,}" \
      --no-compilation-cache --log-every 100 --metrics "$out" "$@" 2>&1 \
      | grep -v "Warning\|warnings.warn\|ans = f"
    echo "$preset $variant seed $seed: ${SECONDS} s wall"
  done
done
