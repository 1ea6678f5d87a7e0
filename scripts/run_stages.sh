#!/usr/bin/env bash
# Run the context-stage chain 8K -> 64K -> 256K -> 1M: each stage is one ./run_train.sh job whose
# config loads the previous stage's final checkpoint (checkpoint.initial_load_path).
#   scripts/run_stages.sh [--section.key value ...]      (extra arguments go to every stage)
#   STAGE_DIR=configs/stages STAGES="8k 64k 256k 1m" NGPU=1 scripts/run_stages.sh
# Run again after an interruption: each stage resumes from its newest checkpoint (torchtitan's
# resume), so the chain carries on where it stopped.
set -euo pipefail
cd "$(dirname "$0")/.."

STAGE_DIR=${STAGE_DIR:-configs/stages}
STAGES=${STAGES:-"8k 64k 256k 1m"}

for stage in $STAGES; do
    config="$STAGE_DIR/$stage.toml"
    if [[ ! -f "$config" ]]; then
        echo "error: stage config not found: $config (STAGE_DIR=$STAGE_DIR, STAGES=$STAGES)" >&2
        exit 2
    fi
    echo "=== stage $stage ($config)"
    CONFIG_FILE="$config" ./run_train.sh "$@"
done
