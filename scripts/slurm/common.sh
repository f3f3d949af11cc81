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
