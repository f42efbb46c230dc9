#!/usr/bin/env bash
# The README's main-job command: fine-tune with every state on NVMe, then print a summary.
# It installs only what the job itself needs, and only what is missing (scripts/_job_needs.py):
# torch 2.13.0 where none is installed (pip's default build for the machine), the package with its native libraries,
# transformers. An installed package is never replaced or upgraded, and when nothing is missing
# training starts at once. The developer set-up (the test tools at their tested versions, an
# editable install) is scripts/setup_env.sh, which scripts/test.sh runs.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# -P: the installed package, not the clone's source folder that this directory would put first.
need=" $("$PY" -P scripts/_job_needs.py | tr '\n' ' ')"
if [[ $need == *" unsupported-torch "* ]]; then
  tv=$("$PY" -P -c 'import importlib.metadata as m; print(m.version("torch"))')
  echo "[run] infinity is built for torch >=2.4,<2.15 and this environment has torch $tv, which installing it" \
       "would replace; run.sh replaces nothing: use a virtual environment, or install torch==2.13.0 yourself" >&2
  exit 2
fi
if [[ $need == *" torch "* ]]; then
  echo "[run] installing torch==2.13.0 (no torch is installed)"
  "$PY" -m pip install -q "torch==2.13.0"
fi
if [[ $need == *" build-tools "* ]]; then
  echo "[run] installing the build's tools (cffi, pybind11, setuptools, wheel) where missing"
  "$PY" -m pip install -q cffi pybind11 setuptools wheel
fi
if [[ $need == *" infinity "* ]]; then
  if ! [ -e /usr/include/liburing.h ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "[run] installing liburing-dev (native/aio's io_uring backend)"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq liburing-dev) >/dev/null \
      || echo "[run] could not install liburing-dev; native/aio will use its thread-pool backend"
  fi
  echo "[run] installing infinity (pip install --no-build-isolation .)"
  "$PY" -m pip install -q --no-build-isolation .
fi
if [[ $need == *" transformers "* ]]; then
  echo "[run] installing transformers (the job's models and tokenizers)"
  "$PY" -m pip install -q "transformers>=5"
fi
exec "$PY" -P -m infinity.train "$@"
