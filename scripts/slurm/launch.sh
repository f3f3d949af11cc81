#!/usr/bin/env bash
# Submit one run of a charm-megatron config to SLURM (docs/slurm.md).
#
#   scripts/slurm/launch.sh --config gpt-350m --run scale-s2048-gb16 --comm charm [--dry-run]
#
# Options (environment defaults in brackets):
#   --config C          config file or packaged name [CHARM_CONFIG]
#   --run R             run name under runs: [CHARM_RUN]
#   --comm T            --cp-comm-type (`charm-megatron args --list-comm-types`) [CHARM_COMM, charm]
#   --nodes N           override the config's parallel.nodes [CHARM_NODES]
#   --gpus-per-node G   override the config's parallel.gpus_per_node [CHARM_GPUS_PER_NODE]
#   --set KEY=VALUE     config override or variable (DATA_PATH=...), repeatable
#   --runs-dir DIR      logs go to DIR/<config>/<run>/<comm>/ [CHARM_RUNS_DIR, ./runs]
#   --port P            torchrun rendezvous port [CHARM_PORT, 29500]
#   --time T, --partition P, --account A, --sbatch-arg ARG (repeatable): passed to sbatch
#   --dry-run           print the sbatch command and the job step; write and submit nothing
# Environment: CHARM_MEGATRON (the charm-megatron executable; default: charm-megatron on PATH,
# else "$PYTHON -m charm_megatron.cli" with PYTHON defaulting to python3), TORCHRUN.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
die() { printf 'launch.sh: %s\n' "$*" >&2; exit 2; }

# Print a command so that bash reads it back as the same words.
quote_cmd() {
    local word out=""
    for word in "$@"; do
        if [[ $word =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then
            out+=" $word"
        else
            out+=" '${word//\'/\'\\\'\'}'"
        fi
    done
    printf '%s\n' "${out# }"
}

config=${CHARM_CONFIG:-}
run=${CHARM_RUN:-}
comm=${CHARM_COMM:-charm}
nodes=${CHARM_NODES:-}
gpus=${CHARM_GPUS_PER_NODE:-}
runs_dir=${CHARM_RUNS_DIR:-runs}
port=${CHARM_PORT:-29500}
dry_run=0
sets=()
sbatch_extra=()
while (($#)); do
    case $1 in
        --config) config=${2:?--config needs a value}; shift 2 ;;
        --run) run=${2:?--run needs a value}; shift 2 ;;
        --comm) comm=${2:?--comm needs a value}; shift 2 ;;
        --nodes) nodes=${2:?--nodes needs a value}; shift 2 ;;
        --gpus-per-node) gpus=${2:?--gpus-per-node needs a value}; shift 2 ;;
        --set) sets+=(--set "${2:?--set needs KEY=VALUE}"); shift 2 ;;
        --runs-dir) runs_dir=${2:?--runs-dir needs a value}; shift 2 ;;
        --port) port=${2:?--port needs a value}; shift 2 ;;
        --time) sbatch_extra+=(--time "${2:?--time needs a value}"); shift 2 ;;
        --partition) sbatch_extra+=(--partition "${2:?--partition needs a value}"); shift 2 ;;
        --account) sbatch_extra+=(--account "${2:?--account needs a value}"); shift 2 ;;
        --sbatch-arg) sbatch_extra+=("${2:?--sbatch-arg needs a value}"); shift 2 ;;
        --dry-run) dry_run=1; shift ;;
        -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
        *) die "unknown option '$1' (see --help)" ;;
    esac
done
[[ -n $config ]] || die "--config is required"
[[ -n $run ]] || die "--run is required"

# shellcheck source-path=SCRIPTDIR source=common.sh
source "$here/common.sh"  # sets cm: the charm-megatron command
# The world size is part of the config (CP must divide it), so node/GPU counts go through it.
if [[ -n $nodes ]]; then sets+=(--set "nodes=$nodes"); fi
if [[ -n $gpus ]]; then sets+=(--set "gpus_per_node=$gpus"); fi
query=(args "$config" --run "$run" --cp-comm-type "$comm" "${sets[@]}")

# Facts of the run (NAME=value lines; names and numbers only, checked by the config schema).
facts=$("${cm[@]}" "${query[@]}" --format env) || exit 2
cfg_name="" run_name=""
while IFS='=' read -r key value; do
    case $key in
        CONFIG) cfg_name=$value ;;
        RUN) run_name=$value ;;
        NODES) nodes=$value ;;
        GPUS_PER_NODE) gpus=$value ;;
    esac
done <<< "$facts"
# The Megatron arguments, one per line: read into an array, never split by the shell.
lines=$("${cm[@]}" "${query[@]}" --format lines) || exit 2
mapfile -t margs <<< "$lines"

[[ $runs_dir = /* ]] || runs_dir="$PWD/$runs_dir"
run_dir="$runs_dir/$cfg_name/$run_name/$comm"
submit=(
    sbatch --job-name "charm-$cfg_name-$run_name-$comm"
    --nodes "$nodes" --ntasks-per-node 1 --gpus-per-node "$gpus" --exclusive
    --output "$run_dir/train-%j.log"
    "${sbatch_extra[@]}"
    "$here/run.sbatch" --run-dir "$run_dir" --nodes "$nodes" --gpus-per-node "$gpus" --port "$port"
    -- "${margs[@]}"
)

if ((dry_run)); then
    printf '# run directory: %s\n' "$run_dir"
    printf '# would write there: meta.json megatron-args.txt sbatch.sh jobs.txt; the job: command.sh train-<job id>.log\n'
    printf '# submit:\n'
    quote_cmd "${submit[@]}"
    printf '# job step (on the allocation; <head> = its first node):\n'
    bash "$here/run.sbatch" --dry-run --nodes "$nodes" --gpus-per-node "$gpus" --port "$port" \
        -- "${margs[@]}"
    exit 0
fi

command -v sbatch > /dev/null 2>&1 || die "sbatch not found: run on a SLURM login node, or use --dry-run"
mkdir -p "$run_dir"
printf '%s\n' "${margs[@]}" > "$run_dir/megatron-args.txt"
"${cm[@]}" "${query[@]}" --format json > "$run_dir/meta.json"
quote_cmd "${submit[@]}" > "$run_dir/sbatch.sh"
# --parsable must come before the script: what follows the script is the script's arguments.
job=$(sbatch --parsable "${submit[@]:1}")
job=${job%%;*}
printf '%s\n' "$job" >> "$run_dir/jobs.txt"
printf 'submitted %s: %s\n' "$job" "$run_dir"
