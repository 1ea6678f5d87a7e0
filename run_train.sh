#!/usr/bin/env bash
# Launch titan_moe training on NGPU processes of this machine (CUDA + nccl, or CPU + gloo).
#   CONFIG_FILE=configs/<name>.toml NGPU=<n> ./run_train.sh [--section.key value ...]
# The config is checked once before torchrun starts, so a bad key or value is one error line.
set -euo pipefail

CONFIG_FILE=${CONFIG_FILE:-configs/debug.toml}
NGPU=${NGPU:-1}
export NGPU

if [[ ! "$NGPU" =~ ^[1-9][0-9]*$ ]]; then
    echo "error: NGPU must be a positive integer, got '$NGPU'" >&2
    exit 2
fi
if [[ ! -f "$CONFIG_FILE" ]]; then
    echo "error: config file not found: $CONFIG_FILE (set CONFIG_FILE=configs/<name>.toml)" >&2
    exit 2
fi

# On CPU the gloo ranks share the cores; one OpenMP pool per core avoids oversubscription.
if [[ -z "${OMP_NUM_THREADS:-}" ]]; then
    OMP_NUM_THREADS=$(( $(nproc) / NGPU ))
    export OMP_NUM_THREADS=$(( OMP_NUM_THREADS > 0 ? OMP_NUM_THREADS : 1 ))
fi

python -m titan_moe.train.config --job.config_file "$CONFIG_FILE" "$@"

exec torchrun --standalone --nproc_per_node="$NGPU" --local-ranks-filter "${LOG_RANK:-0}" \
    --role rank --tee 3 -m titan_moe.train --job.config_file "$CONFIG_FILE" "$@"
