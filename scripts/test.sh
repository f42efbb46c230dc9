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
"${PYTHON:-python3}" -m mypy  # types of the core modules (pyproject.toml, Note [type checking] in pyproject.toml)
# Two test processes where there are two cores (pytest-xdist): most tests keep one core busy
# (a rank's start, a subprocess, an in-process test on one thread). Whole files go to a worker,
# so a file's module fixtures run once; a later -n in "$@" wins. Not with the `machine` marker:
# those tests change machine-wide settings that a test in the other worker would run under.
workers=$("${PYTHON:-python3}" -c "import os; print(min(2, len(os.sched_getaffinity(0))))")
parallel=()
case " $* " in *machine*) workers=1 ;; esac
if [ "$workers" -ge 2 ]; then parallel=(-n "$workers" --dist loadfile); fi
exec "${PYTHON:-python3}" -m pytest -q "${parallel[@]}" "$@"
