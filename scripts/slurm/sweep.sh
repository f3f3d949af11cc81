#!/usr/bin/env bash
# Submit every run of a config, once per comm type: Megatron's ring (p2p) and CHARM+ by default
# (docs/slurm.md).
#
#   scripts/slurm/sweep.sh --config gpt-350m [--comm p2p,charm] [--runs a,b] [--dry-run]
#
# Options: --config C [CHARM_CONFIG]; --comm T1,T2,... [CHARM_SWEEP_COMMS, p2p,charm];
# --runs R1,R2,... (default: all runs of the config, in file order); --dry-run. These are
# passed on to launch.sh for every submission: --nodes --gpus-per-node --set --runs-dir --port
# --time --partition --account --sbatch-arg.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
die() { printf 'sweep.sh: %s\n' "$*" >&2; exit 2; }

config=${CHARM_CONFIG:-}
comm_list=${CHARM_SWEEP_COMMS:-p2p,charm}
run_list=""
dry_run=0
pass=()
while (($#)); do
    case $1 in
        --config) config=${2:?--config needs a value}; shift 2 ;;
        --comm) comm_list=${2:?--comm needs a value}; shift 2 ;;
        --runs) run_list=${2:?--runs needs a value}; shift 2 ;;
        --dry-run) dry_run=1; shift ;;
        --nodes|--gpus-per-node|--set|--runs-dir|--port|--time|--partition|--account|--sbatch-arg)
            pass+=("$1" "${2:?$1 needs a value}"); shift 2 ;;
        -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
        *) die "unknown option '$1' (see --help)" ;;
    esac
done
[[ -n $config ]] || die "--config is required"

# shellcheck source-path=SCRIPTDIR source=common.sh
source "$here/common.sh"  # sets cm: the charm-megatron command

IFS=, read -r -a comms <<< "$comm_list"
if [[ -n $run_list ]]; then
    IFS=, read -r -a runs <<< "$run_list"
else
    listed=$("${cm[@]}" args "$config" --list-runs) || exit 2
    mapfile -t runs <<< "$listed"
fi
((${#comms[@]} > 0)) || die "--comm: no comm types"
# Check every comm type before the first submission (the accepted list comes from the CLI).
known=$("${cm[@]}" args --list-comm-types) || exit 2
for comm in "${comms[@]}"; do
    grep -qxF -- "$comm" <<< "$known" || die "--comm: '$comm' is not one of $(paste -sd, - <<< "$known")"
done
((${#runs[@]} > 0)) || die "no runs"

if ((dry_run)); then
    pass+=(--dry-run)
fi
total=$((${#runs[@]} * ${#comms[@]}))
n=0
for run in "${runs[@]}"; do
    for comm in "${comms[@]}"; do
        n=$((n + 1))
        printf '### [%d/%d] %s %s %s\n' "$n" "$total" "$config" "$run" "$comm"
        bash "$here/launch.sh" --config "$config" --run "$run" --comm "$comm" "${pass[@]}"
    done
done
