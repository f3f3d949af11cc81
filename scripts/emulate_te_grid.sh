#!/usr/bin/env bash
# Our `auto` against TransformerEngine's CP types as shipped on the emulated H100 2x8 and 4x8
# clusters with the costs measured on the H200 (docs/performance.md, "TransformerEngine as
# shipped", the emulated grid): issue 39's grid plus a 4k window at 64k, both NIC models, one
# bench run per point with the TE types that can be TE's fastest there by the model (te-a2a+p2p
# where the heads divide by the node, te-a2a for MHA, te-p2p where neither runs), our a2a+p2p
# where it runs, and our auto; forward + backward in device time. TE's all-gather is
# model-only (the emulator times point-to-point plans, not NCCL collectives), as is TE's ring
# where its a2a+p2p runs (the model puts it 1.5-3.5x slower there).
#   OUT=runs/te-grid scripts/emulate_te_grid.sh      (ONLY=regex: a subset of the points;
#   SKIP=regex: leave points out; EXTRA="--dilation 400": more bench options for every point)
# Then: charm-megatron report te --emulated $OUT/*.csv
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/te-grid}
BENCH=${BENCH:-.venv/bin/charm-megatron}
HIER=te-a2a+p2p,a2a+p2p,auto
# name: batch seq heads kv_heads mask-and-window algos; the short sequences first, 128k last
SHAPES=(
  "llama8b-s16384:1:16384:32x128:8:--causal:$HIER"
  "llama70b-s16384:1:16384:64x128:8:--causal:$HIER"
  "llama8b-s32768:1:32768:32x128:8:--causal:$HIER"
  "llama70b-s32768:1:32768:64x128:8:--causal:$HIER"
  "qwen-s32768:1:32768:28x128:4:--causal:te-p2p,auto"
  "llama8b-s65536-w4096:1:65536:32x128:8:--causal --window 4096,0:auto"
  "mha-s65536:1:65536:32x128:32:--causal:te-a2a,$HIER"
  "t5-b16-s26880:16:26880:12x192:12:--no-causal:te-p2p,auto"
  "llama8b-s131072:1:131072:32x128:8:--causal:$HIER"
  "llama70b-s131072:1:131072:64x128:8:--causal:$HIER"
)
mkdir -p "$OUT"
for shape in "${SHAPES[@]}"; do
  IFS=: read -r sname b s heads kv mask algos <<<"$shape"
  for topo in 2x8 4x8; do
    for nic in rank node; do
      name="${sname%%-*}-$topo-${sname#*-}"
      [[ $nic == node ]] && name="$name-node"
      if [[ -n "${ONLY:-}" && ! "$name" =~ $ONLY ]]; then continue; fi
      if [[ -n "${SKIP:-}" && "$name" =~ $SKIP ]]; then continue; fi
      if [[ -s "$OUT/$name.csv" ]]; then echo "== $name (done)"; continue; fi
      echo "== $name $(date +%H:%M:%S)"
      # shellcheck disable=SC2086  # $mask is a list of options
      "$BENCH" bench --emulate "$topo" --device-model h200 --nic "$nic" --batch "$b" \
        --seq "$s" --heads "$heads" --kv-heads "$kv" $mask --dtype bf16 --algos "${ALGOS:-$algos}" \
        --warmup "${WARMUP:-1}" --iters "${ITERS:-2}" --out "$OUT/$name" --no-plot --quiet \
        ${EXTRA:-} > "$OUT/$name.log" 2>&1 \
        && cp "$OUT/$name/results.csv" "$OUT/$name.csv" \
        || echo "!! $name: bench failed (exit $?), see $OUT/$name.log"
      grep -E "dilation" "$OUT/$name.log" | head -2 || true
    done
  done
done
