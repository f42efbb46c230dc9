#!/usr/bin/env bash
# Idempotent set-up for a fresh machine: system library, torch (CPU build pinned), the
# package with its native libraries. Safe to run again; it only does what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# liburing headers for native/aio (the build falls back to a thread pool without them).
if ! [ -e /usr/include/liburing.h ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "[setup] installing liburing-dev"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq liburing-dev) >/dev/null \
      || echo "[setup] could not install liburing-dev; native/aio will use its thread-pool backend"
  else
    echo "[setup] liburing-dev missing and not root: native/aio will use its thread-pool backend"
  fi
fi

# xfsprogs for the cloned-checkpoint tests, which make and loop-mount an XFS with reflink (skipped without it).
if ! command -v mkfs.xfs >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "[setup] installing xfsprogs"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq xfsprogs) >/dev/null \
    || echo "[setup] could not install xfsprogs; the cloned-checkpoint tests will be skipped"
fi

# torch: pinned, because a bare requirement pulls a multi-GB CUDA build.
if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "[setup] installing torch==2.13.0"
  "$PY" -m pip install -q "torch==2.13.0"
fi

# Build and runtime dependencies, and the test ones (TRL and datasets for tests/integration/test_trl.py and the TRL
# examples), at the versions the suite was run with: constraints.txt. A package that is missing, or installed at
# another version than its line there, is installed at that version (a new release does not reach CI until a commit
# raises it; scripts/check_latest.sh tries the newest first). The installed torch is named with them, so no
# requirement can pull another build.
need=$("$PY" scripts/_deps.py missing cffi pybind11 psutil PyYAML tqdm safetensors numpy transformers accelerate peft \
       trl datasets tokenizers huggingface_hub pytest pytest-xdist ruff mypy matplotlib setuptools wheel)
if [ -n "$need" ]; then
  echo "[setup] installing $need"
  torch_pin="torch==$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')"
  "$PY" -m pip install -q -c constraints.txt $need "$torch_pin"
fi

# The package itself, rebuilt only when its sources or build files change.
stamp=".build-stamp"
sig=$( (cat setup.py pyproject.toml; find native -type f \( -name '*.c' -o -name '*.cc' -o -name '*.cpp' \
        -o -name '*.h' -o -name '*.hpp' -o -name '*.py' \) -print0 | sort -z | xargs -0 cat 2>/dev/null) \
      | sha256sum | cut -c1-16)
here=$(pwd -P)
installed=$(cd / && "$PY" -c "import infinity, os; print(os.path.dirname(os.path.dirname(os.path.realpath(infinity.__file__))))" 2>/dev/null || true)
if [ "$(cat "$stamp" 2>/dev/null)" != "$sig" ] || [ "$installed" != "$here" ]; then
  echo "[setup] building infinity (pip install -e .)"
  "$PY" -m pip install -q --no-build-isolation --no-deps -e . 
  echo "$sig" > "$stamp"
fi
