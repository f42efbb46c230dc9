#!/usr/bin/env bash
# The README's test command: set up what is missing, then run the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
if [ "${1:-}" = "--sanitize" ]; then  # the native libraries under ASan + UBSan, with their tests
    shift
    exec bash scripts/test_sanitize.sh "$@"
fi
"${PYTHON:-python3}" -m ruff check .  # lint: pyflakes, pycodestyle, import order (pyproject.toml)
"${PYTHON:-python3}" -m mypy  # types of the core modules (pyproject.toml, Note [type checking])
exec "${PYTHON:-python3}" -m pytest -q "$@"
