#!/usr/bin/env bash
# The CHARM+ paper's Table 5 (H100, 12 heads x 192, bf16, full attention) on the emulated GPU
# cluster (docs/emulator.md): one bench run per row, ring / rmplus / charm, device time.
#   OUT=runs/emulated-t5 scripts/emulate_table5.sh [2x8|4x8 ...]
#   (ROWS_2x8 / ROWS_4x8="B:S ...": a subset of the rows)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/emulated-t5}
BENCH=${BENCH:-.venv/bin/charm-megatron}
ROWS_2x8=${ROWS_2x8:-"16:26880 16:13440 64:6720 128:3360"}
ROWS_4x8=${ROWS_4x8:-"16:31744 16:15872 64:7936 128:3968"}
topos=("$@")
[ ${#topos[@]} -gt 0 ] || topos=(2x8 4x8)
mkdir -p "$OUT"
for topo in "${topos[@]}"; do
  rows_var="ROWS_${topo}"
  for row in ${!rows_var}; do
    b=${row%%:*}; s=${row##*:}
    dir="$OUT/$topo-b$b-s$s"
    echo "== $topo B=$b S=$s -> $dir"
    "$BENCH" bench --emulate "$topo" --device-model "${DEVICE:-h100}" --batch "$b" --seq "$s" \
      --heads 12x192 --no-causal --dtype bf16 --algos "${ALGOS:-ring,rmplus,charm}" \
      --warmup "${WARMUP:-1}" --iters "${ITERS:-2}" --out "$dir" --no-plot --quiet \
      ${EXTRA:-} > "$dir.log" 2>&1 \
      || echo "!! $topo B=$b S=$s: bench failed (exit $?), see $dir.log"
    grep -E "^  (ring|rmplus|charm|auto) |wrote|dilation" "$dir.log" || true
  done
done
