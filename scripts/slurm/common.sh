#!/usr/bin/env bash
# Shared by launch.sh and sweep.sh (sourced): how to call charm-megatron.
# CHARM_MEGATRON overrides; else the installed command; else the module with $PYTHON.
# shellcheck disable=SC2034  # cm is read by the scripts that source this file
if [[ -n ${CHARM_MEGATRON:-} ]]; then
    cm=("$CHARM_MEGATRON")
elif command -v charm-megatron > /dev/null 2>&1; then
    cm=(charm-megatron)
else
    cm=("${PYTHON:-python3}" -m charm_megatron.cli)
fi

# The job runs `python -m charm_megatron.pretrain_gpt`, which runs Megatron-LM's pretrain_gpt.py
# from $MEGATRON_LM_PATH (or from the job's working directory, the submit directory). Checked
# at submit time, so that a missing checkout fails here and not after the job waited in the
# queue. Prints the reason and returns 1 when there is none.
check_megatron_lm() {
    local root=${MEGATRON_LM_PATH:-}
    if [[ -z $root ]]; then
        if [[ -f pretrain_gpt.py && -d megatron/training ]]; then
            return 0  # submitting from a Megatron-LM checkout: the job finds it there
        fi
        printf 'MEGATRON_LM_PATH is not set: the job runs Megatron-LM'"'"'s pretrain_gpt.py; export MEGATRON_LM_PATH=/path/to/Megatron-LM (a core_v0.16.1 checkout, seen from the compute nodes) and submit again\n'
        return 1
    fi
    if [[ ! -f $root/pretrain_gpt.py || ! -d $root/megatron/training ]]; then
        printf 'MEGATRON_LM_PATH=%s is not a Megatron-LM checkout (it needs pretrain_gpt.py and megatron/training/): git clone https://github.com/NVIDIA/Megatron-LM && git -C Megatron-LM checkout core_v0.16.1\n' "$root"
        return 1
    fi
}
