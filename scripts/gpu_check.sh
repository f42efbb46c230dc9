#!/usr/bin/env bash
# One command for a bare machine with one NVIDIA GPU (no internet, no cffi, no liburing, no
# DeepSpeed, no libaio):
#
#   bash scripts/gpu_check.sh OUTDIR
#
# installs the carried wheels (.whl/) the image lacks, DeepSpeed's among them, starts building
# DeepSpeed's JIT ops (cpu_adam, async_io against the carried libaio) in the background, builds
# the native libraries against the carried liburing (.gpu_libs/; both made by
# scripts/gpu_check/prepare_carry.sh on the CPU machine), then runs the phases, each
# under its own time limit, a failed one not stopping the next: env, peers (benchmarks/peers.py:
# plain PyTorch, infinity, DeepSpeed and FSDP2 head to head at GPT-2 124M and 1.5B), matrix
# (tests/integration/test_device_matrix.py), profile (benchmarks/step_profile.py: where the
# step's time goes, and the run model's prediction), ordering (tests/unit/test_device_ordering.py),
# oom (scripts/gpu_check/oom.py: a real out-of-memory error in backward on GPT-2, recovered, the
# allocated bytes before and after), train (one torchrun rank of infinity.train), primitives
# (benchmarks/device_primitives.py, last: what time is left). Writes OUTDIR/results.jsonl (one JSON object a
# line, each with its "phase"), OUTDIR/log.txt (everything the phases printed) and
# OUTDIR/summary.txt (the table printed at the end), OUTDIR/traces.tar.gz (the profile phase's
# traces of one step each). Without CUDA the tests are skipped (or run
# on GPU_CHECK_ACCELERATOR, e.g. emulated) and the benchmarks run at their smoke sizes.
# GPU_CHECK_BUDGET: seconds for the whole check (default 525: it fits 9 minutes);
# GPU_CHECK_DISK: where temp files for the disk measurements go (default /var/tmp);
# GPU_CHECK_PHASES: a comma-separated list to run only those phases (the set-up ones always run:
# wheels, deepspeed, build); GPU_CHECK_PEERS_S: seconds for the peers phase (default 255);
# GPU_CHECK_TAIL_S: seconds the profile phase leaves for the phases after it (default 100);
# GPU_CHECK_CLIP: the gradient norm every peers contender clips at (default 0: none, since the
# speculative update's guess, whose cell infinity-cpu-speculative runs beside infinity-cpu at
# 1.5B, stands only where a step does not clip, and GPT-2 from random weights on random tokens
# clips every step at 1.0; Note [speculative update] in infinity/_zero/_speculative_update.py).
set -u
cd "$(dirname "$0")/.."
OUT=$(mkdir -p "${1:?usage: bash scripts/gpu_check.sh OUTDIR}" && cd "$1" && pwd)
: > "$OUT/results.jsonl"
: > "$OUT/log.txt"
export GPU_CHECK_DEADLINE=$(( $(date +%s) + ${GPU_CHECK_BUDGET:-525} ))
PEERS_S=${GPU_CHECK_PEERS_S:-255} TAIL_S=${GPU_CHECK_TAIL_S:-100} CLIP=${GPU_CHECK_CLIP:-0}
PY=${PYTHON:-python3}
export GPU_CHECK_DISK=${GPU_CHECK_DISK:-/var/tmp}
[ -d "$GPU_CHECK_DISK" ] || GPU_CHECK_DISK=${TMPDIR:-/tmp}
phase() {  # name, limit, phase.py's options and command
  case ",${GPU_CHECK_PHASES:-$1},wheels,deepspeed,build," in
    *",$1,"*) "$PY" scripts/gpu_check/phase.py run "$OUT" "$@" ;;  # the setting names it, or there is none
    *) "$PY" scripts/gpu_check/phase.py run "$OUT" "$1" "$2" --skip "not in GPU_CHECK_PHASES" ;;
  esac
}

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
fi
# DeepSpeed with every dependency it needs, all carried and installed as one set (pydantic with
# its own core), for the peers phase; the set is built for CPython 3.12, the GPU image's.
ds_wheels=$(ls .whl/{deepspeed,hjson,einops,msgpack,pydantic,pydantic_core,annotated_types,typing_inspection,typing_extensions}-*.whl 2>/dev/null)
if "$PY" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("deepspeed") is None)'; then
  phase deepspeed 60 --skip "installed"
elif ! ls .whl/deepspeed-*.whl >/dev/null 2>&1; then
  phase deepspeed 60 --skip "no DeepSpeed wheel in .whl/ (scripts/gpu_check/prepare_carry.sh)"
elif ! "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
  phase deepspeed 60 --skip "the carried wheels are for CPython 3.12, not $("$PY" -c 'import platform; print(platform.python_version())')"
else
  phase deepspeed 60 -- bash -c 'install_wheels "$@"' _ $ds_wheels
fi
[ -d "$SITE" ] && export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

cuda=$("$PY" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)

# DeepSpeed's JIT ops (cpu_adam; async_io, its NVMe offload, against the carried libaio), built
# in the background from here on (40-80 s on 16 cores, beside the native build and the first
# phases); the peers phase waits for deepspeed_ops.rc before its first DeepSpeed contender. Its
# async_io build refuses torch's arch entries such as the image's "9.0a" (DeepSpeed parses each
# as numbers): the GPU's own capability instead. The carried libaio's links are made again
# should the transfer drop them.
AIO=$PWD/.gpu_libs/libaio
if [ -e "$AIO/include/libaio.h" ]; then
  so=$(cd "$AIO/lib" && ls libaio.so.1.* 2>/dev/null | head -1)
  for link in libaio.so.1 libaio.so; do
    [ -e "$AIO/lib/$link" ] || [ -z "$so" ] || ln -sf "$so" "$AIO/lib/$link"
  done
  export CPATH="$AIO/include${CPATH:+:$CPATH}" LIBRARY_PATH="$AIO/lib${LIBRARY_PATH:+:$LIBRARY_PATH}"
  export LD_LIBRARY_PATH="$AIO/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-${TMPDIR:-/tmp}/gpu_check_torch_extensions}
if [ "$cuda" = 1 ]; then
  export TORCH_CUDA_ARCH_LIST=$("$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')
fi
ds_ops="" ds_skip=""
if ! "$PY" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("deepspeed") is None)' 2>/dev/null; then
  ds_skip="DeepSpeed is not installed (scripts/gpu_check/prepare_carry.sh carries it)"
elif [ "$cuda" != 1 ]; then
  ds_skip="no CUDA: the peers phase runs no DeepSpeed contender"
else
  build_ds_ops() {
    local start=$SECONDS
    timeout 300 "$PY" -c 'from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder
CPUAdamBuilder().load()
AsyncIOBuilder().load()'
    local rc=$?
    echo "{\"built_s\": $((SECONDS - start)), \"rc\": $rc, \"arch_list\": \"$TORCH_CUDA_ARCH_LIST\"}"
    echo $rc > "$OUT/.deepspeed_ops.rc" && mv "$OUT/.deepspeed_ops.rc" "$OUT/deepspeed_ops.rc"
  }
  rm -f "$OUT/deepspeed_ops.rc"
  build_ds_ops > "$OUT/deepspeed_ops.log" 2>&1 &
  ds_ops=$!
fi

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

# The head-to-head: both sizes for plain, infinity and DeepSpeed on cpu; NVMe at 124M; FSDP2 at
# 1.5B last, if time allows. The benchmark's own budget ends before the phase's limit.
if [ "$cuda" = 1 ]; then
  left=$(( GPU_CHECK_DEADLINE - $(date +%s) - 15 ))
  peers=(--sizes 124m,1.5b --budget $(( left < PEERS_S ? left : PEERS_S )) --timeout 150 --clip "$CLIP"
         --only plain,infinity-cpu,infinity-cpu-speculative@1.5b,deepspeed-cpu,infinity-nvme@124m,deepspeed-nvme@124m,fsdp2-cpu@1.5b)
  [ -n "$ds_ops" ] && peers+=(--deepspeed-ops-ready "$OUT/deepspeed_ops.rc")
else
  peers=(--smoke)
fi
phase peers $(( PEERS_S + 15 )) -- "$PY" -m benchmarks.peers "${peers[@]}" --nvme-path "$GPU_CHECK_DISK"
if [ -n "$ds_ops" ]; then  # the build's own record: its time, and its output in the log
  wait "$ds_ops"
  phase deepspeed_ops 30 -- bash -c 'cat "$1"; exit "$(cat "$2")"' _ "$OUT/deepspeed_ops.log" "$OUT/deepspeed_ops.rc"
else
  phase deepspeed_ops 30 --skip "$ds_skip"
fi

tests matrix 150 tests/integration/test_device_matrix.py

# Where the step's time goes (benchmarks/step_profile.py): the 1.5B step with every state in host
# memory, its parts, the telemetry's bytes and waits, the GPU's idle time, and the run model's
# prediction from rates measured there; the speculative update (unclipped) beside it; the
# prefetcher off beside on at 124M on NVMe (and at 1.5B, if time is left).
if [ "$cuda" = 1 ]; then
  left=$(( GPU_CHECK_DEADLINE - $(date +%s) - TAIL_S ))  # leaves the ordering, oom and train phases their time
  profile=(--only 1.5b/cpu/overlap,1.5b/cpu/speculate,124m/nvme/prefetch,124m/nvme/no-prefetch,1.5b/cpu/no-prefetch
           --budget $(( left < 150 ? left : 150 )) --timeout 70)
else
  profile=(--smoke --only 1.5b/cpu/overlap,124m/nvme/no-prefetch)
fi
# Each cell's profiled step as a Chrome trace, the engine's ranges named after their units (Note
# [profiler ranges] in infinity/_runtime/_telemetry_counters.py), packed into OUTDIR/traces.tar.gz
# (one file: what comes back from the GPU machine is counted in files).
phase profile 160 -- "$PY" -m benchmarks.step_profile "${profile[@]}" --nvme-path "$GPU_CHECK_DISK" \
  --trace "$OUT/traces"
[ -d "$OUT/traces" ] && tar -C "$OUT" -czf "$OUT/traces.tar.gz" traces && rm -rf "$OUT/traces"
tests ordering 40 tests/unit/test_device_ordering.py
# A real out-of-memory error in backward (GPT-2 124M, the device capped between the big batch's
# forward and backward peaks), recovered: zero_grad, the allocated bytes back, smaller batches on.
phase oom 40 ${nogpu:+--skip "$nogpu"} -- env INFINITY_ACCELERATOR="$ACC" "$PY" scripts/gpu_check/oom.py $tiny
phase train 45 -- "$PY" scripts/gpu_check/train_one_rank.py --timeout 40
phase primitives 30 -- "$PY" -m benchmarks.device_primitives ${tiny:+--smoke} --budget 27 --timeout 25 --max-seconds 14 \
  --nvme-path "$GPU_CHECK_DISK"

"$PY" scripts/gpu_check/phase.py summary "$OUT" | tee "$OUT/summary.txt"
