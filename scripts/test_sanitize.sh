#!/usr/bin/env bash
# Both native libraries built with AddressSanitizer + UndefinedBehaviorSanitizer into a temp
# dir (never over the installed ones), then their tests run against them: any report fails.
#   bash scripts/test_sanitize.sh [pytest args]     (scripts/test.sh --sanitize calls this)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
start=$(date +%s)

# A copy of the Python package, whose native modules the sanitized build replaces.
mkdir -p "$TMP/pkg"
cp -r infinity "$TMP/pkg/"
find "$TMP/pkg/infinity" -name '*.so' -delete
INFINITY_SANITIZE=1 "$PY" setup.py -q build_ext --build-lib "$TMP/pkg" --build-temp "$TMP/build" >"$TMP/build.log" 2>&1 ||
    { cat "$TMP/build.log"; exit 1; }
ls "$TMP/pkg/infinity/"*.so >/dev/null

# Python itself is not instrumented: preload the runtime; its leak checker would report
# every interpreter allocation, so it is off. UBSan stops at its first report.
# libstdc++ is preloaded too: without it ASan cannot find the real __cxa_throw when torch
# throws a C++ exception (a CHECK failure in asan_interceptors.cpp, then abort).
export LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so)"
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:halt_on_error=1:log_path=$TMP/asan"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:log_path=$TMP/ubsan"
export PYTHONPATH="$TMP/pkg"
cd "$TMP/pkg"
status=0
"$PY" - <<'PY' || status=$?
import infinity, os
assert os.path.dirname(infinity.__file__).endswith("pkg/infinity"), infinity.__file__
from infinity.aio import AsyncIO
from infinity.optim import simd_path
AsyncIO().close()  # both native modules load under the sanitizers
print("sanitized build:", os.path.dirname(infinity.__file__), "CPU Adam path:", simd_path())
PY
[ $status -eq 0 ] && { "$PY" -m pytest -q -p no:cacheprovider --rootdir "$ROOT" -c "$ROOT/pyproject.toml" \
    "$ROOT/tests/unit/test_aio.py" "$ROOT/tests/integration/test_aio_errors.py" "$ROOT/tests/unit/test_cpu_adam.py" \
    "$ROOT/tests/unit/test_native_abi.py" "$ROOT/tests/unit/test_checksums.py" \
    -k "not training and not corrupt_swap and not gradient and not init_store and not trains_on" \
    "$@" || status=$?; }
unset LD_PRELOAD
reports=$(cat "$TMP"/asan.* "$TMP"/ubsan.* 2>/dev/null || true)
if [ -n "$reports" ]; then
    echo "$reports"
    echo "sanitizer reports found (above)"
    status=1
fi
echo "sanitize run: exit $status in $(( $(date +%s) - start )) s"
exit $status
