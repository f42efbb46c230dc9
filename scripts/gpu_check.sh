#!/usr/bin/env bash
# One command for a bare machine with one NVIDIA GPU (no internet, no cffi, no liburing):
#
#   bash scripts/gpu_check.sh OUTDIR
#
# installs the carried wheels (.whl/) the image lacks, builds the native libraries against the
# carried liburing (.gpu_libs/; both made by scripts/gpu_check/prepare_carry.sh on the CPU
# machine), then runs the phases, each under its own time limit, a failed one not stopping the
# next: env, matrix (tests/test_device_matrix.py), ordering (tests/test_device_ordering.py),
# primitives (scripts/bench_device_primitives.py), headline (scripts/bench_gpu_headline.py),
# train (one torchrun rank of infinity.train). Writes OUTDIR/results.jsonl (one JSON object a
# line, each with its "phase"), OUTDIR/log.txt (everything the phases printed) and
# OUTDIR/summary.txt (the table printed at the end). Without CUDA the tests are skipped (or run
# on GPU_CHECK_ACCELERATOR, e.g. emulated) and the benchmarks run at their tiny sizes.
# GPU_CHECK_BUDGET: seconds for the whole check (default 470); GPU_CHECK_DISK: where temp files
# for the disk measurements go (default /var/tmp).
set -u
cd "$(dirname "$0")/.."
OUT=$(mkdir -p "${1:?usage: bash scripts/gpu_check.sh OUTDIR}" && cd "$1" && pwd)
: > "$OUT/results.jsonl"
: > "$OUT/log.txt"
export GPU_CHECK_DEADLINE=$(( $(date +%s) + ${GPU_CHECK_BUDGET:-470} ))
PY=${PYTHON:-python3}
export GPU_CHECK_DISK=${GPU_CHECK_DISK:-/var/tmp}
[ -d "$GPU_CHECK_DISK" ] || GPU_CHECK_DISK=${TMPDIR:-/tmp}
phase() { "$PY" scripts/gpu_check/phase.py run "$OUT" "$@"; }

# Python packages: the carried wheels of those the image lacks, into a folder of their own
# (never a previous run's, perhaps for another Python). pip where the venv has it, else unzipped:
# a wheel is laid out for site-packages.
export PY SITE=${TMPDIR:-/tmp}/gpu_check_site
rm -rf "$SITE"
install_wheels() {
  if "$PY" -m pip --version >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$@"
  else
    for w in "$@"; do "$PY" -m zipfile -e "$w" "$SITE" || return 1; done
  fi
}
export -f install_wheels
missing=$("$PY" -c 'import importlib.util as u; print(*[m for m in ("cffi", "pycparser", "tqdm") if not u.find_spec(m)])')
wheels=$(for m in $missing; do ls .whl/"$m"-*.whl 2>/dev/null; done)
if [ -z "$missing" ]; then
  phase wheels 60 --skip "none missing"
elif [ -z "$wheels" ]; then
  phase wheels 60 --skip "missing: $missing, and no wheels in .whl/ (scripts/gpu_check/prepare_carry.sh)"
else
  phase wheels 60 -- bash -c 'install_wheels "$@"' _ $wheels
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# Native libraries against the carried liburing: headers and a static library, so the built
# module needs no liburing at run time (the env phase says which aio backend came out). Built
# beside the tree, then renamed into place where changed: a process still using the old file
# keeps it.
export CPATH="$PWD/.gpu_libs/include${CPATH:+:$CPATH}"
export LIBRARY_PATH="$PWD/.gpu_libs/lib${LIBRARY_PATH:+:$LIBRARY_PATH}"
build_native() {
  "$PY" setup.py -q build_ext -j "$(nproc)" --build-lib build/gpu_check || return 1
  for so in build/gpu_check/infinity/*.so; do
    cmp -s "$so" "infinity/${so##*/}" || { cp "$so" "infinity/.new.${so##*/}" && mv -f "infinity/.new.${so##*/}" "infinity/${so##*/}"; } || return 1
  done
}
export -f build_native
phase build 180 -- bash -c build_native

cuda=$("$PY" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)
ACC=${GPU_CHECK_ACCELERATOR:-cuda}
nogpu="" tiny=""
if [ "$cuda" != 1 ]; then
  tiny="--tiny"
  [ "$ACC" = cuda ] && nogpu="no CUDA (GPU_CHECK_ACCELERATOR=emulated runs the tests without one)"
fi
tests() {  # phase name, limit, test file
  phase "$1" "$2" --needs "$3" ${nogpu:+--skip "$nogpu"} -- env INFINITY_ACCELERATOR="$ACC" \
    PYTHONPATH="$PWD/scripts/gpu_check:$PYTHONPATH" "$PY" -m pytest -q -p pytest_jsonl -p no:cacheprovider "$3"
}

phase env 30 -- "$PY" scripts/gpu_check/env_info.py
tests matrix 150 tests/test_device_matrix.py
tests ordering 60 tests/test_device_ordering.py
phase primitives 60 -- "$PY" scripts/bench_device_primitives.py $tiny
phase headline 150 -- "$PY" scripts/bench_gpu_headline.py --budget 140 $tiny
phase train 60 -- "$PY" scripts/gpu_check/train_one_rank.py --timeout 50

"$PY" scripts/gpu_check/phase.py summary "$OUT" | tee "$OUT/summary.txt"
