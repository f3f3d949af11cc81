#!/usr/bin/env bash
# CHARM+ with head parallelism on the emulated H100 clusters (docs/performance.md, "CHARM+
# with head parallelism", the emulated check): per point one bench run of ring, CHARM+ (its
# head_parallel chosen by the model), our a2a+p2p where the heads divide by the node and our
# auto, then CHARM+ alone at head_parallel=1 (the paper's CHARM+) as NAME-d1.
#   OUT=runs/hp scripts/emulate_head_parallel.sh      (ONLY=regex / SKIP=regex pick points;
#   EXTRA="--dilation 400": more bench options for every run)
# Then: charm-megatron report head-parallel --emulated $OUT/*.csv
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/hp}
BENCH=${BENCH:-.venv/bin/charm-megatron}
HIER=ring,charm,a2a+p2p,auto
# name: topology nic batch seq heads kv_heads mask algos
POINTS=(
  "llama8b-2x8-s32768:2x8:rank:1:32768:32x128:8:--causal:$HIER"
  "llama70b-2x8-s32768:2x8:rank:1:32768:64x128:8:--causal:$HIER"
  "llama8b-2x8-s16384-node:2x8:node:1:16384:32x128:8:--causal:$HIER"
  "mha-2x8-s65536:2x8:rank:1:65536:32x128:32:--causal:$HIER"
  "qwen-2x8-s32768:2x8:rank:1:32768:28x128:4:--causal:ring,charm,auto"
  "t5-2x8-b16-s26880:2x8:rank:16:26880:12x192:12:--no-causal:ring,charm,auto"
  "llama8b-4x8-s32768:4x8:rank:1:32768:32x128:8:--causal:$HIER"
)
mkdir -p "$OUT"
run() {  # name algos extra...
  local name=$1 algos=$2
  shift 2
  if [[ -s "$OUT/$name.csv" ]]; then echo "== $name (done)"; return; fi
  echo "== $name $(date +%H:%M:%S)"
  # shellcheck disable=SC2086  # $mask and EXTRA are lists of options
  "$BENCH" bench --emulate "$topo" --device-model h100 --nic "$nic" --batch "$b" --seq "$s" \
    --heads "$heads" --kv-heads "$kv" $mask --dtype bf16 --algos "$algos" --warmup 1 \
    --iters 2 --out "$OUT/$name" --no-plot --quiet "$@" ${EXTRA:-} > "$OUT/$name.log" 2>&1 \
    && cp "$OUT/$name/results.csv" "$OUT/$name.csv" \
    || echo "!! $name: bench failed (exit $?), see $OUT/$name.log"
}
for point in "${POINTS[@]}"; do
  IFS=: read -r name topo nic b s heads kv mask algos <<<"$point"
  if [[ -n "${ONLY:-}" && ! "$name" =~ $ONLY ]]; then continue; fi
  if [[ -n "${SKIP:-}" && "$name" =~ $SKIP ]]; then continue; fi
  run "$name" "$algos"
  run "$name-d1" charm --setting head_parallel=1
done
