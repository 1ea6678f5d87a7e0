#!/usr/bin/env bash
# GRPO post-training (one process), the RL sibling of run_train.sh.
#   CONFIG_FILE=configs/rl_debug.toml scripts/run_rl.sh [--table.key VALUE ...]
set -euo pipefail

CONFIG_FILE=${CONFIG_FILE:-configs/rl_debug.toml}
if [[ ! -f "$CONFIG_FILE" ]]; then
    echo "error: config file not found: $CONFIG_FILE (set CONFIG_FILE=configs/<name>.toml)" >&2
    exit 2
fi
exec python -m titan_moe.rl.train --config "$CONFIG_FILE" "$@"
