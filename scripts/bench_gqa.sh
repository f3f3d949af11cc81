#!/usr/bin/env bash
# Issue 12's grid (docs/performance.md, "Grouped-query attention: roles by bytes"): the emulated
# 2x4 cluster, B=2, S=3072, 8 query heads x 64, fp32, causal, with 8 (MHA), 2 and 1 kv heads;
# ring, rmplus, charm and auto timed side by side in one run per configuration, with ring's
# CCR and every contender's lower bound:
#   - cross 100 Mbit / intra 800 Mbit (ring CCR ~0.1-0.5): one NIC per rank and one per node
#     under the tbf link model, one NIC per rank under the htb model (--link-model htb);
#   - cross 500 Mbit / intra 4 Gbit (the independent harness's links; ring CCR ~0.5 for MHA,
#     ~1-2 for GQA): one NIC per rank, tbf and htb.
# Runs one configuration after another - never two benchmarks at once (CPU-TESTBED.md).
# About 15 minutes on 2 quiet cores. Needs root for the namespaces.
#
#   scripts/bench_gqa.sh                       # the whole grid
#   KVS="2" LINKS="rank:tbf" RATES="100mbit:800mbit" scripts/bench_gqa.sh --iters 5
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/bench-gqa}
KVS=${KVS:-"8 2 1"}
LINKS=${LINKS:-"rank:tbf node:tbf rank:htb"}
RATES=${RATES:-"100mbit:800mbit 500mbit:4gbit"}
ITERS=${ITERS:-3}
mkdir -p "$OUT"
for rate in $RATES; do
  cross=${rate%%:*}
  intra=${rate##*:}
  for link in $LINKS; do
    nic=${link%%:*}
    model=${link##*:}
    # At 500 Mbit only one NIC per rank (the harness's layout).
    [ "$cross" = 500mbit ] && [ "$nic" = node ] && continue
    for kv in $KVS; do
      dir="$OUT/$nic-$model-$cross-kv$kv"
      echo "=== 2x4 nic=$nic link-model=$model cross $cross intra $intra kv heads $kv -> $dir"
      "$PY" -m charm_megatron.cli bench --batch 2 --seq 3072 --heads 8x64 --kv-heads "$kv" \
        --dtype fp32 --causal --warmup 1 --iters "$ITERS" --no-memory \
        --algos ring,rmplus,charm,auto --emulate 2x4 --cross-rate "$cross" \
        --intra-rate "$intra" --nic "$nic" --link-model "$model" --quiet --no-plot \
        --out "$dir" "$@" 2>&1 | tee "$dir.log"
    done
  done
done
"$PY" -m charm_megatron.cli report summary "$OUT"/*/results.csv | tee "$OUT/summary.md"
