#!/usr/bin/env bash
# Issue 12's check on `auto` (docs/bench.md, "The auto contender"): over the bench grid, auto is
# never more than 5 % slower than the fastest of ring / rmplus / charm, timed side by side in
# one run per configuration:
#   2x2 and 2x4, one NIC per node and per rank, cross/intra 100/800 Mbit (ring CCR ~0.1-0.5)
#   and 500 Mbit/4 Gbit (CCR ~1-2, where ring can win), multi-head attention 8x64 (bf16) and
#   grouped-query 8 q / 2 kv heads (fp32), plus 8 q / 1 kv head on 2x4 --nic rank; causal;
#   S = 2k,4k; 1 + 3 rounds (18 runs).
# Each run's table ends with "auto picked X; auto / fastest: ..." per point (CHECK above 1.05);
# the summary at the end lists the worst ratio per run and every (point, pass) over 1.05.
# Runs one configuration after another - never two benchmarks at once (CPU-TESTBED.md).
# About 14 minutes on 2 quiet cores with the defaults. Needs root for the namespaces (else the
# software link model is used, which the bench says loudly).
#
#   scripts/bench_auto.sh                                   # the whole grid
#   SHAPES=2x4 NICS=rank RATES="500mbit:4gbit" scripts/bench_auto.sh --iters 5
#   SEQS=2k,4k,8k ITERS=5 OUT=runs/auto-long scripts/bench_auto.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/bench-auto}
SHAPES=${SHAPES:-"2x2 2x4"}
NICS=${NICS:-"node rank"}
RATES=${RATES:-"100mbit:800mbit 500mbit:4gbit"}
SEQS=${SEQS:-2k,4k}
ITERS=${ITERS:-3}
# heads spec: "label:--kv-heads value:dtype" (kv 0: multi-head attention)
HEADS=${HEADS:-"mha:0:bf16 gqa2:2:fp32"}
EXTRA_2X4=${EXTRA_2X4:-"gqa1:1:fp32"}  # also on 2x4 --nic rank (an 8 q / 1 kv head model)
mkdir -p "$OUT"
for shape in $SHAPES; do
  for nic in $NICS; do
    heads=$HEADS
    if [ "$shape" = "2x4" ] && [ "$nic" = "rank" ]; then heads="$HEADS $EXTRA_2X4"; fi
    for rate in $RATES; do
      cross=${rate%%:*}
      intra=${rate##*:}
      for h in $heads; do
        IFS=: read -r label kv dtype <<<"$h"
        kvarg=()
        [ "$kv" != 0 ] && kvarg=(--kv-heads "$kv")
        dir="$OUT/$shape-$nic-$cross-$label"
        echo "=== $shape nic=$nic cross $cross intra $intra $label ($dtype) -> $dir"
        "$PY" -m charm_megatron.cli bench --batch 1 --seq "$SEQS" --heads 8x64 "${kvarg[@]}" \
          --dtype "$dtype" --causal --warmup 1 --iters "$ITERS" --no-memory --no-bound \
          --algos ring,rmplus,charm,auto --emulate "$shape" --cross-rate "$cross" \
          --intra-rate "$intra" --nic "$nic" --quiet --no-plot --out "$dir" "$@" 2>&1 \
          | tee "$dir.log"
      done
    done
  done
done
"$PY" -m charm_megatron.cli report summary "$OUT"/*/results.csv | tee "$OUT/summary.md"
