#!/usr/bin/env bash
# The CHARM+ paper's Table 4 (its ablation: ring / RM+ / CHARM+ forward on L20 and H20) on the
# emulated GPU cluster (docs/emulator.md), device time. Table 4 states only S: the shape is the
# one fitted on its ring column (profile h20-table4's fit.shape; docs/performance.md).
#   OUT=runs/emulated-t4 scripts/emulate_table4.sh [l20-1x4 l20-2x4 h20-1x4 h20-1x8 h20-2x8 ...]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/emulated-t4}
BENCH=${BENCH:-.venv/bin/charm-megatron}
PY=${PY:-.venv/bin/python}
read -r B HEADS < <("$PY" -c "from charm_megatron.model import get_profile as g
s = g('h20-table4').fit['shape']; print(s['batch'], f\"{s['heads']}x{s['head_dim']}\")")
runs=("$@")
[ ${#runs[@]} -gt 0 ] || runs=(l20-1x4 l20-2x4 h20-1x4 h20-1x8 h20-2x8)
mkdir -p "$OUT"
for run in "${runs[@]}"; do
  gpu=${run%%-*}; topo=${run##*-}
  case $gpu in l20) device=l20-pcie ;; h20) device=h20-table4 ;; *) echo "unknown $run"; exit 2 ;; esac
  # CHARM+ only where there is a slow link (the paper runs it only there).
  algos=ring,rmplus; [ "${topo%%x*}" = 1 ] || algos=ring,rmplus,charm
  dir="$OUT/$run"
  echo "== $run ($device, B=$B, $HEADS) -> $dir"
  "$BENCH" bench --emulate "$topo" --device-model "$device" --batch "$B" --seq 1792,7168 \
    --heads "$HEADS" --no-causal --dtype bf16 --algos "${ALGOS:-$algos}" --forward-only \
    --warmup "${WARMUP:-1}" --iters "${ITERS:-2}" --out "$dir" --no-plot --quiet \
    ${EXTRA:-} > "$dir.log" 2>&1 || echo "!! $run: bench failed (exit $?), see $dir.log"
  grep -E "^  (ring|rmplus|charm|auto) |wrote|dilation" "$dir.log" || true
done
