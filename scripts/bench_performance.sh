#!/usr/bin/env bash
# The emulated-cluster measurements behind docs/performance.md (see docs/bench.md):
#   2x2 and 2x4 clusters, one shared NIC per node (--nic node) and one NIC per rank (--nic rank),
#   cross link = intra link / 8 (100 / 800 Mbit/s: at S = 2k..8k, 8 heads x 64, bf16, ring's
#   CCR lands at about 0.1-0.45 on a 2-core machine), causal, forward and backward timed
#   separately (the table shows fwd, bwd and fwd+bwd).
# Runs one configuration after another - never two benchmarks at once (CPU-TESTBED.md).
# About 21 minutes on 2 cores. Needs root for the namespaces (else: software link model).
#
#   scripts/bench_performance.sh                 # all four
#   OUT=runs/perf2 CROSS=200mbit INTRA=1600mbit scripts/bench_performance.sh --iters 3
#   SHAPES=2x4 NICS=rank scripts/bench_performance.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/performance}
CROSS=${CROSS:-100mbit}
INTRA=${INTRA:-800mbit}
SHAPES=${SHAPES:-"2x2 2x4"}
NICS=${NICS:-"node rank"}
mkdir -p "$OUT"
for shape in $SHAPES; do
  for nic in $NICS; do
    dir="$OUT/$shape-$nic"
    echo "=== $shape, nic=$nic, cross $CROSS, intra $INTRA -> $dir"
    "$PY" -m charm_megatron.cli bench --batch 1 --seq 2k,4k,8k --heads 8x64 --dtype bf16 \
      --causal --warmup 1 --iters 5 --emulate "$shape" --cross-rate "$CROSS" \
      --intra-rate "$INTRA" --nic "$nic" --out "$dir" "$@" 2>&1 | tee "$dir.log"
  done
done
"$PY" -m charm_megatron.cli report summary "$OUT"/*/results.csv | tee "$OUT/summary.md"
