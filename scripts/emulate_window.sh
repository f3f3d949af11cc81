#!/usr/bin/env bash
# Sliding windows on the emulated H100 2x8 cluster (docs/performance.md, "Sliding windows"):
# Llama-3-8B-like attention (32 q / 8 kv heads x 128), CP 16, one bench run per point:
# window 4k at 64k and 128k, and the same 64k without a window; ring / rmplus / charm /
# allgather / a2a+p2p / auto, forward + backward in device time; and MHA (32 kv heads) at
# 64k with a 4k window, where Ulysses (a2a) is legal too.
#   OUT=runs/window scripts/emulate_window.sh      (ONLY=regex: a subset of the points)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/window}
BENCH=${BENCH:-.venv/bin/charm-megatron}
ALGOS=${ALGOS:-ring,rmplus,charm,allgather,a2a,a2a+p2p,auto}
# name: seq window (empty: full attention) kv-heads
POINTS=(
  "llama8b-2x8-s65536-w4096:65536:4096:8"
  "llama8b-2x8-s131072-w4096:131072:4096:8"
  "llama8b-2x8-s65536-w16384:65536:16384:8"
  "llama8b-2x8-s65536-full:65536::8"
  "mha-2x8-s65536-w4096:65536:4096:32"
)
mkdir -p "$OUT"
for point in "${POINTS[@]}"; do
  IFS=: read -r name s w kv <<<"$point"
  if [[ -n "${ONLY:-}" && ! "$name" =~ $ONLY ]]; then continue; fi
  echo "== $name"
  window=()
  [ -n "$w" ] && window=(--window "$w")
  "$BENCH" bench --emulate 2x8 --device-model h100 --batch 1 --seq "$s" --heads 32x128 \
    --kv-heads "$kv" --causal --dtype bf16 --algos "$ALGOS" "${window[@]}" \
    --warmup "${WARMUP:-1}" --iters "${ITERS:-2}" --out "$OUT/$name" --no-plot --quiet \
    > "$OUT/$name.log" 2>&1 \
    || echo "!! $name: bench failed (exit $?), see $OUT/$name.log"
  grep -E "wrote|dilation" "$OUT/$name.log" || true
done
