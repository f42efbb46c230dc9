#!/usr/bin/env bash
# The README's test command: set up what is missing, then run the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
"${PYTHON:-python3}" -m ruff check .  # lint: pyflakes, pycodestyle, import order (pyproject.toml)
exec "${PYTHON:-python3}" -m pytest -q "$@"
