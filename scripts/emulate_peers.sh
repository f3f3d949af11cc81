#!/usr/bin/env bash
# CHARM+ against every CP a Megatron user can pick (docs/performance.md, "Against every CP a
# user can pick") on the emulated GPU clusters (docs/emulator.md): one bench run per point,
# ring / rmplus / charm / allgather / a2a / a2a+p2p / auto (a head all-to-all only where
# the heads divide by its group), forward + backward in device time.
#   OUT=runs/peers scripts/emulate_peers.sh        (ONLY=regex: a subset of the points;
#   EXTRA="--dilation 400": more bench options for every point)
# Then: charm-megatron report peers --sort $OUT/*/results.csv
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/peers}
BENCH=${BENCH:-.venv/bin/charm-megatron}
ALGOS=${ALGOS:-ring,rmplus,charm,allgather,a2a,a2a+p2p,auto}
# name: emulate device batch seq heads kv_heads mask
POINTS=(
  "t5-2x8-b16-s26880:2x8:h100:16:26880:12x192:12:--no-causal"
  "t5-2x8-b128-s3360:2x8:h100:128:3360:12x192:12:--no-causal"
  "llama8b-2x8-s32768:2x8:h100:1:32768:32x128:8:--causal"
  "llama8b-2x8-s131072:2x8:h100:1:131072:32x128:8:--causal"
  "mha-2x8-s65536:2x8:h100:1:65536:32x128:32:--causal"
  "llama70b-2x8-s131072:2x8:h100:1:131072:64x128:8:--causal"
  "llama8b-4x8-s131072:4x8:h100:1:131072:32x128:8:--causal"
  "llama8b-2x8-s16384:2x8:h100:1:16384:32x128:8:--causal"
  "llama70b-2x8-s32768:2x8:h100:1:32768:64x128:8:--causal"
  "llama8b-4x8-s32768:4x8:h100:1:32768:32x128:8:--causal"
  "llama70b-4x8-s131072:4x8:h100:1:131072:64x128:8:--causal"
  "t5-4x8-b16-s31744:4x8:h100:16:31744:12x192:12:--no-causal"
  "l20-llama8b-2x4-s32768:2x4:l20-pcie:1:32768:32x128:8:--causal"
  "l20-mha-2x4-s32768:2x4:l20-pcie:1:32768:32x128:32:--causal"
)
mkdir -p "$OUT"
for point in "${POINTS[@]}"; do
  IFS=: read -r name topo device b s heads kv mask <<<"$point"
  # ONLY=regex: run the points whose name matches it (e.g. ONLY='llama|l20').
  if [[ -n "${ONLY:-}" && ! "$name" =~ $ONLY ]]; then continue; fi
  echo "== $name"
  "$BENCH" bench --emulate "$topo" --device-model "$device" --batch "$b" --seq "$s" \
    --heads "$heads" --kv-heads "$kv" "$mask" --dtype bf16 --algos "$ALGOS" \
    --warmup "${WARMUP:-1}" --iters "${ITERS:-2}" --out "$OUT/$name" --no-plot --quiet ${EXTRA:-} \
    > "$OUT/$name.log" 2>&1 \
    || echo "!! $name: bench failed (exit $?), see $OUT/$name.log"
  grep -E "wrote|dilation" "$OUT/$name.log" || true
done
