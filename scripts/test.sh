#!/usr/bin/env bash
# The README's test command: set up what is missing, then run the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec "${PYTHON:-python3}" -m pytest -q "$@"
