#!/usr/bin/env bash
# The README's main-job command: set up what is missing, then fine-tune with offload.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec "${PYTHON:-python3}" -m infinity.train "$@"
